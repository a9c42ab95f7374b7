"""Starting `llmgw up` and `llmgw router` on a machine as it is: ports another program holds,
the open-file limit it has, no engine installed. Each is a real process, as a user runs it."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from waiting import until_logged

from llmgw.agent.config import AgentConfig, Metrics, Paths, write_config
from llmgw.bus.server import free_port

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def llmgw(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    return subprocess.run(
        [*LLMGW, *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs
    )


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _nats_servers_of(tmp: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "nats-server" in cmd and str(tmp) in cmd:
            found.append(p)
    return found


@pytest.mark.parametrize("which", ["nats", "router", "agent metrics"])
def test_up_on_a_taken_port_says_which_flag_moves_it_in_one_line_and_starts_nothing(
    tmp_path, which
):
    cfg_path = tmp_path / "agent.toml"
    with held_port() as taken:
        nats_port = taken if which == "nats" else free_port()
        router = taken if which == "router" else free_port()
        metrics = taken if which == "agent metrics" else free_port()
        cfg = AgentConfig(
            metrics=Metrics(listen=f"127.0.0.1:{metrics}"),
            paths=Paths(state_dir=str(tmp_path / "state"), llama_search_dirs=[]),
        )
        write_config(cfg, cfg_path)
        out = llmgw(
            "up",
            "--port",
            str(nats_port),
            "--router-listen",
            f"127.0.0.1:{router}",
            "--data-dir",
            str(tmp_path / "data"),
            "--agent-config",
            str(cfg_path),
        )
    assert out.returncode == 2, out.stderr
    move = {
        "nats": f"NATS 127.0.0.1:{taken} is in use by another program: move it with --port PORT",
        "router": f"the router (OpenAI API) 127.0.0.1:{taken} is in use by another program: "
        "move it with --router-listen HOST:PORT",
        "agent metrics": f"the agent's /metrics 127.0.0.1:{taken} is in use by another "
        f'program: set metrics.listen in {cfg_path} ("" serves none)',
    }[which]
    assert out.stderr.splitlines() == [f"Error: {move}"]
    assert out.stdout == ""
    assert not _nats_servers_of(tmp_path)
    assert not (tmp_path / "data").exists()  # not a byte written


def test_up_refuses_two_of_its_own_listeners_on_one_port(tmp_path):
    port = free_port()
    out = llmgw(
        "up",
        "--port",
        str(port),
        "--router-listen",
        f"0.0.0.0:{port}",
        "--data-dir",
        str(tmp_path / "data"),
        "--no-agent",
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"Error: the router (OpenAI API) and NATS both ask for port {port}: move it with "
        "--router-listen HOST:PORT"
    ]
    assert not _nats_servers_of(tmp_path)


def test_router_on_a_taken_port_says_so_in_one_line(tmp_path):
    with held_port() as taken:
        out = llmgw("router", "--listen", f"127.0.0.1:{taken}")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"Error: the router (OpenAI API) 127.0.0.1:{taken} is in use by another program: "
        "move it with --listen HOST:PORT"
    ]


# --- the open-file limit -----------------------------------------------------------------------


def _limit_files(soft: int, hard: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return preexec


def _router_start_log(tmp_path: Path, *extra: str, soft: int, hard: int) -> str:
    """What `llmgw router` logs as it starts under `ulimit -Sn soft -Hn hard`."""
    cat = tmp_path / "static.toml"
    cat.write_text('[[models]]\nid = "m"\nserved_name = "m"\nendpoints = ["http://127.0.0.1:9"]\n')
    log_path = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*LLMGW, "--log-level", "INFO", "router", "--catalog", str(cat)]
            + ["--listen", f"127.0.0.1:{free_port()}", *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_limit_files(soft, hard),
        )
    try:
        until_logged(proc, log_path, "router listening")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    return log_path.read_text()


def _hard_limit_allows(n: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"this process may open only {hard} files")


def test_the_default_connection_cap_fits_the_open_file_limit_without_a_warning(tmp_path):
    """Every start warned that the limit held fewer connections than the default asked."""
    _hard_limit_allows(4096)
    text = _router_start_log(tmp_path, soft=512, hard=4096)
    # raised to the hard limit, and the default sized to it: (4096 - 256) // 2
    assert "open-file limit 4096 (raised from 512): holds 1920 client connections" in text
    assert "WARNING" not in text, text


def test_an_explicit_connection_cap_the_limit_cannot_hold_is_warned_about(tmp_path):
    _hard_limit_allows(4096)
    text = _router_start_log(tmp_path, "--max-connections", "5000", soft=512, hard=4096)
    assert "holds 1920 client connections" in text
    assert "holds 1920 client connections, not the 5000 asked for with --max-connections" in text
    assert "ulimit -Hn" in text


def test_the_router_options_default_to_the_router_settings():
    """`--help` and the settings classes said different things; now the options read their
    defaults from the settings classes: parsed with nothing given, they are those settings
    (the connection cap sized to this machine's open-file limit, as the router sizes it)."""
    from llmgw.cli.router import fit_fd_limit, router, router_settings
    from llmgw.router.service import RouterSettings

    with router.make_context("router", []) as ctx:
        takes = inspect.signature(router_settings).parameters
        given = {k: v for k, v in ctx.params.items() if k in takes and k != "listen"}
        built = router_settings(ctx.params["listen"], **given)
        defaults = RouterSettings()
        fits = fit_fd_limit(defaults.limits.max_connections, explicit=False)
    assert built == dataclasses.replace(
        defaults, limits=dataclasses.replace(defaults.limits, max_connections=fits)
    )


# --- a machine with no engine ------------------------------------------------------------------


def _up_until_running(tmp_path: Path, path_env: str) -> str:
    """What `llmgw up` prints up to its router listening, with PATH as given."""
    cfg_path = tmp_path / "agent.toml"
    write_config(
        AgentConfig(paths=Paths(state_dir=str(tmp_path / "state"), llama_search_dirs=[])),
        cfg_path,
    )
    log_path = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*LLMGW, "up", "--port", str(free_port()), "--data-dir", str(tmp_path / "data")]
            + ["--agent-config", str(cfg_path), "--router-listen", f"127.0.0.1:{free_port()}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "PATH": path_env},
        )
    try:
        until_logged(proc, log_path, "router listening", timeout=30)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    return log_path.read_text()


