import os
from pathlib import Path

import pynvml
import pytest
from samples.nvml import DRIVER_VERSION, H100_BUS_IDS, H100_UUIDS, RecordedNvml

from llmgw.agent.discovery.gpus import discover_gpus
from llmgw.bus.records import MAX_GPU_PROCESSES
from llmgw.sim.nvml import DRIVER_RESERVED


def test_eight_h100s_are_listed_in_nvml_order_with_uuids_and_bus_ids():
    gpus = discover_gpus(RecordedNvml())

    assert gpus.status == "ok"
    assert gpus.driver_version == DRIVER_VERSION
    assert [g.index for g in gpus.devices] == list(range(8))
    assert [g.uuid for g in gpus.devices] == H100_UUIDS
    assert [g.pci_bus_id for g in gpus.devices] == H100_BUS_IDS
    first = gpus.devices[0]
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory_total_bytes == 85_520_809_984
    assert first.compute_capability == "9.0"


def test_old_pynvml_bytes_answers_are_decoded_to_text():
    gpus = discover_gpus(RecordedNvml(old_bytes=True))

    assert gpus.driver_version == "550.54.15"
    assert gpus.devices[3].name == "NVIDIA H100 80GB HBM3"
    assert gpus.devices[3].uuid == H100_UUIDS[3]
    assert gpus.devices[3].pci_bus_id == "00000000:5D:00.0"


def test_node_without_nvml_library_is_a_node_without_gpus_not_an_error():
    gpus = discover_gpus(RecordedNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))

    assert gpus.status == "no_library"
    assert gpus.devices == []
    assert "not found" in gpus.detail


def test_library_without_loaded_driver_reports_no_driver():
    gpus = discover_gpus(RecordedNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))

    assert gpus.status == "no_driver"
    assert gpus.devices == []
    assert "Driver Not Loaded" in gpus.detail


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, "NVMLError_NoPermission"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "NVMLError_LibRmVersionMismatch"),
    ],
)
def test_other_init_failures_are_errors_naming_the_nvml_error(code, name):
    gpus = discover_gpus(RecordedNvml(init_error=code))

    assert gpus.status == "error"
    assert name in gpus.detail
    assert gpus.devices == []


def test_one_lost_gpu_reports_error_and_keeps_the_seven_that_answered():
    nvml = RecordedNvml(failing_devices={5: pynvml.NVML_ERROR_GPU_IS_LOST})

    gpus = discover_gpus(nvml)

    assert gpus.status == "error"
    assert [g.index for g in gpus.devices] == [0, 1, 2, 3, 4, 6, 7]
    assert "GPU 5: GPU is lost" in gpus.detail
    assert "1 of 8" in gpus.detail


def test_nvml_is_shut_down_after_success_and_after_a_failure_past_init():
    ok = RecordedNvml()
    failed = RecordedNvml(count_error=pynvml.NVML_ERROR_UNKNOWN)

    discover_gpus(ok)
    result = discover_gpus(failed)

    assert (ok.shutdowns, ok.initialised) == (1, 0)
    assert (failed.shutdowns, failed.initialised) == (1, 0)
    assert result.status == "error"


def test_failed_init_is_not_followed_by_shutdown():
    # nvmlShutdown without a successful nvmlInit is itself an NVML error
    nvml = RecordedNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    discover_gpus(nvml)

    assert nvml.shutdowns == 0


def test_real_nvml_on_a_machine_without_nvidia_library_does_not_raise():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVML library")

    gpus = discover_gpus()

    assert gpus.status == "no_library"
    assert gpus.devices == []


# --- what a GPU is doing: memory used, the processes holding it, its fault counters ---------

GB = 1_000_000_000


class Lookup:
    """Names and ownership as HostProcesses would answer them."""

    def __init__(self, names: dict[int, str], own: set[int] = frozenset()) -> None:
        self.names, self.mine = names, own

    def name(self, pid: int) -> str:
        return self.names.get(pid, "")

    def own(self, pid: int) -> bool:
        return pid in self.mine

    def engine(self, pid: int) -> int | None:
        return pid if pid in self.mine else None  # each its own engine's leader


