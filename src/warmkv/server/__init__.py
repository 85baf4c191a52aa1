"""`warmkv serve`: an OpenAI-compatible HTTP server with persistent sessions and batched decoding."""

from .app import create_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
