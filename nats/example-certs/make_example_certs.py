"""Regenerate the EXAMPLE certificates of nats/mtls.conf, with llmgw.pki.

    cd nats/example-certs && python make_example_certs.py

Their private keys are public (they are in git): for trying mtls.conf on one machine and for
`nats-server -t`, never for a real fleet. docs/security.md says how to issue real ones
(`llmgw pki`).
"""

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import pki

HERE = Path(__file__).parent
ORG = "llmgw-example"
CLIENTS = ("operator", "controller", "router", "node05", "node06")


def write(name: str, pair: pki.KeyPair) -> None:
    (HERE / f"{name}.pem").write_bytes(pair.cert_pem())
    (HERE / f"{name}-key.pem").write_bytes(pair.key_pem())


def main() -> None:
    now = dt.datetime.now(dt.UTC)
    # examples must not expire under the tests that load them
    days = (dt.datetime(3000, 1, 1, tzinfo=dt.UTC) - now).days
    ca = pki.make_ca(ORG, now, days)
    (HERE / "ca.pem").write_bytes(ca.cert_pem())
    write("server", pki.issue_server(ca, ["localhost", "127.0.0.1"], now, days))
    for name in CLIENTS:
        # OU=fleet for every role, not `llmgw pki issue`'s OU=<role>: the users of mtls.conf
        # share the one shape `python -m llmgw.bus.permissions --subject` renders
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "fleet"),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]
        )
        write(name, pki.issue_leaf(ca, subject, [ExtendedKeyUsageOID.CLIENT_AUTH], now, days))


if __name__ == "__main__":
    main()
