"""TLS and mTLS against a real nats-server: client certificates, verify_and_map users with the
per-node permissions of llmgw.bus.permissions, and how each refusal reads to an operator."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from waiting import until, until_logged

from llmgw.agent.config import Nats
from llmgw.bus import classify, records
from llmgw.bus.client import BucketSettings, Bus, BusError, NatsSettings, decoder
from llmgw.bus.permissions import node_permissions, render_mtls_users
from llmgw.bus.server import find_nats_server, free_port

pytestmark = pytest.mark.anyio

NATS_DIR = Path(__file__).parent.parent / "nats"
# trustme always puts O and OU in a subject; nats-server matches the whole DN
SUBJECT = "CN={name},OU=fleet,O=llmgw-test"


# --- certificates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    rogue_ca: Path  # a CA nobody trusts

    def cert(self, name: str) -> tuple[str, str]:
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}-key.pem")


CLIENTS = ("operator", "controller", "router", "node05", "node06", "node99")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    trustme = pytest.importorskip("trustme", reason="test extra: pip install trustme")
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA(organization_name="llmgw-test")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ca.issue_cert("localhost", "127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    server.private_key_pem.write_to_path(str(d / "server-key.pem"))
    for name in CLIENTS:
        # a DNS SAN is needed (Go refuses trustme's empty critical SAN); this one maps to no
        # user, so nats-server falls through to the subject DN
        leaf = ca.issue_cert(
            f"{name}.fleet.test",
            common_name=name,
            organization_name="llmgw-test",
            organization_unit_name="fleet",
        )
        leaf.cert_chain_pems[0].write_to_path(str(d / f"{name}.pem"))
        leaf.private_key_pem.write_to_path(str(d / f"{name}-key.pem"))
    rogue = trustme.CA(organization_name="rogue")
    rogue.cert_pem.write_to_path(str(d / "rogue-ca.pem"))
    return Pki(d, d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "rogue-ca.pem")


# --- servers --------------------------------------------------------------------------------


@contextmanager
def running_nats(conf: Path, store_dir: Path, cwd: Path | None = None) -> Iterator[str]:
    """nats-server with `conf` on free ports; yields its URL once JetStream is ready."""
    port, http_port = free_port(), free_port()
    log_path = store_dir.parent / f"{conf.stem}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(find_nats_server()), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)]
            + ["-m", str(http_port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd or conf.parent,
        )
    try:
        wait_healthy(proc, http_port, log_path)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tls_block(pki: Pki, mode: str) -> str:
    return (
        "tls {\n"
        f"  cert_file: {json.dumps(str(pki.server_cert))}\n"
        f"  key_file: {json.dumps(str(pki.server_key))}\n"
        f"  ca_file: {json.dumps(str(pki.ca))}\n"
        f"  {mode}: true\n"
        "  timeout: 2\n"
        "}\n"
    )


def _server(tmp_path: Path, pki: Pki, mode: str, authorization: str = "") -> Iterator[str]:
    store = tmp_path / "jetstream"
    conf = tmp_path / f"{mode}.conf"
    conf.write_text(
        f"jetstream {{ store_dir: {json.dumps(str(store))} }}\n"
        + _tls_block(pki, mode)
        + authorization
    )
    with running_nats(conf, store) as url:
        yield url


@pytest.fixture
def verify_server(tmp_path: Path, pki: Pki) -> Iterator[str]:
    """Client certificates required (any signed by the CA), no users."""
    yield from _server(tmp_path, pki, "verify")


@pytest.fixture
def mapped_server(tmp_path: Path, pki: Pki) -> Iterator[str]:
    """verify_and_map with the generated users for node05 and node06 (node99 has none)."""
    users = render_mtls_users(["node05", "node06"], subject=SUBJECT)
    yield from _server(tmp_path, pki, "verify_and_map", users)


def settings(url: str, pki: Pki, who: str | None, **kw: object) -> NatsSettings:
    cert, key = pki.cert(who) if who else (None, None)
    return NatsSettings(
        urls=(url,),
        tls_ca=str(pki.ca),
        tls_cert=cert,
        tls_key=key,
        name=f"test {who}",
        healthy_after=1.0,
        **kw,  # type: ignore[arg-type]
    )


async def connect(url: str, pki: Pki, who: str, **kw: object) -> Bus:
    return await Bus.connect(settings(url, pki, who, **kw), BucketSettings(), give_up_after=5)


def node_settings(url: str, pki: Pki, node: str, cert: str | None = None) -> NatsSettings:
    # what the agent builds (agent/service.py): identity and a private inbox
    return settings(
        url,
        pki,
        cert or node,
        identity=f"node {node} (config node.id)",
        inbox_prefix=f"_INBOX.{node}",
    )


def refused_fast(s: NatsSettings) -> NatsSettings:
    # nats-py retries a refused first connect by itself until Bus.connect's window
    # (connect_timeout + 0.5 s) ends: a short timeout keeps these tests short
    return dataclasses.replace(s, connect_timeout=0.3)


def wait_healthy(proc: subprocess.Popen[bytes], http_port: int, log: Path) -> None:
    """Until the nats-server `proc` says JetStream is up (AssertionError with its log if it
    exits or 10 s pass)."""
    deadline = time.monotonic() + 10
    health = f"http://127.0.0.1:{http_port}/healthz?js-enabled-only=true"
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"nats-server did not start:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(health, timeout=0.5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)


def errors(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


# --- plain mTLS --------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["nats", "tls"])
async def test_client_certificate_connects_and_uses_the_bucket(verify_server, pki, scheme) -> None:
    # nats:// is upgraded because the server requires TLS; tls:// insists on it
    bus = await connect(verify_server.replace("nats://", f"{scheme}://"), pki, "node05")
    try:
        rev = await bus.put("catalog.m1", b'{"over": "tls"}')
        assert await bus.get_raw("catalog.m1") == (b'{"over": "tls"}', rev)
        assert bus.nc.connected_url is not None
    finally:
        await bus.close()


async def test_missing_client_certificate_is_refused_naming_tls(verify_server, pki, caplog):
    no_cert = NatsSettings(urls=(verify_server,), tls_ca=str(pki.ca), identity="node n1 (test)")
    with anyio.fail_after(10), pytest.raises(BusError) as refused:
        await Bus.connect(refused_fast(no_cert), give_up_after=0.5)
    # TLS 1.3 checks the client certificate after the handshake: the refusal arrives either
    # as the server's alert or as a dropped connection (a broken pipe, a reset), logged as a
    # TLS problem on a retry or, when it was the only try, said in the error raised (which
    # said a bare "[Errno 32] Broken pipe" in 1 try of 3)
    said = errors(caplog) + "\n" + str(refused.value)
    assert ("TLS handshake with NATS failed" in said and "CERTIFICATE_REQUIRED" in said) or (
        "NATS closed the TLS connection while setting it up" in said
    ), said
    assert "no client certificate" in said


async def test_untrusted_server_certificate_fails_fast_naming_tls(verify_server, pki, caplog):
    cert, key = pki.cert("node05")
    wrong_ca = NatsSettings(
        urls=(verify_server,), tls_ca=str(pki.rogue_ca), tls_cert=cert, tls_key=key
    )
    # a wrong CA must be an answer, not a hang
    with anyio.fail_after(10), pytest.raises(BusError) as refused:
        await Bus.connect(refused_fast(wrong_ca), give_up_after=0.5)
    assert "certificate verify failed" in str(refused.value)
    assert "TLS handshake with NATS failed" in errors(caplog)
    assert "node05.pem" in errors(caplog)


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    return host_dirs(tmp_path)


def tls_agent_config(url: str, pki: Pki, host: dict[str, Path], node: str, cert: str):
    cfg = agent_config(url, host, id=node)
    cert_file, key_file = pki.cert(cert)
    return msgspec.structs.replace(
        cfg, nats=Nats(urls=[url], tls_ca=str(pki.ca), tls_cert=cert_file, tls_key=key_file)
    )


async def _wait_node(bus: Bus, node: str) -> records.NodeInventory:
    with anyio.fail_after(15):
        while True:
            e = await bus.get(f"nodes.{node}", decoder(records.NodeInventory))
            if e is not None:
                return e.value
            await anyio.sleep(0.05)


async def _wait_log(path: Path, pattern: str, timeout: float = 15.0) -> str:
    async def matched() -> str | None:
        text = path.read_text(errors="replace") if path.exists() else ""
        m = re.search(pattern, text)
        return m.group(0) if m else None

    try:
        return await until(matched, timeout=timeout)
    except TimeoutError:
        text = path.read_text(errors="replace") if path.exists() else ""
        raise AssertionError(f"no line matching {pattern!r} in {path}:\n{text[-3000:]}") from None


async def test_agent_registers_over_mtls(verify_server, pki, host, tmp_path) -> None:
    cfg = tls_agent_config(verify_server, pki, host, "node05", "node05")
    operator = await connect(verify_server, pki, "operator")
    proc = start_agent(cfg, tmp_path / "agent.toml", [host["bin"]], tmp_path / "agent.log")
    try:
        inv = await _wait_node(operator, "node05")
        assert inv.node == "node05"
    finally:
        assert stop(proc) == 0
        await operator.close()


# --- verify_and_map: per-node users ------------------------------------------------------


async def test_agent_with_its_own_certificate_registers_and_answers_requests(
    mapped_server, pki, host, tmp_path
) -> None:
    cfg = tls_agent_config(mapped_server, pki, host, "node05", "node05")
    log = tmp_path / "agent.log"
    proc = start_agent(cfg, tmp_path / "agent.toml", [host["bin"]], log)
    operator = None
    try:
        # started first, the agent waits for the bucket: its identity may not make it, and
        # never tries (it was refused, and exited)
        until_logged(proc, log, "bucket llmgw does not exist", timeout=30)
        operator = await connect(mapped_server, pki, "operator")  # creates the bucket
        assert (await _wait_node(operator, "node05")).node == "node05"
        # subscribe to llmgw.agent.node05.> and reply to another user's inbox: both allowed
        with anyio.fail_after(15):
            while True:
                try:
                    reply = await operator.request("llmgw.agent.node05.rescan", timeout=1.0)
                    break
                except Exception:  # noqa: BLE001 - not subscribed yet
                    await anyio.sleep(0.1)
        assert json.loads(reply)["node"] == "node05"
    finally:
        assert stop(proc) == 0
        if operator is not None:
            await operator.close()
    assert "permissions violation" not in log.read_text()


async def test_agent_with_an_unmapped_certificate_is_refused_naming_certificate_and_claim(
    mapped_server, pki, host, tmp_path
) -> None:
    cfg = tls_agent_config(mapped_server, pki, host, "node99", "node99")
    log_path = tmp_path / "agent.log"
    proc = start_agent(cfg, tmp_path / "agent.toml", [host["bin"]], log_path)
    try:
        line = await _wait_log(log_path, r".*authorization violation.*")
    finally:
        assert stop(proc) == 0  # still stops promptly while retrying
    assert "node99.pem" in line
    assert "claimed identity node node99 (config node.id)" in line


async def test_a_tls_key_of_another_certificate_exits_78_as_every_tls_refusal(
    mapped_server, pki, host, tmp_path
) -> None:
    """It exited 1, where the other TLS refusals exit 78 (EX_CONFIG): one code for a file
    that cannot work, which systemd's RestartPreventExitStatus=78 names."""
    cfg = tls_agent_config(mapped_server, pki, host, "node05", "node05")
    _, other_key = pki.cert("node06")
    cfg = msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, tls_key=other_key))
    log_path = tmp_path / "agent.log"
    proc = start_agent(cfg, tmp_path / "agent.toml", [host["bin"]], log_path)
    assert proc.wait(timeout=30) == 78
    assert "the key must be that certificate's private key" in log_path.read_text()


