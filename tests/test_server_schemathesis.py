"""Stateful fuzzing of the session routes: schemathesis follows their OpenAPI links on a live server.

Each scenario opens sessions and chains prefix, suffix, decode, explain, snapshot, fork and close
on them, with valid and invalid bodies. No call may answer 5xx, and the server keeps serving.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

# Scenarios of up to STEPS calls each: ~500 calls, about 30 s on an idle 2-core machine. A longer
# hunt: WARMKV_SCHEMATHESIS_SCENARIOS=300.
SCENARIOS = int(os.environ.get("WARMKV_SCHEMATHESIS_SCENARIOS", "50"))
STEPS = 12
MAX_DECODE_TOKENS = 8  # bodies may ask for 256 tokens or "until the context is full": speed is not under test
NEW_SESSION = ("/v1/sessions", "/v1/sessions/{sid}/fork")


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # Tiers on (in the tests' private cache dir), so snapshots reach the disk store.
    runtime = warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=6)
    try:
        with live_server(runtime, pool_size=1) as url:
            yield url
    finally:
        runtime.close()


def test_session_routes_chained_by_links_never_answer_5xx(base: str) -> None:
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json").include(path_regex=r"^/v1/sessions")
    assert schema.statistic.transitions.total == 7 * 7  # every route but close links to the 7 that take an id
    statuses: Counter[tuple[str, int]] = Counter()

    class Sessions(schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            self.opened: set[str] = set()

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"timeout": 120}  # a busy shared machine can take seconds per step

        def before_call(self, case: Any) -> None:
            body = case.body
            if case.operation.path.endswith("/decode") and isinstance(body, dict):
                n = body.get("max_tokens")
                if n is None or (isinstance(n, int) and not isinstance(n, bool) and n > MAX_DECODE_TOKENS):
                    body["max_tokens"] = MAX_DECODE_TOKENS

        def after_call(self, response: Any, case: Any) -> None:
            super().after_call(response, case)
            statuses[(case.operation.label, response.status_code)] += 1
            if response.status_code == 200 and case.operation.path in NEW_SESSION:
                self.opened.add(response.json()["id"])

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            case.validate_response(response, checks=[not_a_server_error], transport_kwargs=kwargs or None)

        def teardown(self) -> None:
            # Close what the scenario opened, so the next one starts with free session slots.
            for sid in self.opened:
                httpx.delete(f"{base}/v1/sessions/{sid}", timeout=60)

    Sessions.run(
        settings=settings(
            max_examples=SCENARIOS,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
    )
    print(f"\n{sum(statuses.values())} calls", *sorted(f"{k[0]} {k[1]}: {v}" for k, v in statuses.items()), sep="\n")
    assert not [k for k in statuses if k[1] >= 500]
    # The links did their work: calls reached the sessions they opened (a decode there: 200, or 409 before a prefix).
    decode = "POST /v1/sessions/{sid}/decode"
    assert statuses[(decode, 200)] + statuses[(decode, 409)] > 0
    for label in ("POST /v1/sessions/{sid}/prefix", "DELETE /v1/sessions/{sid}"):
        assert statuses[(label, 200)] > 0, label

    # The server still serves a whole turn.
    assert httpx.get(f"{base}/health", timeout=30).json()["status"] == "ok"
    with httpx.Client(base_url=base, timeout=120) as c:
        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/prefix", json={"text": "Hello"}).raise_for_status()
        done = c.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 4, "stream": False}).json()
        assert done["finish_reason"] in ("stop", "length")
        c.delete(f"/v1/sessions/{sid}").raise_for_status()
