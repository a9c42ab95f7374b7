"""The agent's TLS files, checked before connecting: each one exists, is PEM, and the
certificate names this node.

A certificate naming another node is refused here, because otherwise it shows up only as
permission refusals on keys the agent thought were its own, and under systemd as a crash
loop. A missing or non-PEM file is refused naming the file, instead of an SSL error from
deep inside the connect.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.agent.files import NotRegularFile, TooLarge, read_bounded
from llmgw.errors import LlmgwError

# a CA bundle of every public root is ~200 KB
_PEM_LIMIT = 1 << 20


class CertificateError(LlmgwError):
    """A TLS file of the agent's config that cannot work; the message names it and the fix."""


def _read_pem(path: str, key: str, label: str, config_path: str) -> bytes:
    """The file's bytes, when it is a PEM file holding a block whose label contains `label`."""
    where = f"{path} ({key} in {config_path})"
    try:
        data = read_bounded(path, _PEM_LIMIT)
    except FileNotFoundError:
        raise CertificateError(f"{where} does not exist; fix {key} or install the file") from None
    except PermissionError:
        raise CertificateError(
            f"{where} cannot be read by the agent's user; fix its owner or mode"
        ) from None
    except NotRegularFile as e:
        raise CertificateError(f"{where} {e.strerror}; point {key} at the PEM file") from None
    except TooLarge:
        raise CertificateError(
            f"{where} is larger than {_PEM_LIMIT} bytes, too large for a PEM file; "
            f"point {key} at the PEM file"
        ) from None
    except OSError as e:
        raise CertificateError(f"{where} cannot be read: {e.strerror or e}") from None
    labels = [
        stripped[len(b"-----BEGIN ") : -len(b"-----")].decode(errors="replace")
        for stripped in (line.strip() for line in data.splitlines())
        if stripped.startswith(b"-----BEGIN ") and stripped.endswith(b"-----")
    ]
    if not any(label in found for found in labels):
        holds = f"it holds {', '.join(labels)}" if labels else "no '-----BEGIN' line"
        tool = "x509" if label == "CERTIFICATE" else "pkey"
        raise CertificateError(
            f"{where} is not a PEM file holding a {label.lower()} ({holds}); give it in PEM "
            f"form (a DER file converts with `openssl {tool} -inform der -in FILE`)"
        )
    return data


def check_tls_files(
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    node_id: str,
    id_source: str,
    config_path: str,
) -> None:
    """Raise CertificateError unless every TLS file given can be used by this node: the CA
    file and the certificate hold PEM certificates, the key a PEM private key, the key is
    given with the certificate, and the certificate's CN is the node id (a certificate
    without a CN is mapped by its SAN on the server, so it passes)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    if tls_ca:
        _read_pem(tls_ca, "nats.tls_ca", "CERTIFICATE", config_path)
    if tls_key:
        _read_pem(tls_key, "nats.tls_key", "PRIVATE KEY", config_path)
    if not tls_cert:
        if tls_key:
            raise CertificateError(
                f"nats.tls_key is set without nats.tls_cert in {config_path}; set both"
            )
        return
    if not tls_key:
        raise CertificateError(
            f"nats.tls_cert is set without nats.tls_key in {config_path}; set both"
        )
    data = _read_pem(tls_cert, "nats.tls_cert", "CERTIFICATE", config_path)
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise CertificateError(
            f"{tls_cert} (nats.tls_cert in {config_path}) is not a usable certificate ({e}); "
            "reissue it"
        ) from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        return
    cn = str(names[0].value)
    if cn != node_id:
        raise CertificateError(
            f"certificate CN={cn} ({Path(tls_cert)}) does not match node id {node_id} "
            f"(from {id_source}); set node.id in {config_path} or reissue the certificate"
        )
