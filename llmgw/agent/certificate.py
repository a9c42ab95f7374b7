"""Does the TLS certificate name this node? Checked before connecting, because a mismatch
otherwise shows up only as permission refusals on keys the agent thought were its own."""

from __future__ import annotations

from pathlib import Path


def certificate_mismatch(
    cert_path: str, node_id: str, id_source: str, config_path: str
) -> str | None:
    """The error to log when the certificate's CN is not the node id; None when it is (or the
    certificate has no CN: then the server maps it by its SAN)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    except (OSError, ValueError) as e:
        return f"cannot read certificate {cert_path}: {e}; fix nats.tls_cert in {config_path}"
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        return None
    cn = str(names[0].value)
    if cn == node_id:
        return None
    return (
        f"certificate CN={cn} ({cert_path}) does not match node id {node_id} (from {id_source}); "
        f"set node.id in {config_path} or reissue the certificate"
    )
