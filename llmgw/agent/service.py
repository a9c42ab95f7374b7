"""llmgw-agent: registers the node's inventory, heartbeats, and keeps both true.

On start it writes `nodes.<id>` (the whole inventory: registration carries everything, so
a reconnecting agent refreshes what the control plane knows), then `leases.<id>` every
heartbeat with the RAM read that beat. RAM total changing, an engine appearing or
disappearing, the weights held changing, a GPU's processes or error counters changing
(memory moving by less than 1 GB: within a minute), or another program starting or
stopping to listen on the engine port range rewrites `nodes.<id>`; nothing else does.
SIGTERM/SIGINT stop it within a second (the seed's agent took 90 s and ended in SIGKILL).

It registers before it scans weights: a weights directory is anyone's to fill, and a filer
that hangs must not keep a node from being seen. Scans run in the background, one at a
time, and a scan stuck inside a filer is reported as such while heartbeats go on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import click
import msgspec

from llmgw import __version__
from llmgw.agent import inventory
from llmgw.agent.certificate import CertificateError, check_tls_files
from llmgw.agent.config import DEFAULT_CONFIG_PATH, AgentConfig, ConfigError, load_config
from llmgw.agent.discovery.engines import settle_versions
from llmgw.agent.discovery.weights.scan import weights_equal_for_resend
from llmgw.agent.discovery.xid import XidLog, with_xids
from llmgw.agent.engines.launcher import EngineLauncher
from llmgw.agent.lifetime import leave_engines_now
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.shards import NodeShards
from llmgw.agent.weights import WeightsScanner, stuck_scan
from llmgw.bus import keys, records
from llmgw.bus.client import DEFAULT_NATS_URL, BucketSettings, Bus, NatsSettings
from llmgw.bus.errors import BusSettingsError
from llmgw.errors import stated
from llmgw.keyfiles import read_key
from llmgw.logs import setup_logging
from llmgw.metrics_http import MetricsEndpoint, parse_listen

log = logging.getLogger("llmgw.agent.service")  # also when run as __main__


def nats_settings(cfg: AgentConfig, node_id: str, identity_source: str) -> NatsSettings:
    return NatsSettings(
        urls=tuple(cfg.nats.urls or [DEFAULT_NATS_URL]),
        tls_ca=cfg.nats.tls_ca,
        tls_cert=cfg.nats.tls_cert,
        tls_key=cfg.nats.tls_key,
        name=f"llmgw-agent {node_id}",
        identity=f"node {node_id} ({identity_source})",
        # a private inbox per node lets mTLS permissions allow _INBOX.<node>.> only
        inbox_prefix=f"_INBOX.{node_id}",
    )


# A scan past its deadline stops at its next file operation; one still running this long
# after the deadline is stuck inside one (a hung filer), where no deadline reaches.
STUCK_GRACE = 2.0


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        weights_scanner: WeightsScanner | None = None,
        hardware: inventory.Hardware | None = None,
        launcher: EngineLauncher | None = None,
        bus: Bus | None = None,
        config_path: str = "the agent config",
    ) -> None:
        """`hardware` and `launcher` answer for the node and start its engines (this
        machine's, by default); `bus`: a connection shared with other agents (simulated
        nodes, llmgw.sim), used and left open, instead of one of its own."""
        self.cfg = cfg
        self.config_path = config_path
        self.started_at = time.time()
        self.bus: Bus | None = bus
        self._own_bus = bus is None
        self._launcher = launcher
        self.inventory: records.NodeInventory | None = None
        self.shards: NodeShards | None = None  # once running: its replicas on this node
        self._written: records.NodeInventory | None = None
        self._written_at = float("-inf")  # anyio.current_time of the last nodes.<id> write
        self._write_lock = anyio.Lock()
        self._seq = 0
        self._weights_scanner = weights_scanner or WeightsScanner()
        self._hardware = hardware or inventory.Hardware()
        self._tg: anyio.abc.TaskGroup | None = None
        # the scan in progress: set when it ends, and when it began (anyio.current_time)
        self._scan: tuple[anyio.Event, float] | None = None
        self.metrics = AgentMetrics(
            lambda: self.inventory.node if self.inventory else None,
            lambda: self.shards.shard_records() if self.shards else [],
            self._weights_scanner.scanning,
        )
        self._metrics_endpoint: MetricsEndpoint | None = None
        self.xids = XidLog()  # Xid events that made a GPU unfit (discovery/xid.py)
        self._xid_heard = anyio.Event()
        # the engines' own load as last sampled, and when (anyio.current_time)
        self._engine_loads: tuple[list[records.EngineLoad], float] = ([], float("-inf"))

    @property
    def node(self) -> str:
        assert self.inventory is not None
        return self.inventory.node

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Agent] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        cfg = self.cfg
        ident = await _blocking(inventory.node_identity, cfg, self._hardware)
        source = "config node.id" if cfg.node.id else f"hostname {ident.hostname}"
        log.info(
            "llmgw-agent %s: node %s (%s), address %s",
            __version__,
            ident.node,
            source,
            ident.address,
        )
        # refused here, not by the server 5 s into a crash loop
        check_tls_files(
            cfg.nats.tls_ca,
            cfg.nats.tls_cert,
            cfg.nats.tls_key,
            ident.node,
            source,
            self.config_path,
        )
        engine_key = (
            read_key(cfg.engines.api_key_file, "engine API key")
            if cfg.engines.api_key_file
            else None
        )
        # weights come later, from a scan in the background: scanned_at 0 says "not yet"
        not_scanned = records.Weights(looked=bool(cfg.weights.dirs))
        self.inventory = await _blocking(
            inventory.discover, cfg, ident, self.started_at, not_scanned, self._hardware
        )
        if self._own_bus:
            self.bus = await Bus.connect(
                nats_settings(cfg, ident.node, source),
                # waits for the controller to make the bucket: never decides its replicas
                BucketSettings(
                    name=cfg.nats.bucket, replicas=cfg.nats.bucket_replicas, create=False
                ),
            )
        assert self.bus is not None
        rescans = None
        shards = self.shards = NodeShards(
            self.bus,
            cfg,
            lambda: self.inventory,
            engine_api_key=engine_key,
            launcher=self._launcher,
        )
        try:
            await self._write_inventory(force=True)
            self.bus.on_reconnected(self._on_reconnected)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if cfg.metrics.listen:
                    listen = parse_listen(cfg.metrics.listen, "metrics.listen")
                    await tg.start(self._serve_metrics, listen)
                tg.start_soon(self._heartbeats)
                tg.start_soon(self._engine_probes)
                tg.start_soon(self._gpu_probes)
                tg.start_soon(self._xid_watch)
                tg.start_soon(self._port_probes)
                tg.start_soon(self._weights_scans)
                tg.start_soon(shards.run)
                tg.start_soon(self._engine_load_samples)
                # serve, not subscribe: a consumer another node aims here must not make us act
                rescans = await self.bus.serve(
                    keys.agent_subject(self.node, "rescan"), self._on_rescan
                )
                task_status.started(self)
        finally:
            with anyio.CancelScope(shield=True):
                if self._own_bus:
                    await self.bus.close()
                else:  # the connection goes on without this agent
                    self.bus.forget_reconnected(self._on_reconnected)
                    self.bus.forget_reconnected(shards.report_all)
                    if rescans is not None:
                        with contextlib.suppress(Exception):
                            await rescans.unsubscribe()
                log.info("llmgw-agent stopped: node %s", self.node)

    # --- nodes.<id> --------------------------------------------------------------------

    async def _write_inventory(self, *, force: bool = False, why: str = "") -> None:
        assert self.bus is not None and self.inventory is not None
        async with self._write_lock:
            current = self.inventory
            if (
                not force
                and self._written is not None
                and (inventory.comparable(current) == inventory.comparable(self._written))
            ):
                return
            current = msgspec.structs.replace(current, updated_at=time.time())
            try:
                await self.bus.put(keys.node(current.node), current)
            except Exception as e:  # noqa: BLE001 - retried on the next change or reconnect
                log.warning("could not write nodes.%s: %s; will retry", current.node, e)
                self._written = None
                return
            self._written = current
            self._written_at = anyio.current_time()
            if why:
                log.info("nodes.%s rewritten: %s", current.node, why)

    async def _on_reconnected(self) -> None:
        # registration carries everything: a control plane that lost its view rebuilds it
        await self._write_inventory(force=True, why="reconnected")

    # --- GET /metrics -------------------------------------------------------------------

    async def _serve_metrics(
        self, listen: tuple[str, int], *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """/metrics for as long as the agent runs; an address another program holds is
        said in nodes.<id> (metrics_error, which `llmgw status` shows) and tried again
        (metrics_http.MetricsEndpoint)."""
        self._metrics_endpoint = endpoint = MetricsEndpoint(
            self.metrics.registry,
            listen,
            fix=f"set metrics.listen in {self.config_path}",
            who="the node",
            on_change=self._set_metrics_error,
        )
        await endpoint.run(task_status=task_status)

    @property
    def metrics_port(self) -> int | None:
        """Bound, once serving /metrics."""
        endpoint = self._metrics_endpoint
        return None if endpoint is None else endpoint.port

    async def _set_metrics_error(self, problem: str | None) -> None:
        if self.inventory is None or self.inventory.metrics_error == problem:
            return
        self.inventory = msgspec.structs.replace(self.inventory, metrics_error=problem)
        await self._write_inventory(why=problem or "/metrics served")

    # --- loops -------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        assert self.bus is not None and self.inventory is not None
        while True:
            mem = inventory.read_memory(
                self.cfg, self._hardware
            )  # one small file: fine on the loop
            if mem.total_bytes != self.inventory.memory.total_bytes:
                old = self.inventory.memory.total_bytes
                self.inventory = msgspec.structs.replace(self.inventory, memory=mem)
                await self._write_inventory(why=f"RAM total {old} -> {mem.total_bytes} bytes")
            else:
                self.inventory = msgspec.structs.replace(self.inventory, memory=mem)
            self._seq += 1
            lease = records.Lease(
                node=self.node,
                seq=self._seq,
                time=time.time(),
                started_at=self.started_at,
                memory=mem,
                engines=self._fresh_engine_loads(),
            )
            try:
                await self.bus.put(keys.lease(self.node), lease)
            except Exception as e:  # noqa: BLE001
                log.debug("heartbeat %d not written: %s", self._seq, e)
            if self._written is None:
                await self._write_inventory(force=True, why="retry")
            await anyio.sleep(self.cfg.intervals.heartbeat)

    async def _engine_load_samples(self) -> None:
        """Each serving engine's own load, sampled once a heartbeat for the next one."""
        assert self.shards is not None
        beat = self.cfg.intervals.heartbeat
        while True:
            loads = await self.shards.engine_loads(within=min(beat, 5.0))
            self._engine_loads = (loads, anyio.current_time())
            await anyio.sleep(beat)

    def _fresh_engine_loads(self) -> list[records.EngineLoad]:
        """The last sample, unless it is older than two heartbeats (an engine that stopped
        answering its metrics is not reported busy for ever)."""
        loads, taken = self._engine_loads
        fresh = anyio.current_time() - taken <= 2 * self.cfg.intervals.heartbeat
        return loads if fresh else []

    async def _engine_probes(self) -> None:
        while True:
            await anyio.sleep(self.cfg.intervals.engine_probe)
            await self._probe_engines()

    async def _probe_engines(self) -> None:
        assert self.inventory is not None
        found = await _blocking(self._hardware.engines, self.cfg)
        found = settle_versions(found, self.inventory.engines)
        if found != self.inventory.engines:
            before = {e.name: e.version for e in self.inventory.engines}
            after = {e.name: e.version for e in found}
            self.inventory = msgspec.structs.replace(self.inventory, engines=found)
            await self._write_inventory(why=f"engines {before} -> {after}")

    async def _gpu_probes(self) -> None:
        while True:
            await anyio.sleep(self.cfg.intervals.gpu_probe)
            assert self.inventory is not None
            # a node without NVIDIA GPUs has nothing to watch; a rescan request looks again
            if self.inventory.gpus.status not in ("disabled", "no_library", "no_driver"):
                await self._probe_gpus()

    async def _xid_watch(self) -> None:
        """NVML's Xid events, waited for in a thread of its own for the agent's life; one that
        makes a GPU unfit is probed and written at once (not at the next probe)."""
        assert self.inventory is not None
        watch = self._hardware.xids
        if watch is None or self.inventory.gpus.status in ("disabled", "no_library", "no_driver"):
            return
        token = anyio.lowlevel.current_token()
        stop = threading.Event()

        def heard() -> None:
            with contextlib.suppress(RuntimeError):  # the agent is stopping
                anyio.from_thread.run_sync(self._xid_heard.set, token=token)

        async def probe_on_news() -> None:
            while True:
                await self._xid_heard.wait()
                self._xid_heard = anyio.Event()
                await self._probe_gpus()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(probe_on_news)
                why = await _in_daemon_thread(watch, self.xids, stop, heard)
                log.info("%s", why)
                tg.cancel_scope.cancel()  # nothing more will be heard
        finally:
            stop.set()

    async def _probe_gpus(self) -> None:
        """GPUs as they are now (NVML in a worker thread). Written at once when what
        placement decides by changed (processes, error counters, memory others hold moving
        by a GB or more); memory merely drifting, once `intervals.gpu_report` has passed
        since the last write."""
        assert self.inventory is not None
        found = await _blocking(inventory.probe_gpus, self.cfg, self._hardware)
        found = with_xids(found, self.xids.unfit())
        self.inventory = msgspec.structs.replace(self.inventory, gpus=found)
        if self.shards is not None:  # shared engines against their allotments
            await self.shards.hold_to_allotments(self.inventory)
        written = self._written.gpus if self._written is not None else None
        if written is None or written == found:
            return  # nothing written yet (the heartbeat retries with this), or no news
        why = inventory.gpus_changed(written, found)
        if why is None and (
            anyio.current_time() - self._written_at >= self.cfg.intervals.gpu_report
        ):
            why = "GPU memory used"
        if why is not None:
            await self._write_inventory(why=why)

    async def _port_probes(self) -> None:
        while True:
            await anyio.sleep(self.cfg.intervals.port_probe)
            await self._probe_ports()

    async def _probe_ports(self) -> None:
        assert self.inventory is not None
        found = await _blocking(inventory.probe_ports, self.cfg, self._hardware)
        if found is not None and found != self.inventory.ports:
            before = self.inventory.ports.ports
            self.inventory = msgspec.structs.replace(self.inventory, ports=found)
            await self._write_inventory(
                why=f"ports taken by other programs {before} -> {found.ports}"
            )

    async def _weights_scans(self) -> None:
        while True:
            await self._scan_weights()  # rescan requests call it too; it never runs two
            await anyio.sleep(self.cfg.weights.scan_interval)

    async def _scan_weights(self) -> None:
        """Start a scan unless one is running, and wait for it until it counts as stuck
        (weights.scan_timeout + STUCK_GRACE after it began). A stuck scan is reported and
        left to end by itself; a second one is never started beside it."""
        if self._scan is None:
            finished = anyio.Event()
            self._scan = (finished, anyio.current_time())
            assert self._tg is not None
            self._tg.start_soon(self._run_scan, finished)
        finished, began = self._scan
        stuck_at = began + self.cfg.weights.scan_timeout + STUCK_GRACE
        with anyio.move_on_after(max(0.0, stuck_at - anyio.current_time())):
            await finished.wait()
        if not finished.is_set():
            await self._report_stuck_scan()

    async def _run_scan(self, finished: anyio.Event) -> None:
        assert self.inventory is not None
        try:
            try:
                began = anyio.current_time()
                weights = await _in_daemon_thread(
                    self._weights_scanner, self.cfg, self.node, self.inventory.weights
                )
                self.metrics.scan_seconds.observe(anyio.current_time() - began)
            except Exception:  # noqa: BLE001 - a bug in the scan; the agent and its engines go on
                log.exception(
                    "weights scan failed; the next one in %g s", self.cfg.weights.scan_interval
                )
                return
            if not weights_equal_for_resend(weights, self.inventory.weights):
                self.inventory = msgspec.structs.replace(self.inventory, weights=weights)
                await self._write_inventory(why="weights held changed")
        finally:
            self._scan = None
            finished.set()

    async def _report_stuck_scan(self) -> None:
        assert self.inventory is not None
        where = self._weights_scanner.scanning()
        if where is None:
            return  # it ended meanwhile
        directory, seconds = where
        log.warning(
            "weights scan of %s running for %.0f s, past weights.scan_timeout: stuck in a "
            "file operation (a hung filer?); reported, not waited for",
            directory,
            seconds,
        )
        weights = stuck_scan(self.inventory.weights, directory, seconds)
        self.inventory = msgspec.structs.replace(self.inventory, weights=weights)
        await self._write_inventory(why=f"weights scan stuck in {directory}")

    async def rescan(self) -> None:
        """Scan weights and probe engines, GPUs and ports now (and write what changed)."""
        await self._scan_weights()
        await self._probe_engines()
        await self._probe_gpus()
        await self._probe_ports()

    async def _on_rescan(self, payload: bytes) -> bytes:
        """`llmgw.agent.<node>.rescan`: `rescan`, replying with counts. Only requests reach
        it (Bus.serve); the payload is ignored."""
        log.info("rescan requested: scanning weights and probing engines, GPUs and ports")
        await self.rescan()
        assert self.inventory is not None
        reply = {
            "node": self.node,
            "models": len(self.inventory.weights.models),
            "engines": [e.name for e in self.inventory.engines],
        }
        return msgspec.json.encode(reply)


