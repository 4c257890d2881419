"""gateeng: an LLM serving engine where determinism is a per-request service level."""
__version__ = "0.1.0"
