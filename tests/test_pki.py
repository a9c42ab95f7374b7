"""`llmgw pki`: a CA, a certificate per identity and nats-server's users, checked on the
certificates themselves and against a real nats-server (verify_and_map), following
docs/security.md as written."""

from __future__ import annotations

import json
import re
import shlex
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner, Result
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from test_tls import wait_healthy
from waiting import until

from llmgw.agent.certificate import CertificateError, check_tls_files
from llmgw.bus.client import Bus, BusError, NatsSettings
from llmgw.bus.permissions import User, render_users
from llmgw.bus.server import find_nats_server, free_port
from llmgw.cli.pki import pki

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs" / "security.md"
ETC = "/etc/nats"  # where docs/security.md puts the server's files


def llmgw_pki(*args: str | Path, ok: bool = True) -> Result:
    result = CliRunner().invoke(pki, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code != 0, result.output
        # a message for a person, not a traceback
        assert result.exception is None or isinstance(result.exception, SystemExit)
    return result


def cert_at(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def usages(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    llmgw_pki("init", "--dir", d, "--org", "Example")
    return d


# --- the CA ---------------------------------------------------------------------------------


def test_init_makes_a_ca_whose_key_only_its_owner_reads(ca_dir: Path) -> None:
    ca = cert_at(ca_dir / "ca.pem")
    assert mode(ca_dir / "ca-key.pem") == 0o600
    assert mode(ca_dir) == 0o700
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    ca.verify_directly_issued_by(ca)  # self-signed
    assert ca.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "Example"
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert 9 * 365 < lifetime.days < 11 * 365


def test_init_refuses_to_replace_a_ca_without_force(ca_dir: Path) -> None:
    before = (ca_dir / "ca.pem").read_bytes()
    refused = llmgw_pki("init", "--dir", ca_dir, ok=False)
    assert f"{ca_dir / 'ca-key.pem'} exists" in refused.output
    assert "pass --force" in refused.output
    assert (ca_dir / "ca.pem").read_bytes() == before
    llmgw_pki("init", "--dir", ca_dir, "--force")
    assert (ca_dir / "ca.pem").read_bytes() != before


# --- client certificates --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "name", "subject"),
    [
        (["node05"], "node05", "CN=node05,OU=node,O=Example"),
        (["--controller", "ctl1"], "ctl1", "CN=ctl1,OU=controller,O=Example"),
        (["--router", "r1"], "r1", "CN=r1,OU=router,O=Example"),
        (["--operator", "alice"], "alice", "CN=alice,OU=operator,O=Example"),
    ],
)
def test_issue_gives_each_identity_its_subject_client_usage_and_a_private_key(
    ca_dir: Path, args: list[str], name: str, subject: str
) -> None:
    llmgw_pki("issue", *args, "--dir", ca_dir)
    cert = cert_at(ca_dir / f"{name}.pem")
    cert.verify_directly_issued_by(cert_at(ca_dir / "ca.pem"))
    assert cert.subject.rfc4514_string() == subject
    assert usages(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # no SAN: nats-server would match a SAN before the subject
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    key_path = ca_dir / f"{name}-key.pem"
    assert mode(key_path) == 0o600
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == cert.public_key()


def test_a_node_certificate_passes_the_agents_check_of_its_node_id(ca_dir: Path) -> None:
    llmgw_pki("issue", "node05", "--dir", ca_dir)
    files = (str(ca_dir / "ca.pem"), str(ca_dir / "node05.pem"), str(ca_dir / "node05-key.pem"))
    check_tls_files(*files, "node05", "hostname node05", "agent.toml")
    with pytest.raises(CertificateError, match="CN=node05 .* does not match node id node06"):
        check_tls_files(*files, "node06", "hostname node06", "agent.toml")


def test_issue_refuses_a_name_already_in_the_directory_naming_the_file(ca_dir: Path) -> None:
    llmgw_pki("issue", "node05", "--dir", ca_dir)
    before = (ca_dir / "node05.pem").read_bytes()
    for args in (["node05"], ["--controller", "node05"]):
        refused = llmgw_pki("issue", *args, "--dir", ca_dir, ok=False)
        assert f"{ca_dir / 'node05.pem'} exists" in refused.output
        assert "--force" in refused.output
    assert (ca_dir / "node05.pem").read_bytes() == before
    llmgw_pki("issue", "node05", "--dir", ca_dir, "--force")
    assert (ca_dir / "node05.pem").read_bytes() != before


def test_issue_without_a_ca_says_how_to_make_one(tmp_path: Path) -> None:
    refused = llmgw_pki("issue", "node05", "--dir", tmp_path / "none", ok=False)
    assert f"{tmp_path / 'none' / 'ca.pem'} does not exist" in refused.output
    assert f"llmgw pki init --dir {tmp_path / 'none'}" in refused.output


def test_issue_refuses_a_node_id_that_is_not_a_token(ca_dir: Path) -> None:
    refused = llmgw_pki("issue", "node05.evil", "--dir", ca_dir, ok=False)
    assert "node id 'node05.evil' is not a valid id" in refused.output
    assert not (ca_dir / "node05.evil.pem").exists()


def test_issue_wants_exactly_one_identity(ca_dir: Path) -> None:
    for args in ([], ["node05", "--controller", "ctl1"]):
        refused = llmgw_pki("issue", *args, "--dir", ca_dir, ok=False)
        assert "give one identity" in refused.output


# --- nats-config ------------------------------------------------------------------------------


def test_nats_config_makes_a_user_of_every_certificate_in_the_directory(ca_dir: Path) -> None:
    for args in (["node06"], ["node05"], ["--controller", "ctl1"], ["--operator", "alice"]):
        llmgw_pki("issue", *args, "--dir", ca_dir)
    llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "localhost", "--bucket", "fleet")
    expected = render_users(
        [
            User("controller", "ctl1", "CN=ctl1,OU=controller,O=Example"),
            User("operator", "alice", "CN=alice,OU=operator,O=Example"),
            User("node", "node05", "CN=node05,OU=node,O=Example"),
            User("node", "node06", "CN=node06,OU=node,O=Example"),
        ],
        "fleet",
        generated_by="llmgw pki nats-config",
    )
    assert (ca_dir / "nats" / "llmgw-users.conf").read_text() == expected
    assert '"$KV.fleet.nodes.node05"' in expected  # the permissions of permissions.py


def test_nats_config_issues_a_server_certificate_for_the_names_given(ca_dir: Path) -> None:
    llmgw_pki(
        "nats-config",
        "--dir",
        ca_dir,
        "--server-name",
        "nats1.example.com",
        "--server-name",
        "10.0.0.5",
    )
    out = ca_dir / "nats"
    server = cert_at(out / "server.pem")
    server.verify_directly_issued_by(cert_at(ca_dir / "ca.pem"))
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["nats1.example.com"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    # serverAuth for clients; clientAuth because cluster routes present it to each other
    assert usages(server) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert mode(out / "server-key.pem") == 0o600
    assert (out / "ca.pem").read_bytes() == (ca_dir / "ca.pem").read_bytes()


def test_nats_config_keeps_the_server_certificate_until_other_names_are_asked(
    ca_dir: Path,
) -> None:
    server = ca_dir / "nats" / "server.pem"
    llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "nats1.example.com")
    first = server.read_bytes()
    llmgw_pki("nats-config", "--dir", ca_dir)
    llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "nats1.example.com")
    assert server.read_bytes() == first
    llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "nats2.example.com")
    assert server.read_bytes() != first


