"""The bus: the only package that imports nats.

Kept light on purpose: `llmgw.bus.keys` and `llmgw.bus.records` import no nats, so
pure code (placement, discovery parsing) can use the records without the client.
Import `llmgw.bus.connection`, `llmgw.bus.bucket` and `llmgw.bus.server` explicitly.
"""