T = TypeVar("T")


async def _blocking(fn, *args):
    # abandon_on_cancel: SIGTERM must not wait for a slow NVML call or a disk scan
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def _in_daemon_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a thread of its own that does not keep the process alive: a scan
    blocked inside a hung filer never returns, and a worker thread of anyio's would then
    hold the agent at exit after SIGTERM. Cancelling the caller abandons the thread."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append((False, e))
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except Exception:  # noqa: BLE001 - the event loop is gone: nobody waits any more
            pass

    threading.Thread(target=run, name=f"llmgw {fn.__class__.__name__}", daemon=True).start()
    await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


async def run_until_signalled(agent: Agent) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_exit_on_signal, agent, tg.cancel_scope)
        await agent.run()
        tg.cancel_scope.cancel()


async def _exit_on_signal(agent: Agent, scope: anyio.CancelScope) -> None:
    """SIGTERM or SIGINT: decide whether the engines outlive this agent (llmgw/agent/
    lifetime.py: a systemd restart leaves them for the next agent), then stop."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            leave, why = await anyio.to_thread.run_sync(
                leave_engines_now, agent.cfg.engines.on_agent_exit, sig
            )
            log.info("%s: stopping; %s", signal.Signals(sig).name, why)
            if leave and agent.shards is not None:
                agent.shards.leave_engines_running()
            scope.cancel()
            return


# sysexits.h EX_CONFIG: the config or a file it names cannot work, and restarting will not
# help (systemd's RestartPreventExitStatus= can name it)
EX_CONFIG = 78


def serve(
    config_path: Path | None,
    nats_urls: tuple[str, ...],
    log_level: str,
    *,
    hardware: inventory.Hardware | None = None,
    weights_scanner: WeightsScanner | None = None,
) -> None:
    """Load the config and run the agent until SIGTERM or SIGINT. A problem stated for a
    person ends it with that one line on stderr and a non-zero exit, without a traceback."""
    setup_logging(log_level)
    try:
        cfg = load_config(config_path, missing_ok=bool(nats_urls) and config_path is None)
        if nats_urls:
            cfg = msgspec.structs.replace(
                cfg, nats=msgspec.structs.replace(cfg.nats, urls=list(nats_urls))
            )
        agent = Agent(
            cfg,
            config_path=str(config_path or DEFAULT_CONFIG_PATH),
            hardware=hardware,
            weights_scanner=weights_scanner,
        )
        anyio.run(run_until_signalled, agent)
    except BaseException as e:
        problem = stated(e)
        if problem is None:
            raise
        click.echo(f"Error: {problem}", err=True)
        # systemd restarts it after anything else (a NATS refusal may clear), with its backoff
        config = isinstance(problem, ConfigError | CertificateError | BusSettingsError)
        sys.exit(EX_CONFIG if config else 1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help=f"agent config (default {DEFAULT_CONFIG_PATH}, or $LLMGW_AGENT_CONFIG)",
)
@click.option(
    "--nats",
    "nats_urls",
    multiple=True,
    envvar="LLMGW_NATS",
    help="NATS URL, repeatable; overrides nats.urls of the config",
)
@click.option("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "INFO"), show_default=True)
@click.version_option(__version__)
def main(config_path: Path | None, nats_urls: tuple[str, ...], log_level: str) -> None:
    """Run the llmgw agent on this node."""
    serve(config_path, nats_urls, log_level)


if __name__ == "__main__":
    main()
