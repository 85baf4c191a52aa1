"""A default `warmkv serve` against the requests a web page can make: a page on another origin, or one
that rebinds its own name to 127.0.0.1, changes nothing; local pages, editors and the official
clients keep working (Ollama applies the same rules: server/http/browser.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import WebSocketRoute  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from starlette.websockets import WebSocket, WebSocketDisconnect  # noqa: E402

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.errors import InvalidConfig  # noqa: E402
from warmkv.server.http.browser import BrowserPolicy, host_name  # noqa: E402
from warmkv.server.http.guard import Guard, handshake_refusal  # noqa: E402
from warmkv.server.metrics import ServerMetrics  # noqa: E402
from warmkv.server.settings import ServerSettings  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
EVIL = "https://evil.example"
ADMIN = "admin-key-for-tests"
WS = "ws://127.0.0.1:8000/v1/responses"
# What a page's fetch(url, {method: "POST", mode: "no-cors", body: "..."}) sends: no preflight.
NO_CORS = {"origin": EVIL, "sec-fetch-mode": "no-cors", "sec-fetch-site": "cross-site", "content-type": "text/plain"}
TIMEOUT = 120  # a generation on a busy shared machine takes seconds
GENERATE = '{"model": "smollm2", "prompt": "Hi", "stream": false, "options": {"num_predict": 2}}'


def test_policy_matches_ollamas_origins_and_hosts() -> None:
    p = ServerSettings().browser_policy()
    for ok in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:8000", "vscode-webview://abc", "app://x"):
        assert p.origin_allowed(ok), ok
    for bad in (EVIL, "http://localhost.evil.example", "http://localhost:1.evil.example", "null", "http://10.0.0.1"):
        assert not p.origin_allowed(bad), bad
    for ok in ("127.0.0.1:8000", "localhost", "[::1]:8000", "app.localhost:80", "192.168.1.2", None):
        assert p.host_allowed(ok), ok
    for bad in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io", "8.8.8.8"):
        assert not p.host_allowed(bad), bad
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost:80") == "localhost"
    extra = ServerSettings(cors_origins=("https://*.example.org",), allowed_hosts=("box.lan",)).browser_policy()
    assert extra.origin_allowed("https://ui.example.org") and not extra.origin_allowed("https://ui.example.org.evil")
    assert extra.host_allowed("box.lan:8000") and not extra.host_allowed("x.box.lan")
    wide = ServerSettings(host="0.0.0.0", api_key="k" * 8).browser_policy()
    assert wide.host_allowed("evil.example") and not wide.origin_allowed(EVIL)  # the key guards a public bind
    assert ServerSettings(cors_any_origin=True).browser_policy().origin_allowed(EVIL)
    for bad_cfg in ({"cors_origins": ("*",)}, {"cors_origins": ("https://x.org/path",)}, {"allowed_hosts": ("h:80",)},
                    {"admin_key": "short"}, {"api_key": "same-key-1", "admin_key": "same-key-1"}):  # fmt: skip
        with pytest.raises(InvalidConfig):
            ServerSettings(**bad_cfg)  # type: ignore[arg-type]
    assert BrowserPolicy(check_hosts=False).host_allowed("evil.example")


def _ws_app(settings: ServerSettings) -> Guard:
    async def echo(ws: WebSocket) -> None:
        assert handshake_refusal(ws.scope, settings) is None  # what a WebSocket route may call itself
        await ws.accept()
        await ws.send_text("ok")
        await ws.close()

    app = Starlette(routes=[WebSocketRoute("/v1/responses", echo)])
    policy = settings.browser_policy()
    return Guard(app, api_key=settings.api_key, max_body_bytes=1024, metrics=ServerMetrics(), policy=policy)


def test_websocket_handshakes_get_the_same_checks() -> None:
    client = TestClient(_ws_app(ServerSettings()), base_url="http://127.0.0.1:8000")
    with client.websocket_connect(WS, headers={"origin": "http://localhost:5173"}) as ws:
        assert ws.receive_text() == "ok"
    with client.websocket_connect(WS) as ws:  # Codex sends no Origin
        assert ws.receive_text() == "ok"
    for headers in ({"origin": EVIL}, {"host": "evil.example:8000"}):
        with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect(WS, headers=headers):
            pass
        assert refused.value.code == 1008
    keyed = TestClient(_ws_app(ServerSettings(api_key="ws-key-123")), base_url="http://127.0.0.1:8000")
    with pytest.raises(WebSocketDisconnect), keyed.websocket_connect(WS):
        pass
    with keyed.websocket_connect(WS, headers={"authorization": "Bearer ws-key-123"}) as ws:
        assert ws.receive_text() == "ok"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=512, n_seq_max=2, prefix_cache_mb=0, kv_store_mb=0)
    try:
        with live_server(rt, pool_size=1, admin_key=ADMIN) as url:
            yield url
    finally:
        rt.close()


def _generated(base: str) -> float:
    """Requests answered 200 on the Ollama generate route so far (the metric every request counts in)."""
    text = httpx.get(f"{base}/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("warmkv_requests_total") and '"/api/generate"' in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'status="200"' in ln)


def _ready(base: str) -> bool:
    h = httpx.get(f"{base}/health")
    return h.status_code == 200 and h.json()["ready"] and not h.json()["drain"]


def test_a_foreign_page_changes_nothing(base: str) -> None:
    before = _generated(base)
    drain = httpx.post(f"{base}/admin/drain", content=b"", headers=NO_CORS)  # a simple request: no preflight
    assert drain.status_code == 403 and drain.json()["error"]["code"] == "origin_not_allowed", drain.text
    gen = httpx.post(f"{base}/api/generate", content=GENERATE, headers=NO_CORS)
    assert gen.status_code == 403 and "origin" in gen.json()["error"], gen.text  # Ollama's error shape
    anth = httpx.post(f"{base}/v1/messages", content="{}", headers={**NO_CORS, "content-type": "application/json"})
    assert anth.status_code == 403 and anth.json()["error"]["type"] == "permission_error", anth.text
    pre = httpx.options(
        f"{base}/v1/chat/completions",
        headers={"origin": EVIL, "access-control-request-method": "POST", "access-control-request-headers": "x"},
    )
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    # DNS rebinding: the page's own name now resolves to 127.0.0.1, so its requests are same-origin.
    rebound = {"host": "evil.example:80", "content-type": "text/plain"}  # (its Origin is refused too)
    drain = httpx.post(f"{base}/admin/drain", headers=rebound)
    assert drain.status_code == 403 and drain.json()["error"]["code"] == "host_not_allowed", drain.text
    quiet = httpx.post(f"{base}/api/generate", content=GENERATE, headers={"host": "evil.example"})
    assert quiet.status_code == 403, quiet.text
    assert _ready(base) and _generated(base) == before  # nothing drained, nothing generated


def test_a_local_page_must_send_json(base: str) -> None:
    local = {"origin": "http://localhost:5173", "sec-fetch-mode": "cors", "content-type": "text/plain"}
    before = _generated(base)
    gen = httpx.post(f"{base}/api/generate", content=GENERATE, headers=local)
    assert gen.status_code == 415 and "application/json" in gen.json()["error"], gen.text
    chat = httpx.post(f"{base}/v1/chat/completions", content="{}", headers=local)
    assert chat.status_code == 415 and chat.json()["error"]["code"] == "unsupported_media_type"
    assert _generated(base) == before
    pre = httpx.options(
        f"{base}/v1/chat/completions",
        headers={"origin": "http://localhost:5173", "access-control-request-method": "POST"},
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:5173"
    ok = httpx.post(
        f"{base}/api/generate", content=GENERATE, headers={**local, "content-type": "application/json"}, timeout=TIMEOUT
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert _generated(base) == before + 1


def test_the_admin_key_guards_admin_routes(base: str) -> None:
    for path, body in (("/admin/drain", None), ("/models/unload", {"model": MODEL})):
        r = httpx.post(f"{base}{path}", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key", r.text
    loaded = httpx.post(f"{base}/models/load", json={"model": MODEL}, headers={"x-api-key": ADMIN})
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
    assert _ready(base)


def test_official_clients_still_work(base: str) -> None:
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    ollama = pytest.importorskip("ollama")
    oc = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=TIMEOUT)
    r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None
    ac = anthropic.Anthropic(base_url=base, api_key="none", timeout=TIMEOUT)
    m = ac.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert m.content and m.usage.output_tokens > 0
    g = ollama.Client(host=base, timeout=TIMEOUT).generate("smollm2", "Hi", options={"num_predict": 2})
    assert g.done
    # Ollama's documentation sends JSON with curl's form type: a client that is no browser may.
    form = httpx.post(
        f"{base}/api/generate",
        content=GENERATE,
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=TIMEOUT,
    )
    assert form.status_code == 200, form.text