async def test_agent_claiming_another_node_refuses_to_start_naming_both(
    mapped_server, pki, host, tmp_path
) -> None:
    # a node05 certificate on a host whose id came out as node06: the seed's mismatch
    # the agent refuses to start, in words an operator can act on, instead of connecting to
    # be refused its inbox and every write (and crash-looping under systemd)
    operator = await connect(mapped_server, pki, "operator")
    cfg = tls_agent_config(mapped_server, pki, host, "node06", "node05")
    log_path = tmp_path / "agent.log"
    proc = start_agent(cfg, tmp_path / "agent.toml", [host["bin"]], log_path)
    assert proc.wait(timeout=30) == 78  # EX_CONFIG
    try:
        assert await operator.get_raw("nodes.node06") is None
    finally:
        await operator.close()
    text = log_path.read_text()
    assert "Traceback" not in text and "permissions violation" not in text
    assert (
        f"certificate CN=node05 ({pki.dir / 'node05.pem'}) does not match node id node06 "
        f"(from config node.id); set node.id in {tmp_path / 'agent.toml'} or reissue the certificate"
    ) in text


async def test_bus_connect_with_an_unmapped_certificate_gives_up_with_bus_error(
    mapped_server, pki, caplog
) -> None:
    with anyio.fail_after(10), pytest.raises(BusError, match="Authorization Violation"):
        await Bus.connect(
            refused_fast(node_settings(mapped_server, pki, "node99")), give_up_after=0.5
        )
    assert "node99.pem" in errors(caplog)
    assert "claimed identity node node99" in errors(caplog)