def test_nats_config_renews_a_server_certificate_about_to_expire(ca_dir: Path) -> None:
    server = ca_dir / "nats" / "server.pem"
    llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "nats1.example.com", "--days", "10")
    first = cert_at(server)
    renewed = llmgw_pki("nats-config", "--dir", ca_dir)
    assert f"renewed {server} for nats1.example.com" in renewed.output
    assert cert_at(server).not_valid_after_utc > first.not_valid_after_utc


def test_nats_config_names_client_certificates_about_to_expire(ca_dir: Path) -> None:
    llmgw_pki("issue", "--router", "r1", "--dir", ca_dir, "--days", "10")
    warned = llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "localhost")
    assert f"warning: {ca_dir / 'r1.pem'} (router r1) expires on" in warned.stderr
    assert "llmgw pki issue --router r1 --force" in warned.stderr


def test_nats_config_with_out_in_the_directory_leaves_its_server_certificate_out(
    ca_dir: Path,
) -> None:
    llmgw_pki("issue", "node05", "--dir", ca_dir)
    for _ in range(2):  # the second run finds server.pem among the clients' certificates
        llmgw_pki("nats-config", "--dir", ca_dir, "--out", ca_dir, "--server-name", "localhost")
    users = (ca_dir / "llmgw-users.conf").read_text()
    assert users.count("{ user:") == 1 and "CN=node05,OU=node,O=Example" in users


