"""The bus: the only package that imports nats.

Kept light on purpose: importing `llmgw.bus` imports nothing. Pure modules, for code that
must not touch NATS (placement, discovery parsing): `keys` (key and subject names),
`records` (the values), `trust` (a value checked against its key), `requests` (which
messages are requests), `permissions` (nats-server users), `settings` (URLs, TLS files),
`errors` (what a Bus call raises: BusError and its kinds). These import nats, as nats-py's
own modules divide it: `client` (the Bus: reads, writes, fences, watches), `connection`
(connecting, backoff, failover, round trips), `bucket` (opening or creating the bucket),
`watcher` (a watch that knows when it has caught up), `classify` (what a nats-py error
means: the one place that reads them); `server` runs the embedded nats-server. Import each
explicitly.
"""