# who -> (keys it must be able to write, keys it must not)
WRITES = {
    "node05": (
        ["nodes.node05", "leases.node05", "shards.node05.r1"],
        [
            "nodes.node06",
            "leases.node06",
            "shards.node06.r1",
            "assign.node05.r1",
            "catalog.m1",
            "ops.node05",  # a node cannot uncordon itself
            "rollout.m1",
        ],
    ),
    "controller": (
        [
            "assign.node05.r1",
            "health.node05",
            "replicas.m1.r1",
            "placement.m1",
            "rollout.m1",
            "leader",
        ],
        ["nodes.node05", "shards.node05.r1", "catalog.m1", "ops.node05"],
    ),
    "router": ([], ["catalog.m1", "replicas.m1.r2", "ops.node05", "rollout.m1"]),
    "operator": (["catalog.m1", "desired.m1", "ops.node05"], []),
}


async def test_each_identity_writes_exactly_the_keys_it_owns_and_reads_all(
    mapped_server, pki
) -> None:
    operator = await connect(mapped_server, pki, "operator")
    await operator.put("catalog.seen", b"{}")
    buses = {"operator": operator}
    outcome: dict[tuple[str, str], bool] = {}
    try:
        for who in WRITES:
            if who not in buses:
                inbox = {"node05": "_INBOX.node05"}.get(who)
                buses[who] = await connect(mapped_server, pki, who, inbox_prefix=inbox)

        async def attempt(who: str, key: str) -> None:
            try:
                # a forbidden put is dropped by the server: it only ever times out
                with anyio.fail_after(2):
                    await buses[who].put(key, json.dumps({"by": who}).encode())
                outcome[who, key] = True
            except Exception:  # noqa: BLE001
                outcome[who, key] = False

        async with anyio.create_task_group() as tg:
            for who, (allowed, denied) in WRITES.items():
                for key in allowed + denied:
                    tg.start_soon(attempt, who, key)
        for who, bus in buses.items():
            assert await bus.get_raw("catalog.seen") is not None, f"{who} cannot read"
        # each refusal reached its client, naming what was refused (the last one kept)
        denied = {who: bus.connection.denied for who, bus in buses.items()}
    finally:
        for bus in buses.values():
            await bus.close()
    wrong = {
        f"{who} {'could not' if key in allowed else 'could'} write {key}"
        for who, (allowed, denied) in WRITES.items()
        for key in allowed + denied
        if outcome[who, key] != (key in allowed)
    }
    assert not wrong
    for who, (_, refused) in WRITES.items():
        if refused:
            assert denied[who] is not None and denied[who].action == "publish", who
            assert denied[who].subject.removeprefix("$kv.llmgw.") in refused, denied[who]