def test_used_memory_and_the_processes_holding_it_are_reported_foreign_first():
    nvml = RecordedNvml(
        processes={3: [(7001, 20 * GB), (4242, 60 * GB), (4300, 1 * GB)], 0: [(7001, 70 * GB)]}
    )

    gpus = discover_gpus(nvml, Lookup({4242: "python", 7001: "vllm"}, own={7001}))

    idle, busy = gpus.devices[1], gpus.devices[3]
    assert idle.memory_used_bytes == DRIVER_RESERVED and idle.processes == []
    assert busy.memory_used_bytes == DRIVER_RESERVED + 81 * GB
    assert [(p.pid, p.name, p.used_bytes, p.own) for p in busy.processes] == [
        (4242, "python", 60 * GB, False),
        (4300, "", 1 * GB, False),  # ended before its name was read
        (7001, "vllm", 20 * GB, True),
    ]
    assert busy.foreign_bytes() == 61 * GB
    assert gpus.devices[0].foreign_bytes() == 0


def test_a_process_with_compute_and_graphics_contexts_is_listed_once():
    nvml = RecordedNvml(processes={2: [(4242, 5 * GB)]}, graphics={2: [(4242, 5 * GB), (9, GB)]})

    gpu = discover_gpus(nvml).devices[2]

    assert [(p.pid, p.used_bytes) for p in gpu.processes] == [(4242, 5 * GB), (9, GB)]


def test_a_gpu_lists_at_most_16_processes_and_counts_the_memory_of_the_rest():
    many = [(1000 + i, (i + 1) * GB) for i in range(20)]  # 1..20 GB
    nvml = RecordedNvml(processes={0: many + [(7001, 30 * GB)]})

    gpu = discover_gpus(nvml, Lookup({}, own={7001})).devices[0]

    assert len(gpu.processes) == MAX_GPU_PROCESSES == 16
    assert [p.pid for p in gpu.processes[:2]] == [1019, 1018]  # foreign, largest first
    assert all(not p.own for p in gpu.processes)  # the own engine is the first left out
    assert gpu.processes_unlisted == 5
    assert gpu.unlisted_foreign_bytes == (1 + 2 + 3 + 4) * GB
    assert gpu.foreign_bytes() == sum(range(1, 21)) * GB


def test_memory_nvml_cannot_attribute_counts_as_held_by_the_process_it_cannot_tell():
    # usedGpuMemory NVML_VALUE_NOT_AVAILABLE: pynvml answers None
    nvml = RecordedNvml(processes={1: [(4242, None), (7001, 10 * GB)]}, unlisted_used={1: 40 * GB})

    gpu = discover_gpus(nvml, Lookup({}, own={7001})).devices[1]

    assert gpu.processes[0].used_bytes is None
    assert gpu.foreign_bytes() == DRIVER_RESERVED + 40 * GB


def test_process_lists_nvml_refuses_leave_every_gpu_reported_without_processes():
    nvml = RecordedNvml(processes={0: [(4242, GB)]}, process_error=pynvml.NVML_ERROR_NO_PERMISSION)

    gpus = discover_gpus(nvml)

    assert gpus.status == "ok" and len(gpus.devices) == 8
    assert gpus.devices[0].processes == []


def test_fault_counters_read_as_a_hopper_gpu_answers_them():
    nvml = RecordedNvml(ecc_uncorrected={2: 3}, remapped_rows={5: (0, 1, 1, 0), 6: (0, 2, 0, 1)})

    devices = discover_gpus(nvml).devices

    healthy = devices[0].errors
    assert healthy.ecc_uncorrected_volatile == 0
    assert healthy.retired_pages_pending is None  # NOT_SUPPORTED: Hopper remaps rows
    assert (healthy.remapped_rows_pending, healthy.remapping_failed) == (False, False)
    assert devices[2].errors.ecc_uncorrected_volatile == 3
    assert devices[5].errors.remapped_rows_pending is True
    assert devices[6].errors.remapping_failed is True


def test_a_gpu_without_ecc_reports_its_counter_unknown_not_zero():
    nvml = RecordedNvml()

    def no_ecc(handle, error_type, counter):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nvml.nvmlDeviceGetTotalEccErrors = no_ecc

    assert discover_gpus(nvml).devices[0].errors.ecc_uncorrected_volatile is None


# --- own or foreign: /proc/<pid>/{stat,comm,cmdline,environ} and the engines' pidfiles ----------

