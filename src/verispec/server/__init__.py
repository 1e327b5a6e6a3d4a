"""`verispec serve`: an OpenAI-compatible HTTP server on the batching engine (needs the ``serve`` extra)."""

from .app import create_app

__all__ = ["create_app"]
