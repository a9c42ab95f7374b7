"""The bus: the only package that imports nats.

Kept light on purpose: importing `llmgw.bus` imports nothing. Pure modules, for code that
must not touch NATS (placement, discovery parsing): `keys` (key and subject names),
`records` (the values), `trust` (a value checked against its key), `requests` (which
messages are requests), `permissions` (nats-server users). `client` (connecting, the
bucket) and `watcher` (a watch that knows when it has caught up) import nats; `server`
runs the embedded nats-server. Import each explicitly.
"""