def test_nats_config_without_a_server_certificate_asks_for_its_names(ca_dir: Path) -> None:
    refused = llmgw_pki("nats-config", "--dir", ca_dir, ok=False)
    assert f"{ca_dir / 'nats' / 'server.pem'} does not exist: pass --server-name" in (
        refused.output
    )
    assert not (ca_dir / "nats" / "llmgw-users.conf").exists()


def test_nats_config_refuses_a_certificate_of_another_ca_naming_the_file(
    ca_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    llmgw_pki("init", "--dir", other)
    llmgw_pki("issue", "node09", "--dir", other)
    (ca_dir / "node09.pem").write_bytes((other / "node09.pem").read_bytes())
    refused = llmgw_pki("nats-config", "--dir", ca_dir, "--server-name", "localhost", ok=False)
    assert f"{ca_dir / 'node09.pem'} was not issued by this CA" in refused.output


# --- docs/security.md as written, against a real nats-server ---------------------------------


@dataclass(frozen=True)
class Documented:
    setup: list[str]  # the `llmgw pki` commands of steps 1-3
    server_conf: str  # step 4's tls {} block and include
    join: list[str]  # "A node joins"
    leave: list[str]  # "A node leaves"


def _commands(block: str) -> list[str]:
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def documented() -> Documented:
    text = DOCS.read_text()
    setup_start = text.index("## Setting it up")
    join_start = text.index("### A node joins", setup_start)
    leave_start = text.index("### A node leaves", join_start)

    def blocks(start: int, end: int) -> list[str]:
        fenced = re.compile(r"^( *)```\n(.*?)^\1```", re.S | re.M)
        return [m.group(2) for m in fenced.finditer(text, start, end)]

    setup = blocks(setup_start, join_start)
    commands = [c for b in setup for c in _commands(b) if c.startswith("llmgw pki ")]
    tls = [b for b in setup if "verify_and_map" in b]
    assert commands and len(tls) == 1, "docs/security.md lost its setup steps"
    return Documented(
        commands,
        re.sub(r"^ {3}", "", tls[0], flags=re.M),
        _commands(blocks(join_start, leave_start)[0]),
        _commands(blocks(leave_start, len(text))[0]),
    )


@dataclass
class Fleet:
    """What the documented steps made: the CA's directory, /etc/nats, the running server."""

    pki: Path
    etc: Path
    url: str
    proc: subprocess.Popen[bytes]
    server_name: str  # a --server-name of step 3, to check the server's certificate against
    http_port: int = 0

    def settings(self, who: str, pki_dir: Path | None = None) -> NatsSettings:
        d = pki_dir or self.pki
        return NatsSettings(
            urls=(self.url,),
            tls_ca=str(self.pki / "ca.pem"),
            tls_cert=str(d / f"{who}.pem"),
            tls_key=str(d / f"{who}-key.pem"),
            tls_hostname=self.server_name,
            inbox_prefix=f"_INBOX.{who}" if who.startswith("node") else None,
            name=f"test {who}",
            connect_timeout=0.5,
            healthy_after=1.0,
        )

    async def connected_users(self) -> list[str]:
        """The users of the server's connections, from its monitoring port."""

        def connz() -> bytes:
            url = f"http://127.0.0.1:{self.http_port}/connz?auth=true"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.read()

        conns = json.loads(await anyio.to_thread.run_sync(connz))["connections"] or []
        return [c.get("authorized_user", "") for c in conns]

    async def connect(self, who: str) -> Bus:
        return await Bus.connect(self.settings(who), give_up_after=5)

    async def refused(self, who: str, pki_dir: Path | None = None) -> BusError:
        with anyio.fail_after(15), pytest.raises(BusError) as refused:
            await Bus.connect(self.settings(who, pki_dir), give_up_after=0.5)
        return refused.value

    def perform(self, command: str) -> None:
        """One documented command, with /etc/nats in the test's directory."""
        words = [w.replace(ETC, str(self.etc)) for w in shlex.split(command)]
        if words[:2] == ["llmgw", "pki"]:
            llmgw_pki(*words[2:])
        elif words[0] == "rm":
            for name in words[1:]:
                Path(name).unlink()
        elif words == ["nats-server", "--signal", "reload"]:
            # this server, not every nats-server on the machine
            signal = [str(find_nats_server()), "--signal", f"reload={self.proc.pid}"]
            subprocess.run(signal, check=True, timeout=30, capture_output=True)
        else:
            raise AssertionError(f"docs/security.md has a step this test cannot run: {command}")


@contextmanager
def documented_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    """Steps 1-4 of docs/security.md as written, in tmp_path, and nats-server started on
    the configuration they describe."""
    docs = documented()
    monkeypatch.chdir(tmp_path)  # the docs' commands use ./llmgw-pki
    etc = tmp_path / "etc-nats"
    etc.mkdir()
    names = [w for c in docs.setup for w in re.findall(r"--server-name (\S+)", c)]
    fleet = Fleet(tmp_path / "llmgw-pki", etc, "", None, names[0])  # type: ignore[arg-type]
    for command in docs.setup:
        fleet.perform(command)
    # nats/mtls.conf with step 4 applied: the documented tls {} and include for its own
    mtls = (ROOT / "nats" / "mtls.conf").read_text()
    conf = re.sub(
        r"^tls \{.*?^\}\n",
        lambda _: docs.server_conf.replace(ETC, str(etc)),
        mtls,
        flags=re.S | re.M,
    )
    conf = re.sub(r"# BEGIN generated.*# END generated\n", "", conf, flags=re.S)
    conf = re.sub(r'store_dir: "[^"]*"', f'store_dir: "{tmp_path / "js"}"', conf)
    assert '"example-certs/' not in conf and 'include "llmgw-users.conf"' in conf
    (etc / "nats-server.conf").write_text(conf)
    server = str(find_nats_server())
    checked = subprocess.run(
        [server, "-t", "-c", str(etc / "nats-server.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",  # not the config's directory: what the docs say must hold from anywhere
    )
    assert checked.returncode == 0, checked.stderr + checked.stdout
    port, http_port = free_port(), free_port()
    log = tmp_path / "nats-server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [server, "-c", str(etc / "nats-server.conf"), "-a", "127.0.0.1", "-p", str(port)]
            + ["-m", str(http_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd="/",
        )
    try:
        wait_healthy(proc, http_port, log)
        fleet.url, fleet.proc, fleet.http_port = f"nats://127.0.0.1:{port}", proc, http_port
        yield fleet
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def refused_write(bus: Bus, key: str) -> None:
    """`bus` puts `key` and the server refuses it: the denial reaches the client, naming
    the subject (Connection.denied)."""
    subject = f"$kv.llmgw.{key}"

    async def reported() -> bool:
        d = bus.connection.denied
        return d is not None and (d.action, d.subject) == ("publish", subject)

    async with anyio.create_task_group() as tg:
        # the server drops a forbidden put, so it never completes: cancelled once reported
        tg.start_soon(bus.put, key, b"{}")
        await until(reported)
        tg.cancel_scope.cancel()


async def test_the_documented_setup_lets_each_identity_write_only_its_own_keys(
    tmp_path, monkeypatch
) -> None:
    with documented_fleet(tmp_path, monkeypatch) as fleet:
        operator = await fleet.connect("alice")  # creates the bucket
        node05 = await fleet.connect("node05")
        controller = await fleet.connect("controller")
        router = await fleet.connect("router")
        try:
            for key in ("nodes.node05", "leases.node05", "shards.node05.r1"):
                rev = await node05.put(key, b"{}")
                assert await operator.get_raw(key) == (b"{}", rev)
            for key in ("assign.node05.r1", "replicas.m1.r1", "leader"):
                rev = await controller.put(key, b"{}")
                assert await router.get_raw(key) == (b"{}", rev)
            await refused_write(node05, "nodes.node06")
            await refused_write(node05, "assign.node05.r1")
            await refused_write(controller, "nodes.node05")
            await refused_write(router, "catalog.m1")
            assert await operator.get_raw("nodes.node06") is None
            await operator.put("catalog.m1", b"{}")  # the operator may do anything
        finally:
            for bus in (router, controller, node05, operator):
                await bus.close()


async def test_a_certificate_of_another_ca_is_refused(tmp_path, monkeypatch) -> None:
    with documented_fleet(tmp_path, monkeypatch) as fleet:
        rogue = tmp_path / "rogue"
        llmgw_pki("init", "--dir", rogue, "--org", "Example")
        llmgw_pki("issue", "node05", "--dir", rogue)  # the very subject node05's has
        assert "unknown ca" in str(await fleet.refused("node05", rogue))
        # while its own CA's certificate of the same subject is let in
        operator = await fleet.connect("alice")  # creates the bucket
        try:
            await (await fleet.connect("node05")).close()
        finally:
            await operator.close()


async def test_a_node_joins_with_the_documented_commands_and_a_reload(
    tmp_path, monkeypatch
) -> None:
    docs = documented()
    with documented_fleet(tmp_path, monkeypatch) as fleet:
        operator = await fleet.connect("alice")
        node05 = await fleet.connect("node05")
        try:
            fleet.perform(docs.join[0])  # llmgw pki issue node07
            assert "Authorization Violation" in str(await fleet.refused("node07"))
            for command in docs.join[1:]:
                fleet.perform(command)

            async def joined() -> Bus | None:
                try:
                    return await Bus.connect(fleet.settings("node07"), give_up_after=0.5)
                except BusError:
                    return None  # the reload is not done yet

            node07 = await until(joined)
            try:
                rev = await node07.put("nodes.node07", b"{}")
                assert await operator.get_raw("nodes.node07") == (b"{}", rev)
            finally:
                await node07.close()
            # the reload kept node05's connection
            await node05.put("nodes.node05", b"{}")
            assert node05.nc.stats["reconnects"] == 0
        finally:
            await node05.close()
            await operator.close()


async def test_a_node_leaves_with_the_documented_commands_and_a_reload(
    tmp_path, monkeypatch
) -> None:
    docs = documented()
    node07_user = "CN=node07,OU=node,O=Example"
    with documented_fleet(tmp_path, monkeypatch) as fleet:
        operator = await fleet.connect("alice")  # creates the bucket
        for command in docs.join:
            fleet.perform(command)
        node07 = await fleet.connect("node07")
        try:
            assert node07_user in await fleet.connected_users()
            # the docs remove the node's files; the test keeps a copy to try them with
            kept = tmp_path / "kept"
            kept.mkdir()
            for name in ("node07.pem", "node07-key.pem"):
                (kept / name).write_bytes((fleet.pki / name).read_bytes())
            for command in docs.leave:
                fleet.perform(command)

            async def refused() -> BusError | None:
                try:
                    bus = await Bus.connect(fleet.settings("node07", kept), give_up_after=0.5)
                except BusError as e:
                    return e
                await bus.close()
                return None  # the reload is not done yet

            assert "Authorization Violation" in str(await until(refused))

            async def cut_off() -> bool:
                return node07_user not in await fleet.connected_users()

            await until(cut_off)  # the reload closed the node07 still connected
            assert "CN=alice,OU=operator,O=Example" in await fleet.connected_users()
        finally:
            await node07.close()
            await operator.close()