async def test_controller_creates_the_bucket_when_it_is_missing(mapped_server, pki) -> None:
    controller = await connect(mapped_server, pki, "controller")
    try:
        info = await controller.js.stream_info("KV_llmgw")
        assert info.config.name == "KV_llmgw"
    finally:
        await controller.close()


async def test_node_watches_its_assignments_through_its_own_inbox(mapped_server, pki) -> None:
    operator = await connect(mapped_server, pki, "operator")
    node = await Bus.connect(node_settings(mapped_server, pki, "node05"), give_up_after=5)
    try:
        await operator.put("assign.node05.r1", b'{"x": 1}')
        await operator.put("assign.node06.r1", b'{"x": 2}')
        with anyio.fail_after(10):
            seen = await node.list("assign.node05.*", lambda b: b)
        assert list(seen) == ["assign.node05.r1"]
    finally:
        await node.close()
        await operator.close()


async def test_no_node_can_make_another_node_act_through_a_consumer_aimed_at_it(
    mapped_server, pki, host, tmp_path, caplog
) -> None:
    # node05 may create consumers (its watches need them) and a consumer's deliver subject
    # travels in the request body, where permissions cannot look: it aims one at node06's
    # request subject, and forges a reply to the same subject on a JetStream API request
    operator = await connect(mapped_server, pki, "operator")  # creates the bucket
    cfg = tls_agent_config(mapped_server, pki, host, "node06", "node06")
    log_path = tmp_path / "agent.log"
    proc = start_agent(cfg, tmp_path / "agent.toml", [host["bin"]], log_path)
    subject = "llmgw.agent.node06.rescan"

    async def answered() -> bytes | None:
        try:
            return await operator.request(subject, timeout=1.0)
        except Exception:  # noqa: BLE001 - not serving yet
            return None

    try:
        await until(answered)  # the agent serves its subject: one real rescan
        node05 = await connect(mapped_server, pki, "node05", inbox_prefix="_INBOX.node05")
        rogue = await node05.js.add_consumer(
            "KV_llmgw",
            ConsumerConfig(
                deliver_subject=subject,
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.NONE,
                idle_heartbeat=0.5,
            ),
        )
        await node05.nc.publish("$JS.API.STREAM.INFO.KV_llmgw", b"", reply=subject)
        await node05.close()
        # the consumer outlives node05's connection: what is written now reaches node06 too
        last = await operator.put("catalog.after", b"{}")

        async def all_delivered() -> bool:
            info = await operator.js.consumer_info("KV_llmgw", rogue.name)
            return info.delivered.stream_seq >= last

        await until(all_delivered)
        # one subscription, handled in order: once this is answered, every delivery before
        # it has been handled too
        assert json.loads(await operator.request(subject, timeout=10))["node"] == "node06"
    finally:
        assert stop(proc) == 0
        await operator.close()
    text = log_path.read_text()
    assert text.count("rescan requested") == 2, text[-3000:]  # the operator's two, only
    assert "spoof attempt" in text
    assert f"nats consumer rm KV_llmgw {rogue.name}" in text  # how to remove it


