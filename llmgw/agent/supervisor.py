"""Run one engine process for one shard and say what it is doing.

The supervisor starts the adapter's command in its own session (so the whole process
tree, vLLM's workers included, is one group to signal) with its output going straight
into the shard's log file, reports every phase through `on_phase`, restarts an engine that
exits with capped exponential backoff, gives up on one that keeps failing to start
(FATAL: the controller then moves the replica), and drains before stopping.

What it does follows from one named state (`EngineState`, supervisord's names), changed
only through `_change_state`, which checks the move against one table (`MOVES`: a move not
in it is a bug, `StateError`), sets the state and reports the phase it implies; no flag
steers beside it. The restart decisions come from one small pure policy (`RestartPolicy`)
tested with time passed in. Every wait that decides something (the backoff, the readiness
deadline, the drain) is taken on the supervisor's clock (`llmgw.clock.Timer`, injected), so
a test walks through minutes of them at once. An engine outlives its supervisor only when
told to (`leave_running()`: the agent is being restarted, and its successor adopts the
engine instead of loading the model again); otherwise stop, drain and cancellation all end
with the group gone. Every process of an engine carries its marker (`pidfile.ENGINE_MARKER`)
in its environment: what lets a later agent prove a worker is the engine's.

Validation is the caller's step before this one (`engines.validate.validate_launch`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

import aiohttp
import anyio
import msgspec

from llmgw.agent.engines import EngineAdapter, EngineCommand, LaunchSpec, Probe, adapter_for
from llmgw.agent.engines.base import EngineGauges
from llmgw.agent.engines.launcher import EngineLauncher, EngineRun, ProcessGroup, ProcessLauncher
from llmgw.agent.engines.output import EngineLog
from llmgw.agent.engines.pidfile import (
    ENGINE_MARKER,
    EngineProcess,
    leader_alive,
    new_marker,
    new_record,
    remove_pidfile,
    write_pidfile,
)
from llmgw.agent.engines.validate import bind_error
from llmgw.bus.records import PORT_IN_USE
from llmgw.clock import SystemClock, Timer

log = logging.getLogger(__name__)

# an engine's answer to a probe or a metrics read: vLLM's /metrics with its histograms is a
# few hundred KB; more is not an answer worth reading whole
MAX_ENGINE_ANSWER = 4 * 1024 * 1024

# what the shard record says (its phase); the supervisor's own state is EngineState
SupervisorPhase = Literal["starting", "loading", "ready", "draining", "stopped", "failed"]


class EngineState(Enum):
    """What the supervisor is doing with its engine; every decision reads this."""

    IDLE = "idle"  # run() has not begun
    STARTING = "starting"  # launched (or adopted), not ready yet
    RUNNING = "running"  # ready: it serves
    BACKOFF = "backoff"  # it exited; starts again after a delay
    DRAINING = "draining"  # asked to drain: in-flight requests finish, then it stops
    STOPPING = "stopping"  # asked to stop: SIGTERM, SIGKILL after the grace
    EXITED = "exited"  # stopped (asked, or the supervisor cancelled): done
    FATAL = "fatal"  # failed to start too often in a row: done, the controller moves it
    LEFT = "left"  # left running for the next agent to adopt: done, the engine is not


_S = EngineState
_DONE = frozenset({_S.EXITED, _S.FATAL, _S.LEFT})
# a drain or a stop was asked for: nothing starts again, and the router keeps seeing it
_ASKED = frozenset({_S.DRAINING, _S.STOPPING})

# Every move the supervisor makes (supervisord's process.py keeps the same table). Before
# run(), only a drain or a stop (it then runs just to stop what it was given to adopt).
# EXITED is also where a cancelled supervisor ends; LEFT, where one told to leave its
# engine running ends while that engine lives (an agent restarted in the middle of a drain
# or a stop leaves it too: the next agent adopts it to drain or stop it).
MOVES: dict[EngineState, frozenset[EngineState]] = {
    _S.IDLE: frozenset({_S.STARTING, _S.DRAINING, _S.STOPPING, _S.EXITED}),
    _S.STARTING: frozenset(
        {_S.RUNNING, _S.BACKOFF, _S.FATAL, _S.DRAINING, _S.STOPPING, _S.EXITED, _S.LEFT}
    ),
    _S.RUNNING: frozenset({_S.BACKOFF, _S.FATAL, _S.DRAINING, _S.STOPPING, _S.EXITED, _S.LEFT}),
    _S.BACKOFF: frozenset({_S.STARTING, _S.DRAINING, _S.STOPPING, _S.EXITED}),
    _S.DRAINING: frozenset({_S.STOPPING, _S.EXITED, _S.LEFT}),
    _S.STOPPING: frozenset({_S.EXITED, _S.LEFT}),
    _S.EXITED: frozenset(),
    _S.FATAL: frozenset(),
    _S.LEFT: frozenset(),
}


class StateError(RuntimeError):
    """A move the supervisor never makes: a bug in the supervisor, not in its engine."""


def check_move(old: EngineState, new: EngineState) -> EngineState:
    """`new`, when the supervisor may move from `old` to it; StateError otherwise."""
    if new not in MOVES[old]:
        raise StateError(
            f"engine state {old.value} -> {new.value} is not a move the supervisor makes"
        )
    return new


# the phase the shard record says on entering a state (None: the record keeps its phase;
# STARTING's "loading" and an adopted engine's "ready" are reported within the state)
PHASE_OF: dict[EngineState, SupervisorPhase | None] = {
    _S.IDLE: None,
    _S.STARTING: "starting",
    _S.RUNNING: "ready",
    _S.BACKOFF: "failed",
    _S.DRAINING: "draining",
    _S.STOPPING: None,
    _S.EXITED: "stopped",
    _S.FATAL: "failed",
    _S.LEFT: None,
}

# what cancelling the supervisor does to its engine: stop it, or leave it serving for the
# next agent to adopt (`leave_running`); data the last move reads, not a state of its own
OnCancel = Literal["stop", "leave"]


@dataclass(frozen=True)
class PhaseChange:
    phase: SupervisorPhase
    reason: str
    tail: list[str]
    restarts: int  # restarts so far (0 on the first start)
    pid: int | None
    at: float = 0.0  # unix seconds, by the supervisor's clock
    gave_up: bool = False  # FATAL: no restart will follow
    refused: str = ""  # a constant key the controller acts on (records.PORT_IN_USE)


@dataclass(frozen=True)
class EngineExit:
    """Why a run of the engine ended without being asked to: what a person reads, and the
    constant key the controller acts on where one applies (`PhaseChange.refused`)."""

    reason: str
    refused: str = ""


OnPhase = Callable[[PhaseChange], Awaitable[None]]


@dataclass(frozen=True)
class SupervisorTiming:
    readiness_timeout: float = 1800.0  # vLLM: 3.5 min warm for 70B at TP=8, 10+ min seen
    poll_interval: float = 1.0  # readiness probes
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    stable_after: float = 60.0  # ready this long resets the backoff and the failed starts
    # failed starts in a row (exits before serving `stable_after`) before it gives up
    max_failed_starts: int = 5
    stop_grace: float = 10.0  # SIGTERM, then SIGKILL after this
    cancel_grace: float = 5.0  # same, when the supervisor itself is cancelled (agent exit)
    drain_timeout: float = 300.0
    drain_poll: float = 1.0
    probe_timeout: float = 5.0
    # an adopted engine that had answered ready must answer ready again within this, or it
    # is a hung engine, not a loading one (it is stopped and started again)
    adopted_ready_grace: float = 30.0
    log_check: float = 30.0  # how often the log file's size is checked for rotation


@dataclass
class RestartPolicy:
    """After an exit: how long until the next start, or give up. Pure; time passed in.

    A failed start is an exit before the engine served `stable_after` seconds. The delay
    doubles with every one in a row, up to the cap; `max_failed_starts` in a row give up
    (a broken GPU, a profile that cannot load there: restarting for ever hides it, the
    controller can place the replica elsewhere). An engine that served long enough before
    it exited starts over: that is a new problem, not the same one again."""

    base: float
    cap: float
    stable_after: float
    max_failed_starts: int
    failed_in_a_row: int = 0

    def after_exit(self, served_for: float | None) -> float | None:
        """`served_for`: seconds it was ready before it exited (None: never ready). The
        delay before the next start, or None: give up."""
        if served_for is not None and served_for >= self.stable_after:
            self.failed_in_a_row = 0
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= self.max_failed_starts:
            return None
        return min(self.base * 2 ** (self.failed_in_a_row - 1), self.cap)


class EngineSupervisor:
    """`await run()` in a task group; `drain()` / `stop()` from elsewhere; cancel = kill,
    unless `leave_running()` was called first."""

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
        clock: Timer | None = None,
        adopt: EngineProcess | None = None,
        generation: int = 0,
        launch_prefix: Sequence[str] | Callable[[], Sequence[str]] = (),
        launcher: EngineLauncher | None = None,
    ) -> None:
        self.spec = spec
        self.shard = shard
        self.timing = timing or SupervisorTiming()
        self.adapter = adapter or adapter_for(spec.engine)
        self.command: EngineCommand = self.adapter.command(spec)
        self.state_dir = state_dir
        self.generation = generation
        # e.g. `systemd-run --scope ...`: the engine in a cgroup of its own (docs/engines.md)
        # (a function: asked again at every start, as a scope's name must be new each time)
        self._prefix = launch_prefix
        self._launcher = launcher or ProcessLauncher()
        self._on_phase = on_phase
        self._log = EngineLog(log_path)
        self._log_from = 0  # where this run's output begins in the log
        self._clock = clock or SystemClock()
        self._policy = RestartPolicy(
            self.timing.backoff_base,
            self.timing.backoff_cap,
            self.timing.stable_after,
            self.timing.max_failed_starts,
        )
        self._adopt = adopt  # the engine an earlier agent left, until run() adopts it
        self._adopted_from = adopt  # what was given to adopt (`adopted`), kept
        self._pidfile: EngineProcess | None = None  # what the next agent will read
        self.state = EngineState.IDLE
        self.phase: SupervisorPhase | None = None
        self.restarts = 0
        self.restart_delays: list[float] = []  # the backoff chosen before each restart
        self.pid: int | None = None
        self._run: EngineRun | None = None  # the engine started or adopted last
        self._ready_at: float | None = None
        self._on_cancel: OnCancel = "stop"
        self._changed = anyio.Event()  # set (and replaced) at every move, and when _run is set
        self._http: aiohttp.ClientSession | None = None

    # --- public --------------------------------------------------------------------

    def tail(self) -> list[str]:
        return self._log.tail(self._log_from)

    @property
    def adopted(self) -> bool:
        """Whether its engine was started by an earlier agent."""
        return self._adopted_from is not None

    def keep_for(self, generation: int) -> None:
        """The engine stays for a new generation of its assignment (only the catalog changed):
        its pidfile says so, or the next agent would take it for a stale engine."""
        self.generation = generation
        self._rewrite_pidfile(generation=generation)

    def leave_running(self) -> None:
        """The agent is being restarted: when this supervisor is cancelled, its engine
        keeps serving, its pidfile stays, and the next agent adopts it."""
        self._on_cancel = "leave"

    async def run(self) -> None:
        """Start (or adopt) the engine and keep it running until it is stopped, drained,
        given up on, or the supervisor is cancelled."""
        if self.state is not EngineState.IDLE and self.state not in _ASKED:
            raise StateError(f"{self.shard}: run() again in state {self.state.value}")
        timeout = aiohttp.ClientTimeout(total=self.timing.probe_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                self._http = http
                while True:
                    if self._adopt is not None:
                        # even when a stop came first: an adopted engine is ours to stop
                        record, self._adopt = self._adopt, None
                        failure = await self._watch_adopted(record)
                    elif self.state in _ASKED:
                        break
                    else:
                        failure = await self._run_once()
                    if failure is None or self.state in _ASKED:
                        break
                    served = (
                        None if self._ready_at is None else self._clock.monotonic() - self._ready_at
                    )
                    delay = self._policy.after_exit(served)
                    if delay is None:
                        n = self._policy.failed_in_a_row
                        await self._change_state(
                            EngineState.FATAL,
                            f"{failure.reason}; gave up after {n} failed starts in a row",
                            refused=failure.refused,
                        )
                        return
                    self.restarts += 1
                    self.restart_delays.append(delay)
                    await self._change_state(
                        EngineState.BACKOFF,
                        f"{failure.reason}; restart {self.restarts} in {delay:g} s",
                        refused=failure.refused,
                    )
                    await self._within(delay, functools.partial(self._until, _ASKED))
            await self._change_state(EngineState.EXITED, "stopped on request")
        finally:
            with anyio.CancelScope(shield=True):
                if self.state not in _DONE and self._on_cancel == "leave" and self._group_alive:
                    # the engine serves on; its pidfile says where to find it
                    await self._change_state(EngineState.LEFT)
                    log.info("%s: left running (pid %s) for the next agent", self.shard, self.pid)
                else:
                    # cancelled (agent exiting) or done: the process group must not outlive us
                    await self._terminate(self.timing.cancel_grace)
                    self._forget_pidfile()
                    if self.state not in _DONE:
                        await self._change_state(EngineState.EXITED)
                if self._run is not None and self.state is not EngineState.LEFT:
                    self._run.signal(0)  # collected if it exited

    async def drain(self, timeout: float | None = None) -> None:
        """Report draining at once, let in-flight requests finish (bounded), then stop."""
        if self.state in _DONE or self.state in _ASKED:
            return await self.stop()
        await self._change_state(EngineState.DRAINING, "waiting for in-flight requests")
        adopted_ready = self._adopted_from is not None and self._adopted_from.ready
        if (self.phase_was_ready or adopted_ready) and self.command.base_url:

            async def idle() -> None:
                # an engine adopted to be drained, say, once run() has adopted it
                await self._until(_DONE, lambda: self._run is not None)
                await self._wait_idle()

            limit = self.timing.drain_timeout if timeout is None else timeout
            if not await self._within(limit, idle):
                log.warning("%s: drain timed out with requests in flight; stopping", self.shard)
        await self.stop()

    async def stop(self) -> None:
        """SIGTERM the engine's group, SIGKILL after the grace period; returns when gone.
        Before run(): returns at once, and run() then stops whatever it was given to adopt."""
        self._on_cancel = "stop"  # a stop asked for is a stop, whatever was said before
        before = self.state
        if before in _DONE:
            return
        if before is not EngineState.STOPPING:
            await self._change_state(EngineState.STOPPING)
        if before is not EngineState.IDLE:
            await self._until(_DONE)

    @property
    def phase_was_ready(self) -> bool:
        return self._ready_at is not None

    @property
    def done(self) -> bool:
        return self.state in _DONE

    # --- one engine process --------------------------------------------------------

    async def _run_once(self) -> EngineExit | None:
        """Run the engine until it exits; why it failed, or None when stopped."""
        self._ready_at = None
        await self._change_state(EngineState.STARTING, " ".join(self.command.argv))
        prefix = self._prefix() if callable(self._prefix) else self._prefix
        argv = [*prefix, *self.command.argv]
        try:
            self._log.write(
                f"=== llmgw {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: "
                f"{' '.join(argv)}\n".encode()
            )
            self._log_from = self._log.size()
            out = self._log.open_for_engine()
        except OSError as e:
            return EngineExit(
                f"cannot open engine log {self._log.path}: {e.strerror}; check the agent's "
                "state dir"
            )
        # every process of the engine inherits it: what proves to a later agent that a
        # worker outliving its leader is this engine's, and not a reused group number's
        marker = new_marker(self.shard)
        try:
            run = await self._launcher.start(argv, {**self.command.env, ENGINE_MARKER: marker}, out)
        except OSError as e:
            return EngineExit(f"cannot start {argv[0]}: {e.strerror or e}")
        finally:
            os.close(out)  # the engine has its own copy
        self._engine_is(run)
        self._remember_pidfile(marker=marker)
        failure: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_readiness, failure)
            tg.start_soon(self._watch_stop)
            tg.start_soon(self._watch_log)
            code = await run.exited()
            # the leader is gone; workers it left (holding GPU memory) go too
            await self._terminate(self.timing.stop_grace)
            tg.cancel_scope.cancel()
        self._forget_pidfile()
        self._log.write(f"=== llmgw: engine exited: {describe_exit(code)}\n".encode())
        if self.state in _ASKED:
            return None
        if failure:
            return EngineExit(failure[0])
        return self._exited(describe_exit(code))

    def _exited(self, how: str) -> EngineExit:
        """An exit nobody asked for: how, when, the engine's own first error, and whether the
        port it was to serve on is held by another process now (it may have taken it while
        the engine loaded: vLLM binds only after loading; the controller then moves it)."""
        when = "while loading" if self._ready_at is None else "while serving"
        reason = f"{how} {when}"
        if error := self._log.error(self._log_from):
            reason += f" ({error})"
        if self._ready_at is None and not self.spec.headless:
            held = bind_error(self.spec.host, self.spec.port)
            if held is not None and held.errno == errno.EADDRINUSE:
                reason += f"; port {self.spec.port} on {self.spec.host} is held by another process"
                return EngineExit(reason, refused=PORT_IN_USE)
        return EngineExit(reason)

    async def _watch_adopted(self, record: EngineProcess) -> EngineExit | None:
        """An engine an earlier agent started: not this process's child, so its exit is
        learnt from a pidfd (its code is lost; its log's last lines are not)."""
        self._log_from = max(0, self._log.size() - 64 * 1024)
        if self.state not in _ASKED:  # adopted to be drained or stopped: it stays so
            await self._change_state(EngineState.STARTING)
        adopted = await anyio.to_thread.run_sync(
            ProcessGroup.adopt, record.pid, functools.partial(leader_alive, record)
        )
        if adopted is None:
            if self.state_dir is not None:
                remove_pidfile(self.state_dir, self.shard)
            return EngineExit("the engine left by an earlier agent exited before it was adopted")
        group = adopted
        self._engine_is(group)
        self._remember_pidfile(record)
        self._log.write(
            f"=== llmgw {time.strftime('%Y-%m-%dT%H:%M:%S')} adopted by a new agent "
            f"(pid {record.pid})\n".encode()
        )
        failure: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(self._watch_readiness, failure, adopted=record))
            tg.start_soon(self._watch_stop)
            tg.start_soon(self._watch_log)
            await group.exited()
            await self._terminate(self.timing.stop_grace)
            tg.cancel_scope.cancel()
        group.alive = False
        self._forget_pidfile()
        self._log.write(b"=== llmgw: adopted engine exited (its exit status is not known)\n")
        if self.state in _ASKED:
            return None
        if failure:
            return EngineExit(failure[0])
        return self._exited("exited (adopted from an earlier agent: exit status not known)")

    async def _watch_readiness(
        self, failure: list[str], *, adopted: EngineProcess | None = None
    ) -> None:
        within = self.timing.readiness_timeout
        if adopted is None:
            await self._report("loading", "process started, waiting for readiness")
        elif adopted.ready:
            # it served under its earlier agent: it answers ready again at once, or it hangs
            within = self.timing.adopted_ready_grace
        else:  # still loading: its load began when it started, not now
            within -= max(0.0, self._clock.wall() - adopted.started_at)
        hung = adopted is not None and adopted.ready
        deadline = self._clock.monotonic() + within
        probe = Probe(False, "not probed yet")
        while self._clock.monotonic() < deadline:
            probe = await self._probe()
            if not probe.ready and adopted is not None:
                how = "adopted after serving, not ready now" if hung else "adopted while loading"
                adopted = None  # say so once
                await self._report("loading", f"{how}: {probe.detail}")
            if probe.ready:
                self._ready_at = self._clock.monotonic()
                self._rewrite_pidfile(ready=True)
                if self.state is EngineState.STARTING:  # not when asked to drain or stop
                    await self._change_state(EngineState.RUNNING, probe.detail)
                return
            await self._clock.sleep(self.timing.poll_interval)
        if hung:
            failure.append(
                f"adopted after it had served, but not ready again within {within:g} s "
                f"(last: {probe.detail}): a hung engine"
            )
        else:
            failure.append(
                f"not ready after {self.timing.readiness_timeout:g} s (last: {probe.detail}); "
                "raise the readiness timeout if this model loads slower"
            )
        await self._terminate(self.timing.stop_grace)

    async def _within(self, seconds: float, wait: Callable[[], Awaitable[object]]) -> bool:
        """`wait()` for at most `seconds` by the supervisor's clock; True if it returned."""
        done = False
        async with anyio.create_task_group() as tg:

            async def waiting() -> None:
                nonlocal done
                await wait()
                done = True
                tg.cancel_scope.cancel()

            tg.start_soon(waiting)
            await self._clock.sleep(seconds)
            tg.cancel_scope.cancel()
        return done

    async def _watch_stop(self) -> None:
        await self._until((EngineState.STOPPING,))
        await self._terminate(self.timing.stop_grace)

    async def _watch_log(self) -> None:
        while True:
            await anyio.sleep(self.timing.log_check)
            if self._log.rotate_if_large():
                self._log_from = 0

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
                body = await r.content.read(MAX_ENGINE_ANSWER + 1)
                while len(body) <= MAX_ENGINE_ANSWER and not r.content.at_eof():
                    more = await r.content.read(MAX_ENGINE_ANSWER + 1 - len(body))
                    if not more:
                        break
                    body += more
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        if len(body) > MAX_ENGINE_ANSWER:
            log.warning(
                "engine of %s answered %s with more than %d bytes; not read",
                self.spec.served_name,
                path,
                MAX_ENGINE_ANSWER,
            )
            return None
        return r.status, body

    async def gauges(self) -> EngineGauges | None:
        """The engine's own load (its /metrics), while it serves; None otherwise, or when it
        reports none. For the autoscaler, through the node's heartbeat."""
        if self.state is not EngineState.RUNNING or self._http is None:
            return None
        if self.spec.headless or not self.command.base_url:
            return None
        got = await self._get("/metrics")
        if got is None or got[0] != 200:
            return None
        return self.adapter.gauges(got[1].decode("utf-8", "replace"))

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
                await self._clock.sleep(self.timing.drain_poll)

    # --- signals -------------------------------------------------------------------

    @property
    def _group_alive(self) -> bool:
        return self._run is not None and self._run.signal(0)

    def _signal_group(self, sig: int) -> bool:
        """Signal the engine's group; False once the group is gone (then never again)."""
        return self._run is not None and self._run.signal(sig)

    async def _group_gone(self, within: float) -> bool:
        with anyio.move_on_after(within):
            while True:
                if not self._signal_group(0):
                    return True
                await anyio.sleep(0.02)
        return False

    async def _terminate(self, grace: float) -> None:
        """SIGTERM to the group, SIGKILL to what is left after `grace` seconds."""
        if not self._signal_group(signal.SIGTERM):
            return
        if await self._group_gone(grace):
            return
        log.warning("%s: engine ignored SIGTERM for %g s; sending SIGKILL", self.shard, grace)
        with contextlib.suppress(OSError):
            self._log.write(f"=== llmgw: no exit {grace:g} s after SIGTERM; SIGKILL\n".encode())
        self._signal_group(signal.SIGKILL)
        await self._group_gone(10.0)

    # --- the state, and what waits for it -------------------------------------------

    async def _change_state(
        self, new: EngineState, reason: str | None = None, *, refused: str = ""
    ) -> None:
        """The one way the state changes: the move must be in MOVES (StateError: a bug),
        then the state is set, whatever waits for it is woken, and with a `reason` the phase
        the new state implies (`PHASE_OF`) is reported."""
        check_move(self.state, new)
        log.debug("%s: engine %s -> %s", self.shard, self.state.value, new.value)
        self.state = new
        self._wake()
        phase = PHASE_OF[new]
        if reason is not None and phase is not None:
            await self._report(phase, reason, gave_up=new is EngineState.FATAL, refused=refused)

    def _engine_is(self, run: EngineRun) -> None:
        """The engine started or adopted now (what a drain waits for)."""
        self._run, self.pid = run, run.pid
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _until(
        self, states: Iterable[EngineState], holds: Callable[[], bool] = lambda: False
    ) -> None:
        """Returns once the state is one of `states`, or `holds()`."""
        wanted = frozenset(states)
        while self.state not in wanted and not holds():
            await self._changed.wait()

    # --- reports and bookkeeping -----------------------------------------------------

    async def _report(
        self, phase: SupervisorPhase, reason: str, *, gave_up: bool = False, refused: str = ""
    ) -> None:
        if self.state in _ASKED and phase in ("starting", "loading", "ready"):
            return  # a drain or stop in progress is what the router must keep seeing
        self.phase = phase
        change = PhaseChange(
            phase=phase,
            reason=reason,
            tail=self.tail() if phase in ("failed", "stopped") else [],
            restarts=self.restarts,
            pid=self.pid if phase not in ("stopped",) else None,
            at=self._clock.wall(),
            gave_up=gave_up,
            refused=refused,
        )
        try:
            await self._on_phase(change)
        except Exception:  # a reporting failure must not take the engine down
            log.exception("%s: reporting phase %s failed", self.shard, phase)

    def _remember_pidfile(self, adopted: EngineProcess | None = None, marker: str = "") -> None:
        if self.state_dir is None or self.pid is None or not (self._run and self._run.adoptable):
            return
        if adopted is not None:
            # its command line stays the one it was started with (what /proc shows)
            record = msgspec.structs.replace(adopted, generation=self.generation, ready=False)
        else:
            record = new_record(
                self.shard,
                self.pid,
                self.command.argv,
                self.spec.port,
                list(self.spec.gpu_uuids),
                str(self._log.path),
                generation=self.generation,
                rank=self.spec.rank,
                nodes=self.spec.nodes,
                master_addr=self.spec.master_addr or "",
                marker=marker,
                cpu_cores=list(self.spec.cpu_cores),
            )
        self._pidfile = record
        write_pidfile(self.state_dir, record)

    def _rewrite_pidfile(self, **change: object) -> None:
        if self.state_dir is None or self._pidfile is None or not self._group_alive:
            return
        self._pidfile = msgspec.structs.replace(self._pidfile, **change)
        write_pidfile(self.state_dir, self._pidfile)

    def _forget_pidfile(self) -> None:
        if self.state_dir is not None and not self._group_alive:
            remove_pidfile(self.state_dir, self.shard)
            self._pidfile = None


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
