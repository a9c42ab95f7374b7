"""Which messages on an agent's request subject are requests: the rest are forged deliveries.

Only the controller and the operator may publish on `llmgw.agent.<node>.>` (llmgw.bus.
permissions). But the server itself publishes on any subject a client names: a node may
create a JetStream push consumer whose deliver subject is another node's request subject
(the deliver subject travels in the request body, where permissions cannot look), or send
a JetStream API request with that subject as its reply. Neither needs publish permission
on the subject, and the consumer outlives its creator's connection.

What the server sends on someone's behalf looks different from a client's request, and a
node cannot make it look otherwise:
- a consumer delivers a stored message under its own subject (`$KV.<bucket>.<key>`), with
  a `$JS.ACK.<stream>.<consumer>...` reply, or a heartbeat with a status header and no reply;
- an API response or a publish acknowledgement has no reply subject.
A request is therefore a message on the very subject served, with a reply subject outside
the server's `$` namespace and no status header. Pure: tested on samples and, in
tests/test_tls.py, against a real nats-server.
"""

from __future__ import annotations

from collections.abc import Mapping


def forged(
    served: str, subject: str, reply: str | None, headers: Mapping[str, str] | None
) -> str | None:
    """Why a message received on the subscription to `served` is not a client's request
    (for the log); None when it is one."""
    if headers and "Status" in headers:
        return f"a status message ({headers.get('Status')} {headers.get('Description', '')})"
    if subject != served:
        return f"a JetStream delivery of {subject} (not a request: {_source(reply)})"
    if not reply:
        return "no reply subject: a response the server sent there on someone's behalf"
    if reply.startswith("$"):
        return f"a server message ({_source(reply)})"
    return None


def consumer_of(reply: str | None) -> tuple[str, str] | None:
    """(stream, consumer) that delivered a message, from its `$JS.ACK` reply subject."""
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<...>, or with a domain and account hash: $JS.ACK.<domain>.
    # <account hash>.<stream>.<consumer>.<...> (12 tokens or more)
    if len(tokens) >= 12:
        return tokens[4], tokens[5]
    if len(tokens) >= 4:
        return tokens[2], tokens[3]
    return None


def _source(reply: str | None) -> str:
    found = consumer_of(reply)
    if found is None:
        return f"reply {reply!r}"
    stream, consumer = found
    return (
        f"consumer {consumer} of stream {stream}, which someone created to deliver here; "
        f"remove it with `nats consumer rm {stream} {consumer}`"
    )
