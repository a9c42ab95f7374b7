"""`llmgw pki`: a fleet's CA, its certificates and nats-server's users, kept in one directory.

    llmgw pki init                      # DIR/ca.pem, DIR/ca-key.pem
    llmgw pki issue node07              # DIR/node07.pem, DIR/node07-key.pem
    llmgw pki nats-config --server-name nats1.example.com   # DIR/nats/: users, server cert

The directory is the list of identities: `nats-config` gives a user to every client
certificate in it, so removing a node's files and running it again takes the node out.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from cryptography import x509

from llmgw import pki as certs
from llmgw.agent.files import NotRegularFile, TooLarge, read_bounded
from llmgw.bus import keys
from llmgw.bus.permissions import ROLES, Role, User, render_users
from llmgw.cli.common import StatedErrors

DEFAULT_DIR = "llmgw-pki"
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
NATS_SUBDIR = "nats"
USERS_FILE = "llmgw-users.conf"
SERVER_CERT, SERVER_KEY = "server.pem", "server-key.pem"
# a certificate is about 1 KB; nothing in the directory is read past this
_PEM_LIMIT = 64 << 10
# more identities than any fleet has: a directory past this is not a CA's
_MAX_CERTS = 100_000
# certificates expiring sooner are named on every nats-config, and a server's is renewed
RENEW_BEFORE = dt.timedelta(days=30)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _read(path: Path, fix: str) -> bytes:
    try:
        return read_bounded(path, _PEM_LIMIT)
    except FileNotFoundError:
        raise certs.PkiError(f"{path} does not exist; {fix}") from None
    except PermissionError:
        raise certs.PkiError(f"{path} cannot be read by this user; fix its owner or mode") from None
    except NotRegularFile as e:
        raise certs.PkiError(f"{path} {e.strerror}; {fix}") from None
    except TooLarge:
        raise certs.PkiError(
            f"{path} is larger than {_PEM_LIMIT} bytes, too large for a certificate; remove it"
        ) from None
    except OSError as e:
        raise certs.PkiError(f"{path} cannot be read: {e.strerror or e}") from None


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write `path` whole or not at all: a reloading nats-server never reads half a users
    file, and a key is never readable by others, not even for a moment."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise certs.PkiError(
            f"cannot write {path}: {e.strerror or e}; run as a user who may write "
            f"{path.parent}, or choose another directory"
        ) from None


def _mkdir(path: Path, mode: int) -> None:
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as e:
        raise certs.PkiError(
            f"cannot create {path}: {e.strerror or e}; choose another directory"
        ) from None


def _no_ca(d: Path) -> str:
    return f"make the CA with `llmgw pki init --dir {d}`, or pass --dir (or LLMGW_PKI_DIR)"


def _load_ca(d: Path) -> certs.KeyPair:
    cert_path, key_path = d / CA_CERT, d / CA_KEY
    return certs.load_ca(
        _read(cert_path, _no_ca(d)), _read(key_path, _no_ca(d)), str(cert_path), str(key_path)
    )


def _valid_until(cert: x509.Certificate) -> str:
    return f"{cert.not_valid_after_utc:%Y-%m-%d}"


def _dir_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--dir",
        "pki_dir",
        envvar="LLMGW_PKI_DIR",
        show_envvar=True,
        type=click.Path(file_okay=False, path_type=Path),
        default=DEFAULT_DIR,
        show_default=True,
        help="the directory holding the CA and every certificate it issued",
    )(fn)


@click.group("pki", cls=StatedErrors)  # the same messages when run by itself
def pki() -> None:
    """A fleet's certificates: a CA, one per node, controller, router and operator, and the
    NATS server's users (docs/security.md)."""


@pki.command("init")
@_dir_option
@click.option(
    "--org",
    default="llmgw",
    show_default=True,
    help="organization (O) in every certificate's subject",
)
@click.option("--days", type=click.IntRange(min=1), default=certs.CA_DAYS, show_default=True)
@click.option(
    "--force",
    is_flag=True,
    help="replace an existing CA: no certificate it issued is trusted after that",
)
def init(pki_dir: Path, org: str, days: int, force: bool) -> None:
    """Make the CA: DIR/ca.pem (give it to every node) and DIR/ca-key.pem (keep it here)."""
    cert_path, key_path = pki_dir / CA_CERT, pki_dir / CA_KEY
    for path in (key_path, cert_path):
        if path.exists() and not force:
            raise certs.PkiError(
                f"{path} exists: a new CA would make every certificate this one issued "
                "untrusted; pass --force to replace it, or --dir for another directory"
            )
    ca = certs.make_ca(org, _now(), days)
    _mkdir(pki_dir, 0o700)  # only its owner lists who holds certificates
    _write(key_path, ca.key_pem(), 0o600)
    _write(cert_path, ca.cert_pem(), 0o644)
    click.echo(f"made CA {ca.cert.subject.rfc4514_string()}, valid until {_valid_until(ca.cert)}:")
    click.echo(f"  {cert_path}      the CA certificate: nodes, routers and nats-server get a copy")
    click.echo(f"  {key_path}  its key (mode 600): stays here; it signs every certificate")
    click.echo("next: llmgw pki issue NODE_ID (or --controller/--router/--operator NAME)")


