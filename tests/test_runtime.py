"""Runtime helpers on the real model: tokens, complete, chat, lifecycle."""

from __future__ import annotations

import pytest

import warmkv
from warmkv.backends import ModelState

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step


def test_tokenize_roundtrip(rt: warmkv.Runtime) -> None:
    text = "def add(a, b):\n    return a + b  # ünïcödé 🎉"
    ids = rt.tokenize(text, add_bos=False)
    assert rt.count_tokens(text, add_bos=False) == len(ids)
    assert rt.detokenize(ids) == text
    assert rt.tokenize("<|im_end|>", add_bos=False) == [rt.tokenize("<|im_end|>", add_bos=False)[0]]


def test_spelled_lengths_count_what_spell_gives(rt: warmkv.Runtime) -> None:
    from warmkv.prompt.tokens import spell

    text = "<|im_start|>user\ndef f():\n    return 'ünïcödé 🎉 漢字'<|im_end|>\n"
    ids = rt.tokenize(text, add_bos=False)
    assert any(len(rt.backend.token_bytes(t)) and not _valid_utf8(rt.backend.token_bytes(t)) for t in ids)
    for a in range(0, len(ids), 3):
        for b in range(a, len(ids) + 1, 5):
            assert rt.spelled.count(ids[a:b]) == len(spell(rt.backend, ids[a:b])), (a, b)
    for bad in (-1, rt.info.n_vocab):
        with pytest.raises(warmkv.InvalidInput, match=str(bad)):
            rt.spelled.count([ids[0], bad])


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_resent_prompt_is_tokenized_once(rt: warmkv.Runtime) -> None:
    from warmkv.prompt.prompter import RECENT_PROMPTS

    calls: list[str] = []
    backend_tokenize = rt.backend.tokenize

    def counted(text: str, **kw: bool) -> list[int]:
        calls.append(text)
        return backend_tokenize(text, **kw)

    rt.backend.tokenize = counted  # type: ignore[method-assign]
    try:
        prompt = "You are a careful coding agent. " * 20 + "Resent."
        first = rt.tokenize(prompt, add_bos=True)
        first.append(0)  # a caller's list is its own: changing it changes no later answer
        assert rt.tokenize(prompt, add_bos=True) == first[:-1] and calls == [prompt]
        assert rt.tokenize(prompt, add_bos=False) == first[1:-1] and len(calls) == 2  # flags are part of the key
        for i in range(RECENT_PROMPTS):
            rt.tokenize(f"other prompt {i}", add_bos=True)
        assert rt.tokenize(prompt, add_bos=True) == first[:-1] and calls[-1] == prompt  # evicted: tokenized again
    finally:
        del rt.backend.tokenize


def test_info_and_state(rt: warmkv.Runtime) -> None:
    assert rt.info.architecture == "llama" and rt.info.n_vocab == 49152
    assert len(rt.info.file_digest) == 64
    assert rt.state in (ModelState.WARM, ModelState.ACTIVE)
    m = rt.manifest()
    assert dict(m.numerics)["kv_cache_type"] == rt.config.kv_cache_type


def test_complete_and_stream_agree(rt: warmkv.Runtime) -> None:
    prompt = "The capital of France is"
    done = rt.complete(prompt, max_tokens=8, temperature=0.0)
    assert isinstance(done, warmkv.Completion)
    assert done.finish_reason in ("stop", "length") and done.usage.completion_tokens <= 8
    streamed = list(rt.complete(prompt, max_tokens=8, temperature=0.0, stream=True))
    assert "".join(c.text for c in streamed) == done.text
    assert streamed[-1].usage is not None and streamed[-1].usage.cached_tokens > 0  # second call was warm