BTIME = 1_796_293_707
TICKS = os.sysconf("SC_CLK_TCK")  # what the agent divides start times by
ENGINE_ARGV = ["/opt/vllm/bin/vllm", "serve", "/models/qwen", "--port", "18000"]


def _proc(
    procfs, pid: int, comm: str, pgrp: int, session: int, start_s: float, **more: bytes
) -> None:
    d = procfs / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    # a real line of /proc/<pid>/stat (from `cat /proc/self/stat`), with our fields in it
    (d / "stat").write_text(
        f"{pid} ({comm}) S 1 {pgrp} {session} 0 -1 4194304 101 0 0 0 0 0 0 0 20 0 1 0 "
        f"{int(start_s * TICKS)} 3133440 384 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1\n"
    )
    for name, data in more.items():
        (d / name).write_bytes(data)


@pytest.fixture
def host(tmp_path):
    """A recorded /proc: an engine (pid 7001, its own group and session, started at 500 s
    after boot) with a worker, a notebook, and a pid whose number is an old engine's."""
    procfs = tmp_path / "proc"
    procfs.mkdir()
    (procfs / "stat").write_text(
        f"cpu  1 2 3 4\ncpu0 1 2 3 4\nintr 12345 0 0\nctxt 99\nbtime {BTIME}\nprocesses 5000\n"
    )
    cmdline = b"\0".join(a.encode() for a in ["/usr/bin/python3", *ENGINE_ARGV]) + b"\0"
    _proc(procfs, 7001, "vllm", 7001, 7001, 500.0, cmdline=cmdline)
    _proc(procfs, 7050, "VllmWorker TP0", 7001, 7001, 530.0)
    _proc(procfs, 4242, "python", 4242, 4000, 100.0)
    _proc(procfs, 8000, "(sd-pam) x", 8000, 8000, 900.0)  # parentheses in the name
    return procfs


def _engine(pid: int, started_s: float, port: int = 18000, argv=ENGINE_ARGV, marker: str = ""):
    from llmgw.agent.engines.pidfile import EngineProcess

    return EngineProcess(
        shard=f"n1.r{pid}",
        pid=pid,
        pgid=pid,
        create_time=BTIME + started_s,
        argv=list(argv),
        port=port,
        marker=marker,
    )


def test_an_engine_and_its_workers_are_own_and_everything_else_foreign(host):
    from llmgw.agent.discovery.processes import HostProcesses

    lookup = HostProcesses(host, [_engine(7001, 500.0)], clock_ticks=TICKS)

    assert lookup.own(7001) and lookup.own(7050)
    # which engine: its group, the leader's pid (a shard's pid)
    assert (lookup.engine(7001), lookup.engine(7050), lookup.engine(4242)) == (7001, 7001, None)
    assert not lookup.own(4242)
    assert not lookup.own(99999)  # not in /proc at all: not an engine this agent knows
    assert (lookup.name(4242), lookup.name(7050), lookup.name(99999)) == (
        "python",
        "VllmWorker TP0",
        "",
    )


def test_a_group_whose_leader_is_not_the_recorded_command_proves_nothing(host):
    from llmgw.agent.discovery.processes import HostProcesses

    # pid, group and start time as recorded, another command line: not the engine
    other = _engine(7001, 500.0, argv=["/usr/sbin/some-daemon", "--fork"])
    lookup = HostProcesses(host, [other], clock_ticks=TICKS)

    assert not lookup.own(7001) and not lookup.own(7050)


def test_a_process_older_than_the_engine_whose_group_number_it_has_is_not_own(host):
    from llmgw.agent.discovery.processes import HostProcesses

    # a pidfile left for group 8000 whose leader started at 1000 s: pid 8000 now is a
    # process started at 900 s, so the number was reused, not the engine
    lookup = HostProcesses(host, [_engine(8000, 1000.0)], clock_ticks=TICKS)

    assert not lookup.own(8000)


def test_without_pidfiles_nothing_is_own():
    from llmgw.agent.discovery.processes import HostProcesses

    lookup = HostProcesses(Path("/nonexistent"), [])

    assert not lookup.own(1)


