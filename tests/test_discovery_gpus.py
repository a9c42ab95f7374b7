import pynvml
import pytest
from samples.nvml import DRIVER_VERSION, H100_BUS_IDS, H100_UUIDS, RecordedNvml

from llmgw.agent.discovery.gpus import discover_gpus


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
