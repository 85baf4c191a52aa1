"""`warmkv` command line: one package, one shared runtime-options decorator (options.py)."""

from .app import app, main

__all__ = ["app", "main"]