def _identity(
    node: str | None, controller: str | None, router: str | None, operator: str | None
) -> tuple[Role, str]:
    given: list[tuple[Role, str | None]] = [
        ("node", node),
        ("controller", controller),
        ("router", router),
        ("operator", operator),
    ]
    chosen = [(role, name) for role, name in given if name is not None]
    if len(chosen) != 1:
        raise click.UsageError(
            "give one identity: a node id (llmgw pki issue node05), or --controller NAME, "
            "--router NAME or --operator NAME"
        )
    role, name = chosen[0]
    assert name is not None
    return role, certs.check_name(name, role)


@pki.command("issue")
@click.argument("node", required=False)
@click.option("--controller", metavar="NAME", help="a controller's certificate (CN=NAME)")
@click.option("--router", metavar="NAME", help="a router's certificate (CN=NAME)")
@click.option("--operator", metavar="NAME", help="a person's certificate: may do anything")
@_dir_option
@click.option("--days", type=click.IntRange(min=1), default=certs.LEAF_DAYS, show_default=True)
@click.option("--force", is_flag=True, help="replace this identity's certificate and key")
def issue(
    node: str | None,
    controller: str | None,
    router: str | None,
    operator: str | None,
    pki_dir: Path,
    days: int,
    force: bool,
) -> None:
    """Issue the certificate of a node (its CN is the node id) or of a controller, router or
    operator: DIR/NAME.pem and DIR/NAME-key.pem."""
    role, name = _identity(node, controller, router, operator)
    if name == Path(CA_CERT).stem:
        raise certs.PkiError(
            f"{name}.pem is the CA's file in {pki_dir}; give this identity another name"
        )
    cert_path, key_path = pki_dir / f"{name}.pem", pki_dir / f"{name}-key.pem"
    ca = _load_ca(pki_dir)
    for path in (cert_path, key_path):
        if path.exists() and not force:
            raise certs.PkiError(
                f"{path} exists: names are unique in {pki_dir}; pick another name, or pass "
                "--force to replace it (to revoke the old one: docs/security.md)"
            )
    issued = certs.issue_client(ca, role, name, _now(), days)
    _write(key_path, issued.key_pem(), 0o600)
    _write(cert_path, issued.cert_pem(), 0o644)
    click.echo(
        f"issued {role} {name}: {issued.cert.subject.rfc4514_string()}, "
        f"valid until {_valid_until(issued.cert)}"
    )
    click.echo(f"  {cert_path}")
    click.echo(f"  {key_path}  (mode 600)")
    click.echo(f"next: copy them and {pki_dir / CA_CERT} to {name}; let it in with")
    click.echo("  llmgw pki nats-config, then nats-server --signal reload")


def _client_certs(pki_dir: Path, skip: set[Path]) -> list[Path]:
    found = []
    for path in sorted(pki_dir.glob("*.pem")):
        if path.name == CA_CERT or path.name.endswith("-key.pem") or path.resolve() in skip:
            continue
        found.append(path)
        if len(found) > _MAX_CERTS:
            raise certs.PkiError(
                f"{pki_dir} holds more than {_MAX_CERTS} certificates; is --dir the CA's?"
            )
    return found


