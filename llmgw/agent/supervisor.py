"""Run one engine process for one shard and say what it is doing.

The supervisor starts the adapter's command in its own session (so the whole
process tree, vLLM's workers included, is one group to signal), keeps the output
tail and a log file, reports every phase through `on_phase`, restarts a failed
engine with capped exponential backoff, drains before stopping, and never leaves a
process behind: stop, drain and cancellation all end with the group gone.

Validation is the caller's step before this one (`engines.validate.validate_launch`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
import anyio
from anyio.abc import Process

from llmgw.agent.engines import EngineAdapter, EngineCommand, LaunchSpec, Probe, adapter_for
from llmgw.agent.engines.output import EngineLog, OutputTail
from llmgw.agent.engines.pidfile import new_record, remove_pidfile, write_pidfile

log = logging.getLogger(__name__)

SupervisorPhase = Literal["starting", "loading", "ready", "draining", "stopped", "failed"]


@dataclass(frozen=True)
class PhaseChange:
    phase: SupervisorPhase
    reason: str
    tail: list[str]
    restarts: int  # restarts so far (0 on the first start)
    pid: int | None
    at: float = field(default_factory=time.time)


OnPhase = Callable[[PhaseChange], Awaitable[None]]


@dataclass(frozen=True)
class SupervisorTiming:
    readiness_timeout: float = 1800.0  # vLLM: 3.5 min warm for 70B at TP=8, 10+ min seen
    poll_interval: float = 1.0  # readiness probes
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    stable_after: float = 60.0  # ready this long resets the backoff
    stop_grace: float = 10.0  # SIGTERM, then SIGKILL after this
    cancel_grace: float = 5.0  # same, when the supervisor itself is cancelled (agent exit)
    drain_timeout: float = 300.0
    drain_poll: float = 1.0
    probe_timeout: float = 5.0


class EngineSupervisor:
    """`await run()` in a task group; `drain()` / `stop()` from elsewhere; cancel = kill."""

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        shard: str,
        on_phase: OnPhase,
        log_path: Path,
        state_dir: Path | None = None,
        timing: SupervisorTiming | None = None,
        adapter: EngineAdapter | None = None,
    ) -> None:
        self.spec = spec
        self.shard = shard
        self.timing = timing or SupervisorTiming()
        self.adapter = adapter or adapter_for(spec.engine)
        self.command: EngineCommand = self.adapter.command(spec)
        self.state_dir = state_dir
        self._on_phase = on_phase
        self._log = EngineLog(log_path)
        self._tail = OutputTail()
        self.phase: SupervisorPhase | None = None
        self.restarts = 0
        self.restart_delays: list[float] = []  # the backoff chosen before each restart
        self.pid: int | None = None
        self._proc: Process | None = None
        self._group_alive = False
        self._ready_at: float | None = None
        self._failures_in_a_row = 0
        self._stop_requested = anyio.Event()
        self._draining = False
        self._running = False
        self._done = anyio.Event()
        self._http: aiohttp.ClientSession | None = None
        self._pumped = anyio.Event()

    # --- public --------------------------------------------------------------------

    def tail(self) -> list[str]:
        return self._tail.lines()

    async def run(self) -> None:
        """Start the engine and keep it running until stopped, drained or cancelled."""
        self._running = True
        timeout = aiohttp.ClientTimeout(total=self.timing.probe_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                self._http = http
                while not self._stop_requested.is_set():
                    failure = await self._run_once()
                    if failure is None or self._stop_requested.is_set():
                        break
                    delay = self._next_delay()
                    self.restarts += 1
                    self.restart_delays.append(delay)
                    await self._report(
                        "failed", f"{failure}; restart {self.restarts} in {delay:g} s"
                    )
                    with anyio.move_on_after(delay):
                        await self._stop_requested.wait()
            await self._report("stopped", "stopped on request")
        finally:
            # cancelled (agent exiting) or done: the process group must not outlive us
            with anyio.CancelScope(shield=True):
                await self._terminate(self.timing.cancel_grace)
                if self._proc is not None:
                    with anyio.move_on_after(5):
                        await self._proc.aclose()
                self._log.close()
                self._forget_pidfile()
            self._done.set()

    async def drain(self, timeout: float | None = None) -> None:
        """Report draining at once, let in-flight requests finish (bounded), then stop."""
        if self._done.is_set() or self._stop_requested.is_set():
            return await self.stop()
        self._draining = True
        await self._report("draining", "waiting for in-flight requests")
        if self.phase_was_ready and self.command.base_url:
            with anyio.move_on_after(
                self.timing.drain_timeout if timeout is None else timeout
            ) as scope:
                await self._wait_idle()
            if scope.cancelled_caught:
                log.warning("%s: drain timed out with requests in flight; stopping", self.shard)
        await self.stop()

    async def stop(self) -> None:
        """SIGTERM the engine's group, SIGKILL after the grace period; returns when gone."""
        self._stop_requested.set()
        if self._running:
            await self._done.wait()

    @property
    def phase_was_ready(self) -> bool:
        return self._ready_at is not None

    # --- one engine process --------------------------------------------------------

    async def _run_once(self) -> str | None:
        """Run the engine until it exits; the failure reason, or None when stopped."""
        self._ready_at = None
        self._tail.clear()
        await self._report("starting", " ".join(self.command.argv))
        try:
            self._log.open()
        except OSError as e:
            return (
                f"cannot open engine log {self._log.path}: {e.strerror}; check the agent's log dir"
            )
        self._log.write(
            f"=== llmgw {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: "
            f"{' '.join(self.command.argv)}\n".encode()
        )
        try:
            proc = await anyio.open_process(
                self.command.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.command.env},
                start_new_session=True,  # own group: one signal reaches every worker
            )
        except OSError as e:
            return f"cannot start {self.command.argv[0]}: {e.strerror or e}"
        self._proc, self.pid, self._group_alive = proc, proc.pid, True
        self._remember_pidfile()
        failure: list[str] = []
        self._pumped = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump, proc)
            tg.start_soon(self._watch_readiness, proc, failure)
            tg.start_soon(self._watch_stop, proc)
            code = await proc.wait()
            # the leader is gone; workers it left (holding GPU memory) go too
            await self._terminate(self.timing.stop_grace)
            with anyio.move_on_after(1.0):
                await self._pumped.wait()
            tg.cancel_scope.cancel()
        await proc.aclose()
        self._forget_pidfile()
        self._log.write(f"=== llmgw: engine exited: {describe_exit(code)}\n".encode())
        if self._stop_requested.is_set():
            return None
        if failure:
            return failure[0]
        when = "while loading" if self._ready_at is None else "while serving"
        return f"{describe_exit(code)} {when}"

    async def _pump(self, proc: Process) -> None:
        assert proc.stdout is not None
        try:
            async for chunk in proc.stdout:
                self._tail.feed(chunk)
                self._log.write(chunk)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            self._pumped.set()

    async def _watch_readiness(self, proc: Process, failure: list[str]) -> None:
        await self._report("loading", "process started, waiting for readiness")
        deadline = anyio.current_time() + self.timing.readiness_timeout
        probe = Probe(False, "not probed yet")
        while anyio.current_time() < deadline:
            await anyio.sleep(self.timing.poll_interval)
            probe = await self._probe()
            if probe.ready:
                self._ready_at = time.monotonic()
                await self._report("ready", probe.detail)
                return
        failure.append(
            f"not ready after {self.timing.readiness_timeout:g} s (last: {probe.detail}); "
            "raise the readiness timeout if this model loads slower"
        )
        await self._terminate(self.timing.stop_grace)

    async def _watch_stop(self, proc: Process) -> None:
        await self._stop_requested.wait()
        await self._terminate(self.timing.stop_grace)

    async def _probe(self) -> Probe:
        answers: dict[str, tuple[int, bytes]] = {}
        for path in self.adapter.probe_paths(self.spec):
            got = await self._get(path)
            if got is None:
                break
            answers[path] = got
        return self.adapter.readiness(self.spec, answers)

    async def _get(self, path: str) -> tuple[int, bytes] | None:
        assert self._http is not None and self.command.base_url is not None
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        try:
            async with self._http.get(self.command.base_url + path, headers=headers) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def _in_flight(self) -> int | None:
        for path in self.adapter.in_flight_paths(self.spec):
            got = await self._get(path)
            if got is None:
                continue
            count = self.adapter.in_flight(path, *got)
            if count is not None:
                return count
        return None

    async def _wait_idle(self) -> None:
        """Zero in flight on two polls in a row: a router that has not yet seen
        `draining` may still send one more request right after the first zero."""
        zeros = 0
        while self._group_alive and zeros < 2:
            count = await self._in_flight()
            zeros = zeros + 1 if count == 0 else 0
            if zeros < 2:
                await anyio.sleep(self.timing.drain_poll)

    # --- signals -------------------------------------------------------------------

    def _signal_group(self, sig: int) -> bool:
        """Signal the engine's group; False once the group is gone (then never again:
        its id could be reused by an unrelated process group)."""
        if not self._group_alive or self.pid is None:
            return False
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            self._group_alive = False
            return False

    async def _group_gone(self, within: float) -> bool:
        with anyio.move_on_after(within):
            if self._proc is not None and self._proc.returncode is None:
                await self._proc.wait()
            while self._signal_group(0):
                await anyio.sleep(0.02)
            return True
        return False

    async def _terminate(self, grace: float) -> None:
        """SIGTERM to the group, SIGKILL to what is left after `grace` seconds."""
        if not self._signal_group(signal.SIGTERM):
            return
        if await self._group_gone(grace):
            return
        log.warning("%s: engine ignored SIGTERM for %g s; sending SIGKILL", self.shard, grace)
        self._log.write(f"=== llmgw: no exit {grace:g} s after SIGTERM; SIGKILL\n".encode())
        self._signal_group(signal.SIGKILL)
        await self._group_gone(10.0)

    # --- reports and bookkeeping -----------------------------------------------------

    def _next_delay(self) -> float:
        t = self.timing
        if self._ready_at is not None and time.monotonic() - self._ready_at >= t.stable_after:
            self._failures_in_a_row = 0  # it served long enough: this is a new problem
        delay = min(t.backoff_base * 2**self._failures_in_a_row, t.backoff_cap)
        self._failures_in_a_row += 1
        return delay

    async def _report(self, phase: SupervisorPhase, reason: str) -> None:
        if self._draining and phase in ("starting", "loading", "ready"):
            return  # a drain in progress is what the router must keep seeing
        self.phase = phase
        change = PhaseChange(
            phase=phase,
            reason=reason,
            tail=self._tail.lines() if phase in ("failed", "stopped") else [],
            restarts=self.restarts,
            pid=self.pid if phase not in ("stopped",) else None,
        )
        try:
            await self._on_phase(change)
        except Exception:  # a reporting failure must not take the engine down
            log.exception("%s: reporting phase %s failed", self.shard, phase)

    def _remember_pidfile(self) -> None:
        if self.state_dir is None or self.pid is None:
            return
        record = new_record(
            self.shard,
            self.pid,
            self.command.argv,
            self.spec.port,
            list(self.spec.gpu_uuids),
            str(self._log.path),
        )
        write_pidfile(self.state_dir, record)

    def _forget_pidfile(self) -> None:
        if self.state_dir is not None and not self._group_alive:
            remove_pidfile(self.state_dir, self.shard)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's OOM killer sends SIGKILL: check dmesg)" if code == -9 else ""
        return f"killed by {name}{hint}"
    return f"exited with code {code}"