def test_tls_files_that_cannot_work_are_named_with_what_is_wrong(pki, tmp_path) -> None:
    cert, key = pki.cert("node05")
    _, other_key = pki.cert("node06")
    der = tmp_path / "ca.der"
    der.write_bytes(b"0\x82\x01\x0a" + b"\x00" * 64)  # what a DER file starts with
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_text(
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n"
    )
    missing = str(tmp_path / "nowhere.pem")
    cases = [
        (dict(tls_ca=missing), f"TLS CA file {missing} does not exist"),
        (dict(tls_ca=str(tmp_path)), f"TLS CA file {tmp_path} is a directory"),
        (dict(tls_ca=str(der)), f"TLS CA file {der} is not PEM"),
        (dict(tls_ca=key), f"TLS CA file {key} is PEM but holds no CERTIFICATE"),
        (dict(tls_cert=missing, tls_key=key), f"TLS certificate {missing} does not exist"),
        (dict(tls_cert=key, tls_key=key), f"TLS certificate {key} is PEM but holds no CERT"),
        (dict(tls_cert=cert, tls_key=cert), f"TLS key {cert} is PEM but holds no PRIVATE KEY"),
        (dict(tls_cert=cert, tls_key=str(encrypted)), f"TLS key {encrypted} is encrypted"),
        (dict(tls_cert=cert, tls_key=other_key), f"cannot use TLS certificate {cert} with key"),
        (dict(tls_cert=cert), f"TLS certificate {cert} given without its key"),
        (dict(tls_key=key), f"TLS key {key} given without its certificate"),
    ]
    wrong = []
    for files, expected in cases:
        try:
            NatsSettings(**files).ssl_context()  # type: ignore[arg-type]
            wrong.append(f"{files}: accepted")
        except BusError as e:
            if expected not in str(e):
                wrong.append(f"{files}: {e}")
        except Exception as e:  # noqa: BLE001 - the bug: a raw traceback
            wrong.append(f"{files}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)


async def test_a_missing_tls_file_fails_the_connect_at_once(pki, tmp_path) -> None:
    settings = NatsSettings(urls=("nats://127.0.0.1:1",), tls_ca=str(tmp_path / "ca.pem"))
    with anyio.fail_after(5), pytest.raises(BusError, match="ca.pem does not exist"):
        await Bus.connect(settings)  # no give_up_after: a retry loop would never end


def test_the_cli_names_a_tls_file_that_is_not_pem_without_a_traceback(tmp_path) -> None:
    from click.testing import CliRunner

    from llmgw.cli import main

    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("this is not a certificate\n")
    result = CliRunner().invoke(
        main, ["status", "--nats", "nats://127.0.0.1:1", "--tls-ca", str(not_pem)]
    )
    assert result.exit_code != 0
    assert f"TLS CA file {not_pem} is not PEM" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# --- the generator and the shipped example ------------------------------------------------


def test_node_permissions_write_only_its_own_keys() -> None:
    allowed = node_permissions("node05", "fleet")["publish"]["allow"]  # type: ignore[index]
    writes = sorted(s for s in allowed if s.startswith("$KV."))
    assert writes == [
        "$KV.fleet.leases.node05",
        "$KV.fleet.nodes.node05",
        "$KV.fleet.shards.node05.*",
    ]


def test_a_node_id_that_is_not_a_token_is_refused() -> None:
    with pytest.raises(ValueError, match="node id 'node05.evil'"):
        node_permissions("node05.evil", "llmgw")


def test_a_subject_template_without_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match="must contain"):
        render_mtls_users(["node05"], subject="CN=node05")


