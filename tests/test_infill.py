"""Fill-in-the-middle on a tiny random-weight model whose vocabulary has FIM tokens (built here),
through the Python API, /infill and /v1/completions' suffix; the default model has none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS
from warmkv.bench.shapes import Shape, write_f16
from warmkv.prompt.infill import ExtraFile

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
PREFIX = "def area(w, h):\n    "
SUFFIX = "\n    return result\n"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fim") / "tiny-fim.f16.gguf"
    write_f16(Shape("tiny-fim", 64, 2, 4, 2, 128, 10000.0), path, extra_control=FIM)
    return path


@pytest.fixture(scope="module", params=BACKENDS)
def fim_rt(request: pytest.FixtureRequest, fim_model: Path) -> Iterator[warmkv.Runtime]:
    rt = warmkv.Runtime.load(str(fim_model), backend=request.param, num_ctx=512, n_seq_max=2, **NO_TIERS)
    yield rt
    rt.close()


def _ids(rt: warmkv.Runtime, name: str) -> int:
    (t,) = rt.tokenize(name, add_bos=False)
    return t


def test_prompt_layout_is_psm_with_the_repository_first(fim_rt: warmkv.Runtime) -> None:
    rt = fim_rt
    pre, suf, mid, sep, repo = (_ids(rt, n) for n in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                                                       "<|file_sep|>", "<|repo_name|>"))  # fmt: skip
    files = [ExtraFile("utils.py", "def add(a, b):\n    return a + b\n")]
    inp = rt.infill_prompt(PREFIX, SUFFIX, files, repo="demo")
    text = lambda s: rt.tokenize(s, add_bos=False, parse_special=False)  # noqa: E731
    want = [repo, *text("demo\n"), sep, *text("utils.py\n" + files[0].text),
            pre, *text(PREFIX), suf, *text(SUFFIX), mid]  # fmt: skip
    assert list(inp.tokens or ()) == want
    assert inp.text == "<|repo_name|>demo\n<|file_sep|>utils.py\n" + files[0].text + (
        f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )
    # Code that spells a control token stays text.
    tricky = rt.infill_prompt("x = '<|fim_middle|>'", "")
    assert (tricky.tokens or ()).count(mid) == 1


def test_infill_generates_and_stays_warm_across_keystrokes(fim_rt: warmkv.Runtime) -> None:
    files = [ExtraFile("utils.py", "def add(a, b):\n    return a + b\n" * 8)]
    c = fim_rt.infill(PREFIX, SUFFIX, files, max_tokens=4, temperature=0, ignore_eos=True)
    assert c.usage.completion_tokens == 4 and isinstance(c.text, str)
    again = fim_rt.infill(PREFIX + "r", SUFFIX, files, max_tokens=2, temperature=0, ignore_eos=True)
    extra_tokens = len(fim_rt.tokenize("utils.py\n" + files[0].text, add_bos=False, parse_special=False))
    assert again.usage.cached_tokens >= extra_tokens  # the repository context stayed resident


def test_default_model_has_no_fim_tokens(rt: warmkv.Runtime) -> None:
    with pytest.raises(warmkv.Unsupported, match="fill-in-the-middle prefix, suffix, middle"):
        rt.infill("a", "b")


def test_infill_routes(fim_model: Path) -> None:
    pytest.importorskip("fastapi")
    import httpx

    from server_harness import live_server

    with (
        warmkv.Runtime.load(str(fim_model), backend="llamacpp", num_ctx=512, n_seq_max=2, **NO_TIERS) as rt,
        live_server(rt, pool_size=1) as base,
    ):
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0,
                "input_extra": [{"filename": "utils.py", "text": "x = 1\n"}], "cache_prompt": True}  # fmt: skip
        r = httpx.post(f"{base}/infill", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["stop"] is True and out["tokens_predicted"] <= 4 and "content" in out
        assert out["tokens_evaluated"] == len(
            rt.infill_prompt(PREFIX, SUFFIX, [ExtraFile("utils.py", "x = 1\n")]).tokens
        )
        with httpx.stream("POST", f"{base}/infill", json={**body, "stream": True}, timeout=120) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events and '"stop":true' in events[-1]
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": PREFIX, "suffix": SUFFIX,
                                                        "max_tokens": 3, "temperature": 0}, timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_infill_on_the_default_model_is_a_400() -> None:
    pytest.importorskip("fastapi")
    import httpx

    from server_harness import live_server

    with (
        warmkv.Runtime.load(backend="llamacpp", num_ctx=256, n_seq_max=1, **NO_TIERS) as rt,
        live_server(rt, pool_size=1) as base,
    ):
        r = httpx.post(f"{base}/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=120)
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "a", "suffix": "b"}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
