"""Simulated engines: every engine of every simulated node served inside the simulator.

`SimulatedEngines` is the `EngineLauncher` (llmgw.agent.engines.launcher) simulated agents
are given: the real supervisor builds the real command line and hands it over, and
instead of a process this reads it with the fake engine's own parsers and serves the fake
engine's HTTP app (llmgw.sim.fake_engine: health while loading, OpenAI routes with
SSE streaming, metrics, llama-server's /slots) on the address and port the command line
names: the node's own loopback address and the port the controller assigned. It streams
tokens at the fleet file's rate, and takes the supervisor's signals as an engine does
(SIGTERM: finish, stop listening, exit 0; SIGKILL: gone at once).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import anyio.abc

from llmgw.sim import fake_engine
from llmgw.sim.fleet import Sim

# What a simulated engine's GPU memory is listed as (llmgw.sim.hardware): a pid of its own
# (its port above this), and for llama-server an 8B model's weights and f16 KV cache
SIM_PID_BASE = 4_000_000
SIM_GGUF_BYTES = 5_000_000_000
SIM_KV_BYTES_PER_TOKEN = 131_072


class SimulatedEngines:
    """Starts engines as tasks of `run`'s task group (`await tg.start(engines.run)` first)."""

    def __init__(self, behaviour: Sim) -> None:
        self.behaviour = behaviour
        self._tg: anyio.abc.TaskGroup | None = None
        self.running: set[SimulatedEngine] = set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED):
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    async def start(
        self, argv: Sequence[str], env: Mapping[str, str], output: int
    ) -> SimulatedEngine:
        assert self._tg is not None, "SimulatedEngines.run is not running"
        engine = SimulatedEngine(list(argv), self.behaviour, os.dup(output), env=dict(env))
        self.running.add(engine)
        self._tg.start_soon(self._serve, engine)
        return engine

    def on(self, host: str) -> list[SimulatedEngine]:
        """The engines of the node whose address is `host`, loaded or loading."""
        return [e for e in self.running if e.host == host and not e.gone]

    async def _serve(self, engine: SimulatedEngine) -> None:
        try:
            await engine.serve()
        finally:
            self.running.discard(engine)


def _port(argv: Sequence[str]) -> int:
    """The --port of an engine's command line (both engines take it), 0 without one: read
    before the engine parses it, for the pid the supervisor takes at start."""
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--port=") else None
        if arg == "--port" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.isdigit():
            return int(value)
    return 0


class SimulatedEngine:
    """One engine (an `EngineRun`): no OS process, so nothing to adopt; its pid is the one
    its GPU memory is listed under, so that its shard's record says what it holds against
    its allotment, as a real engine's does (without one, none ever did)."""

    adoptable = False

    def __init__(
        self, argv: list[str], behaviour: Sim, output: int, env: Mapping[str, str] | None = None
    ) -> None:
        self.argv = argv
        self.pid: int = SIM_PID_BASE + _port(argv)
        self.env = dict(env or {})
        self.behaviour = behaviour
        self.kind = "vllm" if Path(argv[0]).name == "vllm" else "llama-server"
        self.ns: object | None = None  # the engine's parsed command line, once parsed
        self.served: fake_engine.Engine | None = None  # what it serves, once it does (bench/)
        self._output = output
        self._stop = anyio.Event()
        self._gone = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self.code: int | None = None

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    @property
    def host(self) -> str:
        return fake_engine.listen_host(self.kind, self.ns) if self.ns is not None else ""  # type: ignore[arg-type]

    def gpu_held(self, totals: Mapping[str, int]) -> dict[str, int]:
        """What it holds on each GPU it was given (CUDA_VISIBLE_DEVICES), by UUID: vLLM its
        --gpu-memory-utilization of the card, llama-server its weights and KV cache."""
        if self.ns is None:
            return {}
        uuids = [u for u in self.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if u in totals]
        if self.kind == "vllm":
            share = self.ns.gpu_memory_utilization  # type: ignore[attr-defined]
            return {u: int(totals[u] * share) for u in uuids}
        kv = self.ns.ctx_size * SIM_KV_BYTES_PER_TOKEN  # type: ignore[attr-defined]
        return {uuids[0]: SIM_GGUF_BYTES + kv} if uuids else {}

    async def exited(self) -> int | None:
        await self._gone.wait()
        return self.code

    def signal(self, sig: int) -> bool:
        if self._gone.is_set():
            return False
        if sig == signal.SIGKILL:
            self.code = -signal.SIGKILL
            if self._scope is not None:
                self._scope.cancel()
        elif sig in (signal.SIGTERM, signal.SIGINT):
            self._stop.set()
        return True

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self._output, (line.rstrip("\n") + "\n").encode())

    async def serve(self) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                code = await self._serve()
                if self.code is None:
                    self.code = code
        finally:
            if self.code is None:
                self.code = -signal.SIGKILL  # cancelled with the simulator
            os.close(self._output)
            self._gone.set()

    async def _serve(self) -> int:
        from aiohttp import web

        kind = self.kind
        said = io.StringIO()
        try:  # the engine's own refusals of its flags, in its log as it would write them
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                parse = fake_engine.parse_vllm if kind == "vllm" else fake_engine.parse_llama
                ns = parse(self.argv[1:])
        except SystemExit as e:
            self._say(said.getvalue())
            return e.code if isinstance(e.code, int) else 1
        self.ns = ns
        b = self.behaviour
        engine = fake_engine.engine_for(
            kind,
            ns,
            tokens=b.tokens,
            token_rate=b.token_rate,
            first_token_seconds=b.first_token_seconds,
            env=self.env,
        )
        self.served = engine
        problem = (
            engine.vllm_loras.startup_problem()
            if kind == "vllm"
            else engine.llama_loras.startup_problem(getattr(ns, "model", None))
        )
        if problem:
            self._say("\n".join(problem))
            return 1
        host, port = fake_engine.listen_host(kind, ns), ns.port
        runner = web.AppRunner(
            fake_engine.build_app(engine),
            shutdown_timeout=0.3,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
        )
        await runner.setup()
        try:
            self._say(f"simulated {kind} serving {engine.served_name} ({' '.join(self.argv)})")
            if kind == "llama-server" and not await self._listen(runner, host, port):
                return 1  # llama-server listens first and answers 503 while loading
            with anyio.move_on_after(b.load_seconds):
                await self._stop.wait()
            if self._stop.is_set():
                return 0
            if kind == "vllm" and not await self._listen(runner, host, port):
                return 1  # vLLM opens its port only after loading
            engine.loading = False
            self._say(f"model loaded; listening on http://{host}:{port}")
            await self._stop.wait()
            self._say("received SIGTERM, stopping")
            return 0
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()

    async def _listen(self, runner, host: str, port: int) -> bool:
        from aiohttp import web

        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as e:
            self._say(f"couldn't bind HTTP server socket, hostname: {host}, port: {port}: {e}")
            return False
        return True
