"""The output tail a failure report carries, and the shard log's rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.engines.output import EngineLog, OutputTail
from llmgw.agent.supervisor import describe_exit


def test_tail_keeps_the_last_lines_within_both_bounds():
    tail = OutputTail(max_lines=3, max_bytes=1000)
    tail.feed(b"one\ntwo\nthr")
    tail.feed(b"ee\nfour\nfi")
    assert tail.lines() == ["three", "four", "fi"]
    small = OutputTail(max_lines=64, max_bytes=12)
    small.feed(b"aaaa\nbbbb\ncccc\n")
    assert small.lines() == ["bbbb", "cccc"]


def test_progress_bars_leave_their_last_state_not_every_redraw():
    tail = OutputTail()
    tail.feed(b"downloading  10%\rdownloading  50%\rdownloading 100%\r\nloaded\n")
    assert tail.lines() == ["downloading 100%", "loaded"]


def test_broken_utf8_is_replaced_not_fatal():
    tail = OutputTail()
    tail.feed(b"caf\xc3")
    tail.feed(b"\xa9 \xff\n")
    assert tail.lines() == ["café \ufffd"]


def test_shard_log_rotates_once_past_its_size_while_the_engine_keeps_appending(tmp_path: Path):
    log = EngineLog(tmp_path / "r1.log", max_bytes=10)
    fd = log.open_for_engine()  # what the engine writes to, as its stdout
    os.write(fd, b"0123456789AB")
    assert log.rotate_if_large()
    os.write(fd, b"new\n")  # O_APPEND: at the new end, no hole of 12 zero bytes
    os.close(fd)
    assert (tmp_path / "r1.log.1").read_bytes() == b"0123456789AB"
    assert (tmp_path / "r1.log").read_bytes() == b"new\n"


def test_the_tail_is_read_from_the_file_from_where_this_run_began(tmp_path: Path):
    log = EngineLog(tmp_path / "r1.log")
    log.write(b"an earlier run\n")
    since = log.size()
    log.write(b"=== llmgw starting\nloading\nCUDA error: out of memory\n")
    # the agent's own lines are left out: the tail is what the engine said
    assert log.tail(since) == ["loading", "CUDA error: out of memory"]
    assert log.tail(10**9) == [  # truncated since: read from the start
        "an earlier run",
        "loading",
        "CUDA error: out of memory",
    ]


def test_exit_descriptions_name_the_signal_and_the_oom_suspect():
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(-9).startswith("killed by SIGKILL (the kernel's OOM killer")


def test_a_fifo_or_a_link_planted_as_a_shard_log_is_refused_not_waited_on(tmp_path: Path):
    """The log is a state file the agent writes and reads back: a FIFO there would block
    the open (no reader, no writer), a link would be written through (as root)."""
    import pytest

    from llmgw.agent.files import NotRegularFile

    os.mkfifo(tmp_path / "fifo.log")
    target = tmp_path / "not-a-log"
    target.write_bytes(b"keep\n")
    os.symlink(target, tmp_path / "link.log")
    for name, kind in (("fifo.log", "a FIFO"), ("link.log", "a symbolic link")):
        log = EngineLog(tmp_path / name)
        with pytest.raises(NotRegularFile) as refused:
            log.write(b"=== llmgw starting\n")
        assert refused.value.kind == kind
        with pytest.raises(NotRegularFile):
            os.close(log.open_for_engine())
        assert log.tail() == []
    assert target.read_bytes() == b"keep\n"
    # a link where the rotated copy goes is replaced, not written through
    os.symlink(target, tmp_path / "r1.log.1")
    log = EngineLog(tmp_path / "r1.log", max_bytes=4)
    log.write(b"0123456789\n")
    assert target.read_bytes() == b"keep\n"
    assert (tmp_path / "r1.log.1").read_bytes() == b"0123456789\n"


# what a real vLLM 0.32 printed as it died (docs/vllm-cpu.md), its cause first
VLLM_DEATH = [
    "(APIServer pid=1235) INFO 12-06 03:34:44 [launcher.py:195] Route: /redoc, Methods: HEAD, GET",
    "(APIServer pid=1235) WARNING 12-06 03:34:25 [system_utils.py:255] Found ulimit of 20000 "
    "and failed to automatically increase with error current limit exceeds maximum limit. "
    "This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.",
    "(Worker pid=1787) ERROR 12-06 03:34:45 [multiproc_executor.py:1063]     return self._op(*args, **kwargs)",
    "(Worker pid=1787) ERROR 12-06 03:34:45 [multiproc_executor.py:1063] RuntimeError: "
    "Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0",
    "(EngineCore pid=1576) ERROR 12-06 03:34:45 [core.py:1512] RuntimeError: Worker failed "
    "with error 'Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0'",
    "(APIServer pid=1235) ERROR 12-06 03:34:45 [async_llm.py:906] vllm.v1.engine.exceptions."
    "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "INFO:     Shutting down",
]


@pytest.mark.parametrize(
    "lines, cause",
    [
        (
            VLLM_DEATH,
            "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0",
        ),
        (
            VLLM_DEATH[-2:],
            "EngineDeadError: EngineCore encountered an issue. See stack trace "
            "(above) for the root cause.",
        ),
        (
            ["    sock.bind(addr)", "OSError: [Errno 98] Address already in use"],
            "OSError: [Errno 98] Address already in use",
        ),
        (["main: exiting due to model loading error"], ""),  # llama-server says no exception
    ],
)
def test_the_first_exception_an_engine_printed_is_its_cause(lines, cause):
    from llmgw.agent.engines.output import first_error

    assert first_error(lines) == cause
