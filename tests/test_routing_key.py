"""The routing key a proxy hashes on, read from what clients already send (no model, no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("starlette")

from starlette.datastructures import Headers

from warmkv.errors import InvalidConfig
from warmkv.server.fleet.routing import RoutingKey, conversation_key, routing_key, uses
from warmkv.server.settings import ServerSettings

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
CLAUDE_JSON = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "58a550ae-91be"})


def _h(**headers: str) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in headers.items()})


def test_precedence_follows_the_documented_order() -> None:
    """X-Session-Id, prompt_cache_key, user, metadata.user_id, Claude Code's header, Codex's header:
    each wins over every one after it."""
    everything = {"prompt_cache_key": "pck", "user": "alice", "metadata_user_id": "user-7"}
    headers = {"x_session_id": "xs", "x_claude_code_session_id": "cc", "session_id": "codex"}
    order = [
        ("xs", "x-session-id"),
        ("pck", "prompt_cache_key"),
        ("alice", "user"),
        ("user-7", "metadata.user_id"),
        ("cc", "x-claude-code-session-id"),
        ("codex", "session-id"),
    ]
    for value, source in order:
        key = routing_key(_h(**headers), **everything)
        assert key is not None and (key.value, key.source) == (value, source)
        headers = {k: v for k, v in headers.items() if v != value}
        everything = {k: v for k, v in everything.items() if v != value}
    assert routing_key(_h()) is None and conversation_key(_h()) is None


def test_header_names_are_case_insensitive_and_empty_values_do_not_count() -> None:
    assert routing_key(Headers({"X-Session-Id": "A"})) == RoutingKey("A", "x-session-id", True)
    assert routing_key(Headers({"X-Session-Id": ""}), prompt_cache_key="", user="u") == RoutingKey("u", "user", False)


def test_a_user_routes_but_does_not_pick_a_pooled_session() -> None:
    """`user` names a person with many conversations: it spreads load by user, and a conversation
    key after it (Codex's header) still picks the pooled session."""
    assert routing_key(_h(session_id="conv-1"), user="alice") == RoutingKey("alice", "user", False)
    assert conversation_key(_h(session_id="conv-1"), user="alice") == "conv-1"
    assert conversation_key(_h(), user="alice") is None


@pytest.mark.parametrize(
    ("user_id", "expected"),
    [
        (CLAUDE_JSON, RoutingKey("58a550ae-91be", "metadata.user_id", True)),  # Claude Code 2.x: JSON
        ("user_ab12_account_0f9e-11_session_77aa-bb", RoutingKey("77aa-bb", "metadata.user_id", True)),  # older
        ("customer-42", RoutingKey("customer-42", "metadata.user_id", False)),  # any other client: a user
        ('{"session_id": 5}', RoutingKey('{"session_id": 5}', "metadata.user_id", False)),
        ("[1, 2]", RoutingKey("[1, 2]", "metadata.user_id", False)),
    ],
)
def test_metadata_user_id(user_id: str, expected: RoutingKey) -> None:
    assert routing_key(_h(), metadata_user_id=user_id) == expected


def test_claude_code_capture_routes_on_its_session_id() -> None:
    """The captured Claude Code request: its header and its metadata.user_id name the same session."""
    cap = json.loads((FIXTURES / "claude-code-2.1.197.json").read_text())
    headers = Headers(cap["headers"])
    user_id = cap["body"]["metadata"]["user_id"]
    sid = headers["x-claude-code-session-id"]
    key = routing_key(headers, metadata_user_id=user_id)
    assert key == RoutingKey(sid, "metadata.user_id", True)
    assert routing_key(headers) == RoutingKey(sid, "x-claude-code-session-id", True)  # what nginx's map sees
    assert uses("metadata.user_id", headers, metadata_user_id=user_id)


def test_codex_capture_routes_on_its_session_id() -> None:
    """The captured Codex request: prompt_cache_key and its session-id header are the same id, so a
    proxy hashing the header and the node reading the body agree."""
    cap = json.loads((FIXTURES / "codex-0.169.0.json").read_text())
    headers = Headers(cap["headers"])
    key = routing_key(headers, prompt_cache_key=cap["body"]["prompt_cache_key"])
    assert key == RoutingKey(headers["session-id"], "prompt_cache_key", True)
    assert routing_key(headers) == RoutingKey(headers["session-id"], "session-id", True)


def test_only_the_key_in_use_counts_as_used() -> None:
    assert not uses("metadata.user_id", _h(x_session_id="s"), metadata_user_id="customer-42")
    assert uses("metadata.user_id", _h(), metadata_user_id="customer-42")
    assert uses("metadata.user_id", _h(x_claude_code_session_id="c"), metadata_user_id=CLAUDE_JSON)
    assert not uses("metadata.user_id", _h())


@pytest.mark.parametrize(
    ("value", "echoed"),
    [
        ("conv-1", True),
        ("a b", True),
        (" padded", False),  # a header value loses outer spaces: echo a digest instead
        ("line\nbreak", False),
        ("café", False),
        ("x" * 256, True),
        ("x" * 257, False),
    ],
)
def test_header_value_is_the_key_or_its_digest(value: str, echoed: bool) -> None:
    shown = RoutingKey(value, "prompt_cache_key", True).header_value
    if echoed:
        assert shown == value
    else:
        assert shown.startswith("sha256:") and len(shown) == 7 + 32
        assert shown == RoutingKey(value, "user", False).header_value  # the same key, the same digest


def test_node_id_defaults_to_host_and_port() -> None:
    assert ServerSettings(port=8123).node == "127.0.0.1:8123"
    assert ServerSettings(port=8123, node_id="gpu-3").node == "gpu-3"
    assert ServerSettings(host="::1", port=9).node == "[::1]:9"
    wild = ServerSettings(host="0.0.0.0", port=9, api_key="k" * 8).node
    assert wild.endswith(":9") and not wild.startswith("0.0.0.0")
    for bad in ("", " lead", "tab\there", "é", "x" * 129):
        with pytest.raises(InvalidConfig, match="node_id"):
            ServerSettings(node_id=bad)
