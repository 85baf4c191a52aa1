"""The history Codex continues from after a remote compaction (server/api/responses/codex_history.py),
checked against what Codex 0.171.0 sent on the wire (fixtures/compaction/codex-0.171.0.json:
the messages it kept, then its first request after compacting, texts cut short; the moved
context's texts are the same in full)."""

from __future__ import annotations

import json
from pathlib import Path

from warmkv.server.api.responses.codex_history import is_codex, reorder

FIXTURE = Path(__file__).parent / "fixtures" / "compaction" / "codex-0.171.0.json"


def _msg(role: str, text: str) -> dict[str, object]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def test_the_kept_messages_in_the_order_codex_sends_them() -> None:
    seen = json.loads(FIXTURE.read_text())
    sent = seen["sent_after_compaction"]
    assert sent[-1]["type"] == "compaction"
    kept = [*seen["retained"], sent[-1]]
    assert _rendered(kept) != _rendered(sent)  # Codex's order is not the order it first sent them in
    assert _rendered(reorder(kept)) == _rendered(sent)


def _rendered(items: list[dict[str, object]]) -> list[dict[str, object]]:
    """Items less their ids, which no template renders (Codex gives its moved context new ones)."""
    return [{k: v for k, v in i.items() if k != "id" or i["type"] == "compaction"} for i in items]


def test_the_initial_context_moves_before_the_last_real_user_message() -> None:
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "x"}
    base, skills = _msg("developer", "base"), _msg("developer", "<permissions instructions>")
    env = _msg("user", "<environment_context>cwd</environment_context>")
    agents = _msg("user", "# AGENTS.md instructions")
    one, two, three = _msg("user", "one"), _msg("user", "two"), _msg("user", "three")
    assert reorder([base, skills, env, agents, one, two, three, item]) == [
        base, one, two, skills, env, agents, three, item
    ]  # fmt: skip
    assert reorder([base, skills, env, one, item]) == [base, skills, env, one, item]  # one user message: as it was
    assert reorder([base, env, item]) == [base, env, item]  # no real user message
    assert reorder([one, two, item]) == [one, two, item]  # no context


def test_codex_is_told_by_its_headers() -> None:
    assert is_codex({"originator": "codex_exec"}) and is_codex({"x-codex-window-id": "t:1"})
    assert not is_codex({"originator": "opencode"}) and not is_codex({})