def test_interleaved_streams_from_one_thread_both_finish(rt: warmkv.Runtime) -> None:
    """A partly read stream holds the warm helper session; the next one gets a session of its own."""
    prompts = ("The capital of France is", "def fibonacci(n):")
    cfg = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [rt.complete(p, cfg) for p in prompts]
    streams = [rt.complete(p, cfg, stream=True) for p in prompts]
    texts, ends = ["", ""], [False, False]
    while not all(ends):  # one chunk of each in turn, from this thread
        for i, stream in enumerate(streams):
            if not ends[i]:
                chunk = next(stream)
                assert chunk.error is None
                texts[i] += chunk.text
                ends[i] = chunk.done
    assert texts == [c.text for c in alone]  # greedy: the same as each alone
    assert not rt._spares  # the second stream's session was closed with it
    assert rt.complete(prompts[0], cfg).text == alone[0].text


def test_a_second_stream_without_a_free_slot_is_refused(rt: warmkv.Runtime) -> None:
    cfg = warmkv.DecodeConfig(max_tokens=4, temperature=0.0, ignore_eos=True)
    sessions = []
    try:
        while True:
            try:
                sessions.append(rt.session())
            except warmkv.SessionLimit:
                break
        first = rt.complete("The capital of France is", cfg, stream=True)
        next(first)
        with pytest.raises(warmkv.SessionLimit):  # typed, never a wait on `first`
            next(rt.complete("def fibonacci(n):", cfg, stream=True))
        assert list(first)[-1].finish_reason == "length"
    finally:
        for s in sessions:
            s.close()
    assert isinstance(rt.complete("def fibonacci(n):", cfg), warmkv.Completion)


def test_chat_reuses_prefix_across_turns(rt: warmkv.Runtime) -> None:
    msgs = [
        {"role": "system", "content": "You answer in one short sentence. " * 10},
        {"role": "user", "content": "What is 2+2?"},
    ]
    first = rt.chat(msgs, max_tokens=12, temperature=0.0)
    assert first.text.strip()
    second = rt.chat(
        [*msgs, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3+3?"}],
        max_tokens=12,
        temperature=0.0,
    )
    assert second.usage.cached_tokens >= rt.count_tokens(rt.render_chat(msgs[:1], add_generation_prompt=False))


def test_chat_rejects_bad_messages(rt: warmkv.Runtime) -> None:
    with pytest.raises(warmkv.InvalidInput, match="non-empty list"):
        rt.chat([])
    with pytest.raises(warmkv.InvalidInput, match="role"):
        rt.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(warmkv.InvalidInput, match="content"):
        rt.chat([{"role": "user", "content": 5}])
    with pytest.raises(warmkv.InvalidInput):
        rt.complete("hi", max_tokens=-1)
    # the helper session is still usable after rejected calls
    assert rt.complete("Hello", max_tokens=2, temperature=0.0).usage.completion_tokens >= 1


def test_lifecycle_active_at_load_then_unloaded() -> None:
    r = warmkv.Runtime.load(backend="llamacpp", num_ctx=64, n_seq_max=1)
    assert r.state is ModelState.ACTIVE  # the context made at load: the first request does not wait for it
    s = r.session()
    assert r.state is ModelState.ACTIVE
    r.close()
    assert r.state is ModelState.UNLOADED and s.closed
    with pytest.raises(warmkv.ModelUnloaded):
        r.session()
    with pytest.raises(warmkv.SessionClosed):
        s.ensure_prefix("hello")


def test_tokens_are_counted_while_a_forward_holds_the_model(rt: warmkv.Runtime) -> None:
    """Counting a request's tokens takes the vocabulary's lock, not the model's: it never waits for a
    forward (held here by another thread), and still sees the turns the model generated."""
    import threading

    holding, done = threading.Event(), threading.Event()

    def forward() -> None:
        with rt.lock:
            holding.set()
            done.wait(30)

    t = threading.Thread(target=forward)
    t.start()
    try:
        assert holding.wait(30)
        got: list[int] = []
        counter = threading.Thread(target=lambda: got.append(rt.count_tokens("The capital of France is Paris.")))
        counter.start()
        counter.join(10)
        assert got and got[0] > 3, "token counting waited for the model lock"
        assert rt.detokenize(rt.tokenize("Paris", add_bos=False)) == "Paris"
    finally:
        done.set()
        t.join(30)