def test_stat_lines_parse_with_spaces_and_parentheses_in_the_name():
    from llmgw.agent.discovery.processes import parse_comm, parse_stat

    line = "8000 (a) b (c)) S 1 8000 7999 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 90000 0 0\n"
    stat = parse_stat(line)
    assert (stat.pgrp, stat.session, stat.start_ticks) == (8000, 7999, 90000)
    assert parse_stat("garbage") is None
    assert parse_stat("1 (x) S 1 2") is None
    assert parse_comm("py\x1bthon" + "x" * 100 + "\n") == ("py?thon" + "x" * 100)[:64]


def test_the_inventory_carries_gpu_processes_named_and_told_apart(host, tmp_path):
    from llmgw.agent.config import AgentConfig, Paths
    from llmgw.agent.engines.pidfile import write_pidfile
    from llmgw.agent.inventory import Hardware, Identity, discover

    state = tmp_path / "state"
    write_pidfile(state, _engine(7001, 500.0))
    (host / "cpuinfo").write_text("processor\t: 0\n")
    (host / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 500 kB\n")
    nvml = RecordedNvml(processes={3: [(4242, 60 * GB), (7050, 20 * GB)]})
    cfg = AgentConfig(paths=Paths(procfs=str(host), sysfs=str(tmp_path), state_dir=str(state)))

    inv = discover(
        cfg,
        Identity("n1", "n1", "127.0.0.1"),
        0.0,
        hardware=Hardware(gpus=lambda lookup: discover_gpus(nvml, lookup)),
    )

    gpu = inv.gpus.devices[3]
    assert [(p.pid, p.name, p.own, p.engine) for p in gpu.processes] == [
        (4242, "python", False, None),
        (7050, "VllmWorker TP0", True, 7001),
    ]
    assert gpu.foreign_bytes() == 60 * GB


def test_a_simulated_agents_recording_can_hold_memory_and_count_ecc_errors():
    from llmgw.sim.nvml import FOREIGN_PID, from_spec

    gpus = discover_gpus(from_spec("count=4,node=gpu-a,held=3:60,ecc=2:1"))

    assert [(p.pid, p.used_bytes) for p in gpus.devices[3].processes] == [
        (FOREIGN_PID + 3, 60 * GB)
    ]
    assert gpus.devices[2].errors.ecc_uncorrected_volatile == 1
    with pytest.raises(ValueError, match="GPU:AMOUNT"):
        from_spec("held=3")


# --- Xid events ---------------------------------------------------------------------------------


def _watch(nvml, *, until_events_told: bool = True):
    """watch_xids on `nvml` in a thread, stopped once the recording has told every event."""
    import threading
    import time

    from llmgw.agent.discovery.xid import XidLog, watch_xids

    log, stop, unfit = XidLog(), threading.Event(), []
    out: list[str] = []
    t = threading.Thread(
        target=lambda: out.append(watch_xids(nvml, log, stop, lambda: unfit.append(1), 50))
    )
    t.start()
    deadline = time.monotonic() + 5
    while until_events_told and nvml.xids and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    stop.set()
    t.join(5)
    assert not t.is_alive()
    return log, unfit, out[0]


def test_an_xid_that_makes_a_gpu_unfit_is_kept_and_an_application_fault_is_not():
    from llmgw.sim.nvml import from_spec

    # 13: a graphics engine exception (the application's); 79: fallen off the bus; 74 on the
    # same GPU afterwards: the first unfit one stays
    nvml = from_spec("count=4,node=n1,xid=1:13+2:79+2:74")
    log, unfit, why = _watch(nvml)

    assert set(log.unfit()) == {"GPU-n1-2"} and log.unfit()["GPU-n1-2"][0] == 79
    assert len(unfit) == 1 and why == "Xid watch stopped"
    assert nvml.initialised == 0 and nvml.event_sets == 0  # session and event set let go


def test_gpus_that_deliver_no_events_are_skipped_and_none_at_all_ends_the_watch():
    from llmgw.sim.nvml import RecordedNvml

    some = RecordedNvml(count=2, node="n1", events_unsupported={0}, xids=[(0, 79), (1, 48)])
    log, _, _ = _watch(some)
    assert set(log.unfit()) == {"GPU-n1-1"}  # GPU 0 never registered: told nothing

    none = RecordedNvml(count=2, node="n1", events_unsupported={0, 1})
    _, _, why = _watch(none, until_events_told=False)
    assert why == "no Xid watch: no GPU here delivers Xid events"
    assert none.initialised == 0


def test_no_nvml_means_no_watch_not_an_error():
    from llmgw.sim.nvml import RecordedNvml

    _, _, why = _watch(
        RecordedNvml(count=0, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
        until_events_told=False,
    )
    assert why.startswith("no Xid watch: NVML did not initialise")


def test_an_unfit_xid_reaches_the_gpus_error_fields():
    from llmgw.agent.discovery.xid import XidLog, with_xids
    from llmgw.sim.nvml import from_spec

    gpus = discover_gpus(from_spec("count=2,node=n1"))
    log = XidLog()
    assert log.record("GPU-n1-1", 119, 1000.0) and not log.record("GPU-n1-1", 79, 1001.0)
    assert not log.record("GPU-n1-0", 31, 1000.0)  # a memory page fault: the application's

    merged = with_xids(gpus, log.unfit())
    assert [(g.errors.xid, g.errors.xid_at) for g in merged.devices] == [
        (None, None),
        (119, 1000.0),
    ]


# --- MIG: what the operator made of a card, observed, never changed -----------------------


def _h200s(**over) -> RecordedNvml:
    from llmgw.sim.nvml import H200_MEMORY_TOTAL, H200_NAME

    return RecordedNvml(count=2, name=H200_NAME, memory_total=H200_MEMORY_TOTAL, **over)


def test_mig_devices_of_mixed_slices_are_gpus_of_their_own_with_their_parent_named():
    from llmgw.labels import discovered_labels
    from llmgw.sim.nvml import H200_MIG

    mixed = ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]
    gpus = discover_gpus(_h200s(mig={0: mixed}))

    assert gpus.status == "ok"
    migs, whole = gpus.devices[:4], gpus.devices[4:]
    # the card in MIG mode is not listed (CUDA cannot run on it): its MIG devices are
    assert [g.uuid for g in gpus.devices].count(H100_UUIDS[0]) == 0
    assert [(g.mig_profile, g.mig_slices, g.memory_total_bytes) for g in migs] == [
        (p, H200_MIG[p][1], H200_MIG[p][0]) for p in mixed
    ]
    assert all(g.uuid.startswith("MIG-") for g in migs)
    assert len({g.uuid for g in migs}) == 4
    assert {(g.index, g.parent_uuid, g.pci_bus_id) for g in migs} == {
        (0, H100_UUIDS[0], H100_BUS_IDS[0])
    }
    assert migs[2].name == "NVIDIA H200 MIG 1g.18gb"
    assert [(g.uuid, g.mig_profile, g.parent_uuid) for g in whole] == [(H100_UUIDS[1], "", "")]
    inventory_labels = discovered_labels(_inventory_of(gpus))
    assert inventory_labels["gpu.mig"] == {"1g.18gb", "2g.35gb", "3g.71gb"}


def test_a_mig_gpu_without_mig_devices_lists_nothing_it_could_run():
    gpus = discover_gpus(_h200s(mig={1: []}))
    assert [g.uuid for g in gpus.devices] == [H100_UUIDS[0]]


def test_mig_devices_list_their_own_processes_and_memory():
    nvml = _h200s(
        mig={0: ["1g.18gb", "1g.18gb"]},
        mig_processes={(0, 1): [(4949, 9 * GB), (7001, 5 * GB)]},
    )

    gpus = discover_gpus(nvml, Lookup({4949: "python3", 7001: "llama-server"}, own={7001}))

    idle, busy = gpus.devices[0], gpus.devices[1]
    assert idle.processes == [] and idle.foreign_bytes() == 0
    assert [(p.pid, p.name, p.own) for p in busy.processes] == [
        (4949, "python3", False),
        (7001, "llama-server", True),
    ]
    assert busy.foreign_bytes() == 9 * GB
    assert busy.memory_used_bytes > 14 * GB  # its own memory, not the card's


def test_an_xid_on_a_card_makes_every_mig_device_of_it_unfit():
    from llmgw.agent.discovery.xid import with_xids

    gpus = discover_gpus(_h200s(mig={0: ["1g.18gb", "2g.35gb"]}))
    marked = with_xids(gpus, {H100_UUIDS[0]: (79, 5.0)})
    assert [g.errors.xid for g in marked.devices] == [79, 79, None]


def _inventory_of(gpus):
    from llmgw.sim.bare import inventory

    inv = inventory("h200-01", gpus=0)
    inv.gpus = gpus
    return inv
