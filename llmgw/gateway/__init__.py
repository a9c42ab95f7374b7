"""The gateway: API keys, teams, limits, quotas, metering and audit at the router.

Pure: imports no nats (the router's shell feeds it the bucket's watch and gives it the
counter and audit streams as small async ports), so every rule is tested without a server
and nothing here makes a NATS round trip per request.

credentials.py  secrets: making one, hashing it (salted SHA-256), checking one
usage.py        the engines' own usage, read from an answer or a stream's last chunk
refusals.py     401 / 403 / 429 / 503 in OpenAI's error shape, and the x-ratelimit-* headers
table.py        KeyTable: keys and teams from the bucket; authenticate, authorize, models
budget.py       Budget: one limit's window, spent locally from shares claimed ahead
limiter.py      Limiter: every budget of a request, claimed from the counter stream
metering.py     Meter: tokens and requests per hour, team, key and model, added in batches
gateway.py      Gateway: the one object a router's handler calls (admit, usage, settle)
relay.py        what it reads of an answer as it is relayed: usage, a stream as it goes
follow.py       the router's watch of keys and teams fed into a Gateway
"""
