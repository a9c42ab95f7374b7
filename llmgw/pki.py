"""A fleet's certificates: a CA, one client certificate per identity, the NATS server's.

Pure: keys and certificates in, certificates and PEM bytes out; where they are kept is
llmgw/cli/pki.py's. A client certificate's subject says who it is, `CN=<name>,OU=<role>,
O=<the CA's organization>`: nats-server maps the whole subject to a user
(`verify_and_map`), so a controller and a node of the same name are two users, and the CN
of a node is its node id, which the agent checks (llmgw/agent/certificate.py).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.bus import keys
from llmgw.bus.permissions import ROLES, Role, User
from llmgw.errors import LlmgwError

CA_DAYS = 3650  # the CA outlives every certificate it issues; replacing it means reissuing all
LEAF_DAYS = 730  # a node's certificate is rotated every two years, or when it leaks
# another host's clock may be a little behind the one that issued a certificate
_BACKDATE = dt.timedelta(minutes=5)
# X.520's upper bound for CN and O; cryptography refuses longer ones
_NAME_LIMIT = 64
# an organization becomes part of every user's DN: nothing that RFC 4514 would escape
_ORG = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9 ._-]*[A-Za-z0-9._-])?")
SERVER_OU = "server"


class PkiError(LlmgwError):
    """A certificate or CA that cannot be used as asked; the message names it and the fix."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        # unencrypted: llmgw cannot ask for a passphrase; the file mode protects it
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def check_org(org: str) -> str:
    if len(org) > _NAME_LIMIT or not _ORG.fullmatch(org):
        raise PkiError(
            f"organization {org!r} cannot name a CA: use at most {_NAME_LIMIT} letters, digits, "
            "spaces, '.', '-' and '_', starting with a letter or digit"
        )
    return org


def check_name(name: str, role: Role) -> str:
    """`name` when it can be the CN of a `role` certificate: one NATS token (a node's is its
    node id, a subject token) of at most 64 characters."""
    what = "node id" if role == "node" else f"{role} name"
    keys.check_token(name, what)
    if len(name) > _NAME_LIMIT:
        raise PkiError(
            f"{what} {name!r} is longer than {_NAME_LIMIT} characters; pick a shorter one"
        )
    return name


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: small, fast, and understood by Go (nats-server), OpenSSL and every nats client
    return ec.generate_private_key(ec.SECP256R1())


def _org_of(ca: x509.Certificate) -> str:
    orgs = ca.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    return str(orgs[0].value) if orgs else "llmgw"


def make_ca(org: str, now: dt.datetime, days: int = CA_DAYS) -> KeyPair:
    """A self-signed CA that may sign leaf certificates only (no intermediates)."""
    check_org(org)
    key = _new_key()
    # a random suffix keeps two fleets' CAs apart in a trust store and in error messages
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, org),
            x509.NameAttribute(NameOID.COMMON_NAME, f"llmgw CA {secrets.token_hex(4)}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def issue_leaf(
    ca: KeyPair,
    subject: x509.Name,
    usages: Sequence[x509.ObjectIdentifier],
    now: dt.datetime,
    days: int,
    sans: Sequence[x509.GeneralName] = (),
) -> KeyPair:
    """A certificate for `subject`, signed by `ca`, with the extended key `usages`."""
    if days < 1:
        raise PkiError(f"a certificate must be valid for at least 1 day, not {days}")
    key = _new_key()
    # a certificate that outlives its CA would fail on the CA's last day anyway
    not_after = min(now + dt.timedelta(days=days), ca.cert.not_valid_after_utc)
    if not_after <= now:
        raise PkiError(
            f"the CA expired on {ca.cert.not_valid_after_utc:%Y-%m-%d}; make a new one with "
            "`llmgw pki init --force` and reissue every certificate"
        )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return KeyPair(builder.sign(ca.key, hashes.SHA256()), key)


def client_subject(role: Role, name: str, org: str) -> x509.Name:
    """`CN=<name>,OU=<role>,O=<org>`: the role in the subject keeps identities of the same
    name apart, and tells `nats-config` which permissions the user gets."""
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, org),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )


def issue_client(
    ca: KeyPair, role: Role, name: str, now: dt.datetime, days: int = LEAF_DAYS
) -> KeyPair:
    """A certificate `role` `name` connects to NATS with: clientAuth only, and no SAN, so that
    nats-server maps it by its subject (a SAN equal to a user name would be matched first)."""
    if role not in ROLES:
        raise PkiError(f"role {role!r} is none of {', '.join(ROLES)}")
    check_name(name, role)
    subject = client_subject(role, name, _org_of(ca.cert))
    return issue_leaf(ca, subject, [ExtendedKeyUsageOID.CLIENT_AUTH], now, days)


def server_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """The SANs for the names clients use in their URLs: an IP address or a DNS name each."""
    if not names:
        raise PkiError(
            "a server certificate needs the names clients connect to: give --server-name "
            "for each DNS name and IP address in their nats:// URLs"
        )
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            continue
        except ValueError:
            pass
        labels = name.rstrip(".").split(".")
        if len(name) > 253 or not all(
            re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?|\*", label)
            for label in labels
        ):
            raise PkiError(
                f"server name {name!r} is neither an IP address nor a DNS name; give the "
                "host name clients put in their nats:// URLs"
            )
        sans.append(x509.DNSName(name.rstrip(".").lower()))
    return sans


def issue_server(
    ca: KeyPair, names: Sequence[str], now: dt.datetime, days: int = LEAF_DAYS
) -> KeyPair:
    """The NATS server's certificate, with every name in `names` as a SAN (clients check the
    host of their URL against them). serverAuth for clients; clientAuth too, because a
    cluster's servers present it to each other on their routes."""
    sans = server_names(names)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _org_of(ca.cert)),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, SERVER_OU),
            x509.NameAttribute(NameOID.COMMON_NAME, names[0][:_NAME_LIMIT]),
        ]
    )
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return issue_leaf(ca, subject, usages, now, days, sans)


def sans_of(cert: x509.Certificate) -> list[x509.GeneralName]:
    """The names a certificate is valid for (DNS names, IP addresses), in its order."""
    try:
        return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return []


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def user_of(cert: x509.Certificate, ca: x509.Certificate, source: str) -> User:
    """The nats-server user a client certificate issued by `ca` maps to; PkiError naming
    `source` (its file) when it is not one: another CA's, a server's, a role unknown."""
    if not issued_by(cert, ca):
        raise PkiError(
            f"{source} was not issued by this CA ({ca.subject.rfc4514_string()}); "
            "remove it, or reissue it with `llmgw pki issue`"
        )
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    role = str(ous[0].value) if len(ous) == 1 else ""
    if role not in ROLES or len(cns) != 1:
        raise PkiError(
            f"{source} ({cert.subject.rfc4514_string()}) is not a client certificate of "
            f"`llmgw pki issue` (OU must be one of {', '.join(ROLES)}); remove it"
        )
    name = str(cns[0].value)
    try:
        check_name(name, role)  # type: ignore[arg-type]
    except LlmgwError as e:
        raise PkiError(f"{source}: {e}; remove it") from None
    # nats-server writes the subject most specific first, as RFC 4514 does
    return User(role, name, cert.subject.rfc4514_string())  # type: ignore[arg-type]


def common_name(path: str) -> str | None:
    """The CN of the certificate in the PEM file `path` (None: it has none, and is mapped by
    its SAN); PkiError when the file is no certificate."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PkiError(f"cannot read the certificate {path}: {e}") from None
    cns = load_cert(data, path).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else None


def load_cert(data: bytes, source: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise PkiError(f"{source} is not a PEM certificate ({e}); remove or replace it") from None


def load_key(data: bytes, source: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise PkiError(
            f"{source} is not an unencrypted PEM private key ({e}); restore the CA's key "
            "from your backup"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{source} is a {type(key).__name__}, not the EC key `llmgw pki init` makes")
    return key


def load_ca(cert_pem: bytes, key_pem: bytes, cert_source: str, key_source: str) -> KeyPair:
    """The CA from its files, when the key is the certificate's."""
    cert = load_cert(cert_pem, cert_source)
    key = load_key(key_pem, key_source)
    if key.public_key() != cert.public_key():
        raise PkiError(
            f"{key_source} is not the key of {cert_source}; put the CA's own key beside it"
        )
    return KeyPair(cert, key)
