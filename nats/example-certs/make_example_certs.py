"""Regenerate the EXAMPLE certificates of nats/mtls.conf (needs `pip install trustme`).

    cd nats/example-certs && python make_example_certs.py

Their private keys are public (they are in git): for trying mtls.conf on one machine and for
`nats-server -t`, never for a real fleet. docs/security.md says how to issue real ones.
"""

from pathlib import Path

import trustme

HERE = Path(__file__).parent
CLIENTS = ("operator", "controller", "router", "node05", "node06")


def main() -> None:
    ca = trustme.CA(organization_name="llmgw-example")
    ca.cert_pem.write_to_path(str(HERE / "ca.pem"))
    server = ca.issue_cert("localhost", "127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(HERE / "server.pem"))
    server.private_key_pem.write_to_path(str(HERE / "server-key.pem"))
    for name in CLIENTS:
        # subject O=llmgw-example, OU=fleet, CN=<name>: the users in mtls.conf name this DN.
        # The DNS SAN maps to no user, so nats-server falls through to the subject.
        leaf = ca.issue_cert(
            f"{name}.example.invalid",
            common_name=name,
            organization_name="llmgw-example",
            organization_unit_name="fleet",
        )
        leaf.cert_chain_pems[0].write_to_path(str(HERE / f"{name}.pem"))
        leaf.private_key_pem.write_to_path(str(HERE / f"{name}-key.pem"))


if __name__ == "__main__":
    main()
