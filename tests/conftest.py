"""Shared fixtures: a real nats-server process per test (free port, temporary store)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.bus.server import EmbeddedNats, free_port


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py is asyncio


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(data_dir=tmp_path / "nats", port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_settings(nats_server: EmbeddedNats) -> NatsSettings:
    # a server a test stops and starts again is rejoined within 2 s: with the shipped cap
    # (30 s) a few failed tries let one jittered delay run past a test's wait (a router of
    # test_router_gateway_ops rejoined more than 15 s after the restart, in a full run)
    return NatsSettings(urls=(nats_server.url,), name="test", healthy_after=1.0, backoff_cap=2.0)


@pytest.fixture
async def bus(nats_settings: NatsSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_settings, BucketSettings(), give_up_after=5)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def second_bus(nats_settings: NatsSettings) -> AsyncIterator[Bus]:
    """A second connection to the same server: a controller's, beside the test's `bus`."""
    b = await Bus.connect(nats_settings, give_up_after=5)
    yield b
    await b.close()


@pytest.fixture
async def third_bus(nats_settings: NatsSettings) -> AsyncIterator[Bus]:
    """A third connection: a second controller's."""
    b = await Bus.connect(nats_settings, give_up_after=5)
    yield b
    await b.close()


@pytest.fixture
def engine_ports() -> Iterator[tuple[int, int]]:
    """(low, high): the ports this test's engines are given, found free and reserved
    against other test runs on this machine (port_helpers), never llmgw's default range."""
    from port_helpers import free_port_run

    with free_port_run() as ports:
        yield ports


@pytest.fixture
async def controller(
    nats_settings: NatsSettings, engine_ports: tuple[int, int]
) -> AsyncIterator[None]:
    """A leading controller in this process, quick to react, slow to declare nodes lost
    (end-to-end tests are about engines, not liveness), placing engines on `engine_ports`."""
    from controller_helpers import quick_controller

    from llmgw.controller.loop import Controller

    settings = quick_controller(engine_ports)
    b = await Bus.connect(nats_settings, give_up_after=5)
    async with anyio.create_task_group() as tg:
        await tg.start(Controller(b, settings).run)
        yield
        tg.cancel_scope.cancel()
    await b.close()


@pytest.fixture
def engines(tmp_path: Path):
    """Fake engines a router test starts and stops (router_helpers.FakeEngines), all
    stopped at its end."""
    from router_helpers import fake_engines

    with fake_engines(tmp_path) as fleet:
        yield fleet


@pytest.fixture
def bins(tmp_path: Path) -> dict[str, Path]:
    """The fake llama-server and vllm, installed as the real ones are (llmgw.sim.fake_engine)."""
    from llmgw.sim.fake_engine import install_fake_engines

    return install_fake_engines(tmp_path / "bin")


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw")


@pytest.fixture(scope="session")
def vllm_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight model a real vLLM serves (tests/real_vllm.py), made once;
    skips, saying how to get a vLLM, where there is none."""
    from real_vllm import tiny_hf_model

    return tiny_hf_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def vllm_server(vllm_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM serving the tiny model with an API key, shared by every test that only
    talks to it: a start costs 20-50 s on 2 cores. Stopped, every process of it, at the end."""
    from real_vllm import serving_vllm

    with serving_vllm(
        vllm_tiny_model, tmp_path_factory.mktemp("vllm-server"), api_key="engine-key"
    ) as server:
        yield server


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # What the tests left for the cycle collector goes now: collected later, inside the
    # ast.parse of a module imported by a plugin's summary (hypothesis's, when no test
    # imported it), a finalizer trips CPython 3.11's "AST constructor recursion depth
    # mismatch" SystemError, and the run fails after its tests passed.
    import gc

    gc.collect()