def _generated_block(conf_text: str) -> str:
    m = re.search(r"# BEGIN generated.*?\n(.*)# END generated", conf_text, re.S)
    assert m, "nats/mtls.conf lost its '# BEGIN generated' / '# END generated' markers"
    return m.group(1)


def test_shipped_mtls_conf_holds_what_the_generator_renders() -> None:
    text = (NATS_DIR / "mtls.conf").read_text()
    assert _generated_block(text) == render_mtls_users(
        ["node05", "node06"], "llmgw", subject="CN={name},OU=fleet,O=llmgw-example"
    )


@pytest.fixture
def shipped_mtls(tmp_path: Path) -> Iterator[Callable[..., NatsSettings]]:
    """nats/mtls.conf as it is (its store in tmp), running; yields settings for an example
    certificate's holder: `shipped_mtls("node05", inbox_prefix=...)`."""
    conf = tmp_path / "mtls.conf"
    conf.write_text(
        re.sub(
            r'store_dir: "[^"]*"',
            f"store_dir: {json.dumps(str(tmp_path / 'js'))}",
            (NATS_DIR / "mtls.conf").read_text(),
        )
    )
    certs = NATS_DIR / "example-certs"
    with running_nats(conf, tmp_path / "js", cwd=NATS_DIR) as url:

        def example(who: str, **kw: object) -> NatsSettings:
            return NatsSettings(
                urls=(url,),
                tls_ca=str(certs / "ca.pem"),
                tls_cert=str(certs / f"{who}.pem"),
                tls_key=str(certs / f"{who}-key.pem"),
                **kw,  # type: ignore[arg-type]
            )

        yield example


