"""`warmkv launch HARNESS`: an agent CLI (Claude Code, Codex, opencode, pi, qwen-code, crush) pointed at warmkv.

One module per harness writes that harness's settings (its endpoint, model, output cap, its own
auto-compact window, telemetry and update checks off) into a config folder of its own, never
the user's; server.py finds or starts the server; command.py ties them together.
"""

from .command import launch

__all__ = ["launch"]
