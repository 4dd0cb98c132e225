"""kvcompassd: a cross-region KV-cache discovery plane and router for LLM serving (KVCompass)."""

__version__ = "0.1.0"
