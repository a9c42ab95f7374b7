"""llmgw: LLM engines on a GPU fleet behind one OpenAI-compatible endpoint, over NATS."""

__version__ = "0.1.0"
