"""The fleet as the bucket holds it, read one way by every reader.

`decode` is the one decoder layer (records in, typed tables out, and the rule for a value
that does not read); `model` is the typed read model built from those tables by `build`:
the controller's view, the router's table, the fleet page and `llmgw status` all read the
bucket through here. Imports no nats.
"""
