"""gateeng: an LLM serving engine where determinism is a per-request service level."""
from importlib.metadata import version

__version__ = version("gateeng")   # pyproject.toml owns it