async def test_shipped_mtls_conf_and_example_certificates_work_together(shipped_mtls) -> None:
    operator = await Bus.connect(shipped_mtls("operator"), give_up_after=5)
    node = await Bus.connect(shipped_mtls("node05", inbox_prefix="_INBOX.node05"), give_up_after=5)
    try:
        rev = await node.put("nodes.node05", b"{}")
        assert await operator.get_raw("nodes.node05") == (b"{}", rev)
    finally:
        await node.close()
        await operator.close()


# --- how the server's refusals read (llmgw.bus.classify) ------------------------------------


async def test_a_publish_the_shipped_permissions_forbid_reads_as_a_denial_naming_the_subject(
    shipped_mtls, caplog
) -> None:
    # nats-py 2.16 hands the server's -ERR to error_cb as a bare error: the classifier reads
    # its text, and this is the text nats-server 2.15 sends
    operator = await Bus.connect(shipped_mtls("operator"), give_up_after=5)  # makes the bucket
    await operator.close()
    node = await Bus.connect(shipped_mtls("node05", inbox_prefix="_INBOX.node05"), give_up_after=5)

    async def denied(subject: str) -> classify.Denial | None:
        d = node.connection.denied
        return d if d is not None and d.subject == subject else None

    try:
        await node.nc.publish("$KV.llmgw.nodes.node06", b"{}")  # another node's key
        other_node = await until(lambda: denied("$kv.llmgw.nodes.node06"))
        await node.nc.publish("$JS.API.STREAM.CREATE.KV_other", b"{}")
        new_stream = await until(lambda: denied("$js.api.stream.create.kv_other"))
        assert node.connected  # a refused subject leaves the connection up
    finally:
        await node.close()
    assert (other_node.action, other_node.jetstream, other_node.creates_stream) == (
        "publish",
        False,
        False,
    )
    assert (new_stream.jetstream, new_stream.creates_stream) == (True, True)
    assert 'permissions violation for publish to "$kv.llmgw.nodes.node06"' in errors(caplog)


async def test_a_certificate_without_a_user_and_no_certificate_read_as_refusals(
    mapped_server, verify_server, pki
) -> None:
    async def first_connect(url: str, who: str | None) -> BaseException | None:
        s = settings(url, pki, who)
        nc = NatsClient()
        try:
            with anyio.fail_after(5):
                await nc.connect(
                    servers=[url],
                    tls=s.ssl_context(),
                    connect_timeout=0.5,
                    allow_reconnect=False,  # the first answer is the one to read
                    error_cb=_quiet,
                )
        except Exception:  # noqa: BLE001 - the refusal is what nats-py kept
            return nc.last_error
        finally:
            await nc.close()
        return None

    unmapped = await first_connect(mapped_server, "node99")
    # nats-py 2.16: "nats: 'Authorization Violation'", the base class, during CONNECT
    assert classify.problem(unmapped) is classify.Problem.AUTHORIZATION, repr(unmapped)
    no_cert = await first_connect(verify_server, None)
    # TLS 1.3 checks the client certificate after the handshake: the server's alert, or a
    # connection it closed
    assert classify.problem(no_cert) in (classify.Problem.TLS, classify.Problem.DROPPED)
    assert classify.refusal(unmapped)


async def _quiet(e: Exception) -> None:
    pass