def _users(pki_dir: Path, ca: x509.Certificate, skip: set[Path]) -> list[User]:
    """Every client certificate in the directory as a user, controllers first and nodes
    last; PkiError naming a file that is not one of this CA's, or two files of one user."""
    users: dict[str, tuple[User, Path]] = {}
    soon = _now() + RENEW_BEFORE
    for path in _client_certs(pki_dir, skip):
        cert = certs.load_cert(_read(path, "remove it"), str(path))
        user = certs.user_of(cert, ca, str(path))
        if user.subject in users:
            raise certs.PkiError(
                f"{users[user.subject][1]} and {path} are both {user.subject}; remove the one "
                "that is not in use"
            )
        users[user.subject] = (user, path)
        if cert.not_valid_after_utc < soon:
            flag = f"--{user.role} " if user.role != "node" else ""
            click.echo(
                f"warning: {path} ({user.role} {user.name}) expires on {_valid_until(cert)}; "
                f"reissue it with `llmgw pki issue {flag}{user.name} --force`",
                err=True,
            )
    order = {role: i for i, role in enumerate(ROLES)}
    return sorted((u for u, _ in users.values()), key=lambda u: (order[u.role], u.name))


def _server_cert(
    pki_dir: Path, ca_cert: x509.Certificate, out: Path, names: tuple[str, ...], days: int
) -> tuple[x509.Certificate, str]:
    """The server certificate in `out`: kept when it is this CA's, has the names asked for
    and is not about to expire; issued otherwise. Returns it and what was done."""
    path = out / SERVER_CERT
    current = None
    if path.exists():
        current = certs.load_cert(_read(path, "remove it"), str(path))
        if not certs.issued_by(current, ca_cert):
            if not names:
                raise certs.PkiError(
                    f"{path} was not issued by the CA in {pki_dir}; pass --server-name for "
                    "each name clients connect to, to issue one"
                )
            current = None
    wanted = set(certs.server_names(names)) if names else None
    if current is not None and (wanted is None or wanted == set(certs.sans_of(current))):
        if current.not_valid_after_utc > _now() + RENEW_BEFORE:
            return current, "kept"
        names = tuple(str(san.value) for san in certs.sans_of(current))  # renewed as it was
        done = "renewed"
    else:
        done = "issued"
    if not names:
        raise certs.PkiError(
            f"{path} does not exist: pass --server-name for each DNS name and IP address "
            "clients put in their nats:// URLs (repeat it)"
        )
    issued = certs.issue_server(_load_ca(pki_dir), names, _now(), days)
    _write(out / SERVER_KEY, issued.key_pem(), 0o600)
    _write(path, issued.cert_pem(), 0o644)
    return issued.cert, done


@pki.command("nats-config")
@_dir_option
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="where nats-server's files go [default: DIR/nats]",
)
@click.option(
    "--server-name",
    "server_names",
    multiple=True,
    metavar="NAME",
    help="a DNS name or IP address clients connect to (repeat); issues the server "
    "certificate when it is missing or names others",
)
@click.option(
    "--bucket",
    envvar="LLMGW_BUCKET",
    default=keys.DEFAULT_BUCKET,
    show_default=True,
    help="the KV bucket the permissions are for",
)
@click.option(
    "--days",
    type=click.IntRange(min=1),
    default=certs.LEAF_DAYS,
    show_default=True,
    help="lifetime of a server certificate issued now",
)
def nats_config(
    pki_dir: Path, out: Path | None, server_names: tuple[str, ...], bucket: str, days: int
) -> None:
    """Write nats-server's files: OUT/llmgw-users.conf (a user with its permissions for every
    certificate in DIR), OUT/server.pem and server-key.pem, OUT/ca.pem."""
    out = out if out is not None else pki_dir / NATS_SUBDIR
    keys.check_token(bucket, "bucket")
    ca_pem = _read(pki_dir / CA_CERT, _no_ca(pki_dir))
    ca = certs.load_cert(ca_pem, str(pki_dir / CA_CERT))
    # with --out DIR the server's certificate sits among the clients' and is none of them
    users = _users(pki_dir, ca, {(out / SERVER_CERT).resolve()})
    _mkdir(out, 0o755)
    server, done = _server_cert(pki_dir, ca, out, server_names, days)
    _write(out / CA_CERT, ca_pem, 0o644)
    users_path = out / USERS_FILE
    _write(
        users_path,
        render_users(users, bucket, generated_by="llmgw pki nats-config").encode(),
        0o644,
    )
    counts = ", ".join(f"{role} {sum(u.role == role for u in users)}" for role in ROLES)
    click.echo(f"wrote {users_path}: {len(users)} users ({counts})")
    names = ", ".join(str(san.value) for san in certs.sans_of(server))
    click.echo(
        f"{done} {out / SERVER_CERT} for {names}, valid until {_valid_until(server)}; "
        f"{out / SERVER_KEY} (mode 600); {out / CA_CERT}"
    )
    click.echo(
        f'next: `include "{USERS_FILE}"` in nats-server.conf beside it (once), then '
        "nats-server --signal reload"
    )
