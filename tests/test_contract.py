"""The Session contract, on the real default model, for every installed backend."""

from __future__ import annotations

import threading

import pytest

import warmkv
from conftest import SYSTEM, USER_A, USER_B, greedy_tokens
from warmkv.engine.prefix_plan import PrefixLoad
from warmkv.prompt.tokens import common_prefix_len

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step


@pytest.fixture(autouse=True)
def _exact_mode_moves_no_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract runs in exact mode (the default): no load may move KV runs."""
    status = PrefixLoad.status

    def checked(load: PrefixLoad) -> warmkv.PrefixStatus:
        st = status(load)
        assert st.chunk_reused_tokens == 0 and st.recomputed_tokens == 0 and not load.plan.moves
        assert load.ctx.exact_end is None
        return st

    monkeypatch.setattr(PrefixLoad, "status", checked)


def test_reuse_counts_are_exact(rt: warmkv.Runtime) -> None:
    extended = SYSTEM + "Always answer in one sentence.\n"
    toks, toks_ext = rt.tokenize(SYSTEM), rt.tokenize(extended)
    with rt.session() as s:
        p = s.ensure_prefix(SYSTEM)
        assert (p.reused_tokens, p.prefilled_tokens, p.prefix_tokens) == (0, len(toks), len(toks))
        assert not p.warm and p.resident_tokens == len(toks)
        assert p.available_tokens == rt.config.num_ctx - len(toks)
        assert p.stable_token_hash == warmkv.hash_token_ids(toks)
        p = s.ensure_prefix(SYSTEM)
        assert (p.reused_tokens, p.prefilled_tokens, p.dropped_tokens) == (len(toks), 0, 0)
        assert p.warm
        p = s.ensure_prefix(extended)
        lcp = common_prefix_len(toks, toks_ext)
        assert lcp > 0
        assert (p.reused_tokens, p.prefilled_tokens) == (lcp, len(toks_ext) - lcp)
        assert p.dropped_tokens == len(toks) - lcp


def test_changed_byte_reprefills_from_divergence_only(rt: warmkv.Runtime) -> None:
    mid = len(SYSTEM) // 2
    changed = SYSTEM[:mid] + ("X" if SYSTEM[mid] != "X" else "Y") + SYSTEM[mid + 1 :]
    a, b = rt.tokenize(SYSTEM), rt.tokenize(changed)
    lcp = common_prefix_len(a, b)
    assert 0 < lcp < len(a)
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        p = s.ensure_prefix(changed)
        assert p.reused_tokens == lcp
        assert p.prefilled_tokens == len(b) - lcp
        assert p.dropped_tokens == len(a) - lcp
        assert "diverged at token" in p.reason


def test_divergence_names_where_reuse_stopped(rt: warmkv.Runtime) -> None:
    mid = len(SYSTEM) // 2
    changed = SYSTEM[:mid] + "Z" + SYSTEM[mid + 1 :]
    with rt.session() as s:
        assert s.ensure_prefix(SYSTEM).divergence is None  # nothing was resident
        assert s.ensure_prefix(SYSTEM + "More.").divergence is None  # everything resident was reused
        p = s.ensure_prefix(changed)
        d = p.divergence
        assert d is not None and d.token == p.reused_tokens and d.resident == len(rt.tokenize(SYSTEM + "More."))
        assert d.char <= mid < d.char + len(d.new) and changed[d.char :].startswith(d.new[:8])
        assert SYSTEM[d.char :].startswith(d.old[:8]) and d.old != d.new
        report = s.explain()
        assert report.last_prefix is not None and report.last_prefix.divergence == d
        assert f"reuse stopped at token {d.token}" in str(report)
        assert report.to_dict()["last_prefix"]["divergence"]["token"] == d.token


def test_a_resent_prompt_decodes_from_its_own_logits(rt: warmkv.Runtime) -> None:
    """A full hit samples from the logits its prefill produced, bitwise: no re-evaluation of the last token."""
    cfg = warmkv.DecodeConfig(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    with rt.session() as s:
        s.ensure_prefix(SYSTEM + USER_A)
        first = [(lp.token, lp.logprob, lp.top) for c in s.decode(cfg) for lp in c.logprobs or ()]
        assert s.ensure_prefix(SYSTEM + USER_A).prefilled_tokens == 0
        again = [(lp.token, lp.logprob, lp.top) for c in s.decode(cfg) for lp in c.logprobs or ()]
    assert again == first


def test_suffix_never_alters_prefix(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        n_prefix = s.ensure_prefix(SYSTEM).prefix_tokens
        q = s.prefill_suffix(USER_A)
        assert q.prefix_tokens == n_prefix and q.suffix_tokens == len(rt.tokenize(USER_A, add_bos=False))
        first = greedy_tokens(s)
        s.prefill_suffix(USER_B)
        greedy_tokens(s)
        s.prefill_suffix(USER_A)
        assert greedy_tokens(s) == first
        p = s.ensure_prefix(SYSTEM)
        assert p.reused_tokens == n_prefix and p.prefilled_tokens == 0


def test_warm_equals_cold(rt: warmkv.Runtime) -> None:
    check_warm_equals_cold(rt)


def check_warm_equals_cold(rt: warmkv.Runtime) -> None:
    """A turn after another turn on the same prefix gives the tokens of the same turn run cold."""
    with rt.session() as warm:
        warm.ensure_prefix(SYSTEM)
        warm.prefill_suffix(USER_B)
        greedy_tokens(warm)
        p = warm.ensure_prefix(SYSTEM)
        assert p.warm
        warm.prefill_suffix(USER_A)
        warm_out = greedy_tokens(warm, 24)
    with rt.session() as cold:
        cold.ensure_prefix(SYSTEM)
        cold.prefill_suffix(USER_A)
        assert greedy_tokens(cold, 24) == warm_out


def test_generated_tokens_stay_resident_for_append(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        out = greedy_tokens(s, 8)
        before = s.explain()
        assert before.generated_tokens == len(out)
        q = s.prefill_suffix(warmkv.SuffixInput(text="<|im_end|>\n", append=True))
        assert q.resident_tokens == before.resident_tokens + 1 + len(rt.tokenize("<|im_end|>\n", add_bos=False))


def test_overflow_at_every_stage_keeps_session(tiny_rt: warmkv.Runtime) -> None:
    rt = tiny_rt
    n = rt.config.num_ctx
    with rt.session() as s:
        s.ensure_prefix(SYSTEM[:120])
        s.prefill_suffix("Hi")
        before = s.explain()
        reference = greedy_tokens(s, 4)
        s.prefill_suffix("Hi")

        with pytest.raises(warmkv.ContextOverflow) as e:
            s.ensure_prefix(SYSTEM * 3)
        total = len(rt.tokenize(SYSTEM * 3))
        assert (e.value.stage, e.value.num_ctx) == ("ensure_prefix", n)
        assert e.value.resident + e.value.additional == total
        assert str(total) in str(e.value) or str(e.value.additional) in str(e.value)

        with pytest.raises(warmkv.ContextOverflow) as e:
            s.prefill_suffix("word " * 200)
        assert e.value.stage == "prefill_suffix" and e.value.resident == before.prefix_tokens

        with pytest.raises(warmkv.ContextOverflow) as e:
            s.decode(warmkv.DecodeConfig(max_tokens=n))
        assert e.value.stage == "decode" and e.value.resident == before.resident_tokens
        assert e.value.additional == n

        after = s.explain()
        assert (after.resident_tokens, after.prefix_tokens) == (before.resident_tokens, before.prefix_tokens)
        assert greedy_tokens(s, 4) == reference


def test_manifest_mismatch_raises(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        p = s.ensure_prefix(SYSTEM)
        assert p.manifest_digest == rt.manifest().digest
        with pytest.raises(warmkv.ManifestMismatch):
            s.prefill_suffix(warmkv.SuffixInput(text=USER_A, manifest_digest="0" * 64))
        with pytest.raises(warmkv.ManifestMismatch):
            s.ensure_prefix(warmkv.PrefixInput(text=SYSTEM, expect_manifest="f" * 64))
        # The matching digest is accepted; a BOS-policy change is a new manifest: no reuse.
        s.prefill_suffix(warmkv.SuffixInput(text=USER_A, manifest_digest=p.manifest_digest))
        other = s.ensure_prefix(warmkv.PrefixInput(text=SYSTEM, add_bos=not rt.default_add_bos))
        assert other.reused_tokens == 0 and "manifest changed" in other.reason
        assert other.manifest_digest != p.manifest_digest


def test_use_after_close_raises(rt: warmkv.Runtime) -> None:
    s = rt.session()
    s.ensure_prefix(SYSTEM)
    s.close()
    s.close()  # idempotent
    assert s.closed and s.explain().closed
    with pytest.raises(warmkv.SessionClosed):
        s.ensure_prefix(SYSTEM)
    with pytest.raises(warmkv.SessionClosed):
        s.prefill_suffix(USER_A)
    with pytest.raises(warmkv.SessionClosed):
        s.decode(warmkv.DecodeConfig(max_tokens=2))


def test_two_sessions_interleaved_match_alone(rt: warmkv.Runtime) -> None:
    cfg = warmkv.DecodeConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = []
    for suffix in (USER_A, USER_B):
        with rt.session() as s:
            s.ensure_prefix(SYSTEM)
            s.prefill_suffix(suffix)
            alone.append(greedy_tokens(s, 12))
    with rt.session() as a, rt.session() as b:
        a.ensure_prefix(SYSTEM)
        b.ensure_prefix(SYSTEM)
        a.prefill_suffix(USER_A)
        b.prefill_suffix(USER_B)
        ga, gb = a.decode(cfg), b.decode(cfg)
        out: list[list[int]] = [[], []]
        live = [ga, gb]
        while any(live):
            for i, g in enumerate(live):
                if g is None:
                    continue
                chunk = next(g)
                out[i].extend(chunk.token_ids)
                if chunk.done:
                    live[i] = None
        assert out == alone


def test_threads_share_the_model(rt: warmkv.Runtime) -> None:
    results: dict[int, list[int]] = {}

    def work(i: int, suffix: str) -> None:
        with rt.session() as s:
            s.ensure_prefix(SYSTEM)
            s.prefill_suffix(suffix)
            results[i] = greedy_tokens(s, 10)

    threads = [threading.Thread(target=work, args=(i, sfx)) for i, sfx in enumerate((USER_A, USER_B, USER_A))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[2] and len(results[1]) == 10


def test_streamed_multibyte_text_is_never_broken(rt: warmkv.Runtime) -> None:
    prompt = (
        "<|im_start|>user\nRepeat exactly: 🎉🚀✨ 你好世界 日本語のテキスト 😀😀😀<|im_end|>\n"
        "<|im_start|>assistant\n🎉🚀✨ 你好"
    )
    with rt.session() as s:
        s.ensure_prefix(prompt)
        chunks = list(s.decode(warmkv.DecodeConfig(max_tokens=40, temperature=0.0, ignore_eos=True)))
    tokens = [t for c in chunks for t in c.token_ids]
    pieces = [rt.backend.token_bytes(t) for t in tokens]
    split_chars = [p for p in pieces if p and p.decode("utf-8", "ignore").encode() != p]
    assert split_chars, "the model produced no token that splits a UTF-8 character; the test must exercise that"
    # Only the final flush may hold U+FFFD, and only if generation stopped mid-character.
    for c in chunks[:-1]:
        assert "\ufffd" not in c.text
    assert "".join(c.text for c in chunks) == b"".join(pieces).decode("utf-8", "replace")
    assert "世界" in "".join(c.text for c in chunks)


def test_cancel_stops_decode(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        stream = s.decode(warmkv.DecodeConfig(max_tokens=200, temperature=0.0, ignore_eos=True))
        first = next(stream)
        assert not first.done
        threading.Thread(target=s.cancel).start()
        rest = list(stream)
        assert rest[-1].finish_reason == "cancelled"
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens < 200
        # The session stays usable after a cancel.
        s.prefill_suffix(USER_B)
        assert len(greedy_tokens(s, 3)) == 3


def test_stop_strings_cut_text(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        full = "".join(c.text for c in s.decode(warmkv.DecodeConfig(max_tokens=20, temperature=0.0)))
        assert len(full) > 4
        stop = full[2:4]
        s.prefill_suffix(USER_A)
        chunks = list(s.decode(warmkv.DecodeConfig(max_tokens=20, temperature=0.0, stop=[stop])))
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == full[: full.index(stop)]


def test_session_limit_is_typed(tiny_rt: warmkv.Runtime) -> None:
    opened = [tiny_rt.session() for _ in range(tiny_rt.config.n_seq_max)]
    try:
        with pytest.raises(warmkv.SessionLimit) as e:
            tiny_rt.session()
        assert e.value.n_seq_max == tiny_rt.config.n_seq_max
    finally:
        for s in opened:
            s.close()
    tiny_rt.session().close()  # slots come back


def test_explain_reports_segments_and_reason(rt: warmkv.Runtime) -> None:
    raw = SYSTEM.encode()
    seg = (warmkv.Segment("system", 0, len(raw) // 2), warmkv.Segment("files", len(raw) // 2, len(raw)))
    with rt.session() as s:
        s.ensure_prefix(warmkv.PrefixInput(text=SYSTEM, segments=seg))
        s.ensure_prefix(warmkv.PrefixInput(text=SYSTEM, segments=seg))
        s.prefill_suffix(USER_A)
        report = s.explain()
    assert [x["name"] for x in report.segments] == ["system", "files"]
    assert report.last_prefix is not None and report.last_prefix.reason.startswith("warm")
    assert report.suffix_tokens > 0 and report.manifest_digest == rt.manifest().digest
    assert "segment files" in str(report)


def test_logprobs_follow_the_tokens(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        for cfg in (
            warmkv.DecodeConfig(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
            warmkv.DecodeConfig(max_tokens=6, temperature=1.0, top_k=0, top_p=1, min_p=0, seed=7, logprobs=0),
        ):
            chunks = list(s.decode(cfg))
            ids = [t for c in chunks for t in c.token_ids]
            lps = [lp for c in chunks for lp in c.logprobs]
            assert [lp.token for lp in lps] == ids and len(ids) == 6
            for lp in lps:
                assert lp.logprob <= 0 and len(lp.top) == cfg.logprobs
                if cfg.greedy:  # the pick is the most likely token, and the top list is sorted
                    assert lp.top[0] == (lp.token, lp.logprob)
                    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            s.prefill_suffix(USER_A)
        assert all(c.logprobs is None for c in s.decode(warmkv.DecodeConfig(max_tokens=2)))
    with pytest.raises(warmkv.InvalidConfig, match="logprobs"):
        warmkv.DecodeConfig(logprobs=21)


def test_embeddings_are_unit_vectors_and_leave_sessions_alone(rt: warmkv.Runtime) -> None:
    import numpy as np

    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        before = s.explain().resident_tokens
        e = rt.embed(["def add(a, b):\n    return a + b", "def sum_two(x, y):\n    return x + y", "Paris in spring."])
        assert e.shape == (3, rt.info.n_embd) and np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
        assert e[0] @ e[1] > e[0] @ e[2]  # two small adders are closer than an adder and a city
        assert np.array_equal(rt.embed("Paris in spring."), e[2:])  # deterministic
        assert s.explain().resident_tokens == before and s.ensure_prefix(SYSTEM).reused_tokens == before
    for bad in ("", [], ["ok", 3.5], b"bytes"):
        with pytest.raises(warmkv.InvalidInput):
            rt.embed(bad)  # type: ignore[arg-type]
    with pytest.raises(warmkv.ContextOverflow):
        rt.embed([1] * (rt.config.num_ctx + 1))


def test_constrained_decoding_matches_schema_regex_and_grammar(rt: warmkv.Runtime) -> None:
    import json
    import re

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix("<|im_start|>user\nA JSON record for Ada, 36.<|im_end|>\n<|im_start|>assistant\n")
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}):
            cfg = warmkv.DecodeConfig(max_tokens=80, constraint=warmkv.Constraint.json_schema(schema), **sampling)
            chunks = list(s.decode(cfg))
            assert chunks[-1].finish_reason == "stop", chunks[-1]
            record = json.loads("".join(c.text for c in chunks))
            assert set(record) == {"name", "age"} and isinstance(record["name"], str) and type(record["age"]) is int
            s.prefill_suffix("<|im_start|>user\nA JSON record for Ada, 36.<|im_end|>\n<|im_start|>assistant\n")
        phone = warmkv.Constraint.regex(r"[0-9]{3}-[0-9]{4}")
        for seed in (1, 2, 3):
            cfg = warmkv.DecodeConfig(max_tokens=20, temperature=1.0, seed=seed, constraint=phone)
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", "".join(c.text for c in s.decode(cfg)))
        yes_no = warmkv.Constraint.lark('start: "yes" | "no"')
        assert "".join(c.text for c in s.decode(warmkv.DecodeConfig(max_tokens=8, constraint=yes_no))) in ("yes", "no")
        before = s.explain().resident_tokens
        for bad in (warmkv.Constraint.regex("(unclosed"), warmkv.Constraint.json_schema("{not json")):
            with pytest.raises(warmkv.InvalidInput):
                s.decode(warmkv.DecodeConfig(max_tokens=4, constraint=bad))
        assert s.explain().resident_tokens == before
        # Parses, then exceeds llguidance's lexer limits at the first token: that turn ends, the session stays.
        last = list(s.decode(warmkv.DecodeConfig(max_tokens=4, constraint=warmkv.Constraint.regex("a{1000000}"))))[-1]
        assert last.finish_reason == "error" and isinstance(last.error, warmkv.InvalidInput), last
        assert last.usage is not None and last.usage.completion_tokens == 0
        assert "".join(c.text for c in s.decode(warmkv.DecodeConfig(max_tokens=8, constraint=yes_no))) in ("yes", "no")
    with pytest.raises(warmkv.InvalidInput):
        warmkv.Constraint("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(warmkv.InvalidConfig):
        warmkv.DecodeConfig(constraint="json")  # type: ignore[arg-type]


COPY_PROMPT = (
    "<|im_start|>user\nRepeat this function exactly.\n```python\n"
    "def merge_intervals(intervals):\n    intervals.sort(key=lambda pair: pair[0])\n    merged = []\n"
    "    for start, end in intervals:\n        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n            merged.append([start, end])\n"
    "    return merged\n```<|im_end|>\n<|im_start|>assistant\n```python\n"
)


def test_speculative_decoding_drafts_from_the_context(rt: warmkv.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[tuple[int, list[int]]] = []  # (absolute position of its first token, tokens) per step
    step = warmkv.Session._step

    def spy(self: warmkv.Session, state: object) -> warmkv.StreamChunk:
        at = len(self.ctx.tokens) + 1  # after the pending token
        chunk = step(self, state)  # type: ignore[arg-type]
        runs.append((at, list(chunk.token_ids)))  # a verified run goes out as one chunk
        return chunk

    monkeypatch.setattr(warmkv.Session, "_step", spy)

    def run(s: warmkv.Session, **kw: object) -> tuple[list[int], warmkv.Usage, str]:
        s.ensure_prefix(COPY_PROMPT)
        chunks = list(s.decode(warmkv.DecodeConfig(max_tokens=40, temperature=0, **kw)))  # type: ignore[arg-type]
        assert chunks[-1].usage is not None
        return [t for c in chunks for t in c.token_ids], chunks[-1].usage, chunks[-1].finish_reason or ""

    with rt.session() as s:
        plain, _, _ = run(s)
        spec, usage, _ = run(s, speculative=4)
        assert usage.completion_tokens == len(spec) == 40
        assert 0 < usage.accepted_tokens <= usage.draft_tokens  # the copy was drafted from the prompt
        assert run(s, speculative=4)[0] == spec  # rejected drafts were rolled back: the rerun is the same
        text = rt.detokenize(spec)
        stop = text[len(text) // 2 : len(text) // 2 + 3]  # ends a verified run somewhere in the middle
        cut, _, finish = run(s, speculative=4, stop=[stop])
        assert finish == "stop" and len(cut) < 40 and cut == spec[: len(cut)]
        # An end-of-generation token in the middle of a verified run: the rest of the run is dropped.
        runs.clear()
        run(s, speculative=4)
        n_prompt = rt.count_tokens(COPY_PROMPT)
        # a run of >= 2 tokens whose first token does not occur earlier in the output
        at = next(a - n_prompt for a, r in runs if len(r) > 1 and r[0] not in spec[: a - n_prompt])
        cut, _, finish = run(s, speculative=4, stop_token_ids=[spec[at]])
        assert finish == "stop" and cut == spec[: at + 1]
        s.prefill_suffix(warmkv.SuffixInput(text="", append=True))
        assert s.explain().resident_tokens == rt.count_tokens(COPY_PROMPT) + len(cut)
        s.prefill_suffix(warmkv.SuffixInput(text="", append=True))  # the KV holds exactly what was emitted
        assert s.explain().resident_tokens == rt.count_tokens(COPY_PROMPT) + len(cut)
    if rt.backend.name == "native":
        # Verified drafts attend query by query, as decode steps do; float32 matmuls of a batch may still
        # round apart from one row's (int4 is exact: test_native_int4), but not on this prompt.
        assert spec == plain
    with pytest.raises(warmkv.InvalidConfig, match="greedy"):
        warmkv.DecodeConfig(speculative=4, temperature=0.7)