@pytest.mark.parametrize("engine", [False, True])
def test_up_on_a_machine_with_no_engine_says_what_to_do_next(tmp_path, engine):
    from llmgw.sim.fake_engine import install_fake_engines

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if engine:
        install_fake_engines(bin_dir)
    text = _up_until_running(tmp_path, f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    said = "this machine has no engine (no llama-server or vllm on PATH or in the agent config)"
    if engine:
        assert said not in text
        return
    assert said in text
    assert "up --sim examples/fleet.toml" in text
    assert "tools/build-llama-server.sh" in text and "docs/llama-server-build.md" in text


# --- one server per store ------------------------------------------------------------------------


@contextlib.contextmanager
def _up_running(tmp_path: Path, data: Path, port: int) -> Iterator[subprocess.Popen]:
    """`llmgw up` (NATS and a controller) on `data`, until it says its controller runs."""
    log_path = tmp_path / f"up-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*LLMGW, "up", "--port", str(port), "--data-dir", str(data)]
            + ["--no-agent", "--no-router"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        until_logged(proc, log_path, "controller running", timeout=30)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(15)


def test_a_second_up_on_the_first_ones_store_is_refused_naming_it_and_leaves_the_store_alone(
    tmp_path,
):
    """A second `llmgw up` on other ports shared the first one's JetStream store and rewrote
    its nats-server.conf; the next start found the store corrupt."""
    data = tmp_path / "data"
    first_port = free_port()
    with _up_running(tmp_path, data, first_port) as first:
        conf = (data / "nats" / "nats-server.conf").read_bytes()
        second = llmgw(
            "up", "--port", str(free_port()), "--data-dir", str(data), "--no-agent", "--no-router"
        )
        assert second.returncode == 1, second.stderr
        assert second.stderr.splitlines() == [
            f"Error: store {data / 'nats'} is in use by llmgw up (pid {first.pid}), and two "
            f"servers on one store corrupt it: stop it (Ctrl-C where it runs, or `kill "
            f"{first.pid}`), or give this one a store of its own (--data-dir DIR)"
        ]
        assert (data / "nats" / "nats-server.conf").read_bytes() == conf
        assert len(_nats_servers_of(tmp_path)) == 1
        # the first still serves
        status = llmgw("status", "--nats", f"nats://127.0.0.1:{first_port}")
        assert status.returncode == 0, status.stderr
        # another store, the first one's port: the port's holder is named
        other = str(tmp_path / "other")
        taken = llmgw(
            "up", "--port", str(first_port), "--data-dir", other, "--no-agent", "--no-router"
        )
        assert taken.returncode == 2, taken.stderr
        (server,) = _nats_servers_of(tmp_path)
        assert taken.stderr.splitlines() == [
            f"Error: NATS 127.0.0.1:{first_port} is in use by the NATS of llmgw up (pid "
            f"{first.pid}; nats-server pid {server.pid}): move it with --port PORT"
        ]


def test_a_nats_server_left_running_by_a_killed_up_still_holds_its_store(tmp_path):
    data = tmp_path / "data"
    with _up_running(tmp_path, data, free_port()) as first:
        (server,) = _nats_servers_of(tmp_path)
        first.kill()  # its nats-server runs on, in a session of its own
        first.wait()
        try:
            again = llmgw(
                "up",
                "--port",
                str(free_port()),
                "--data-dir",
                str(data),
                "--no-agent",
                "--no-router",
            )
        finally:
            server.kill()
    assert again.returncode == 1
    assert again.stderr.splitlines() == [
        f"Error: store {data / 'nats'} is in use by a nats-server (pid {server.pid}) left "
        f"running by pid {first.pid}, which is gone, and two servers on one store corrupt it: "
        f"stop it (`kill {server.pid}`), or give this one a store of its own (--data-dir DIR)"
    ]
