"""Which template a model chats with: its own, its family's, one the user gives; never ChatML
for a vocabulary without ChatML's tokens. On the real default model and the real Gemma 3 270M."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import warmkv
from warmkv.errors import InvalidConfig, InvalidInput, Unsupported
from warmkv.prompt.chat import CHATML, GEMMA, ChatTemplate, check_template_kwargs, resolve_template

NO_TIERS = {"prefix_cache_mb": 0, "kv_store_mb": 0}
QWEN3 = Path(__file__).parent / "fixtures" / "templates" / "qwen3.jinja"


@pytest.fixture(scope="module")
def gemma() -> Iterator[warmkv.Runtime]:
    rt = warmkv.Runtime.load("gemma3-270m", backend="llamacpp", num_ctx=512, n_seq_max=1, **NO_TIERS)
    yield rt
    rt.close()


def test_gemma_chats_in_its_own_format(gemma: warmkv.Runtime) -> None:
    assert gemma.info.chat_template is None  # the GGUF carries none
    assert gemma.template_choice.origin == "family:gemma3" and gemma.template_choice.source == GEMMA
    prompt = gemma.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    # The PyPI build is the base model (no instruction tuning): its answer is not checked, only that
    # it no longer continues a ChatML conversation ("<|im_end|>\n<|im_start|>administrator").
    reply = gemma.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0)
    assert "<|im_" not in reply.text and "administrator" not in reply.text


def test_chatml_is_refused_for_a_vocabulary_without_it() -> None:
    with pytest.raises(InvalidConfig, match="--chat-template-file"):
        warmkv.Runtime.load("gemma3-270m", backend="llamacpp", num_ctx=256, prompt_format="chatml", **NO_TIERS)


def test_a_given_template_and_its_defaults_are_used_and_digested() -> None:
    own = warmkv.Runtime.load(backend="llamacpp", num_ctx=256, n_seq_max=1, **NO_TIERS)
    source = QWEN3.read_text()
    given = warmkv.Runtime.load(
        backend="llamacpp", num_ctx=256, n_seq_max=1, chat_template=source,
        chat_template_kwargs={"enable_thinking": False}, **NO_TIERS,
    )  # fmt: skip
    try:
        assert given.template_choice.origin == "given" and own.template_choice.origin == "model"
        assert given.manifest().chat_template_digest != own.manifest().chat_template_digest
        msgs = [{"role": "user", "content": "hi"}]
        assert given.render_chat(msgs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        # A request's own variables override the defaults.
        assert given.render_chat(msgs, template_kwargs={"enable_thinking": True}).endswith("assistant\n")
    finally:
        own.close()
        given.close()


def test_raw_has_no_chat() -> None:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=256, n_seq_max=1, prompt_format="raw", **NO_TIERS)
    try:
        with pytest.raises(Unsupported, match="raw"):
            rt.render_chat([{"role": "user", "content": "hi"}])
    finally:
        rt.close()


def test_bad_template_config_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="chat_template_kwargs"):
        warmkv.RuntimeConfig(chat_template_kwargs={"x": object()})
    with pytest.raises(InvalidConfig, match="chat_template"):
        warmkv.RuntimeConfig(chat_template="")
    with pytest.raises(InvalidConfig, match="thinking_history"):
        warmkv.RuntimeConfig(thinking_history="drop")


def test_template_resolution() -> None:
    assert resolve_template("auto", given="X", model_template="Y").origin == "given"
    assert resolve_template("auto", model_template="Y").source == "Y"
    gemma = resolve_template("auto", architecture="gemma3", has_chatml=False)
    assert (gemma.source, gemma.origin) == (GEMMA, "family:gemma3")
    none = resolve_template("auto", architecture="phi3", has_chatml=False)
    assert none.source is None and "--chat-template-file" in none.why_none
    with pytest.raises(InvalidInput, match="--chat-template-file"):
        resolve_template("chatml", architecture="gemma3", has_chatml=False)
    assert resolve_template("auto", architecture="llama", has_chatml=True).source == CHATML


def test_gemma_format() -> None:
    t = ChatTemplate(GEMMA, bos_token="<bos>", adds_bos=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    assert t.render(msgs) == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    msgs += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert "<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye" in t.render(msgs)
    # Messages in a row on one side share a turn (Claude Code's system reminders, tool results).
    rows = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, {"role": "tool", "content": "c"}]
    assert t.render(rows) == "<start_of_turn>user\na\n\nb\n\nc<end_of_turn>\n<start_of_turn>model\n"
    # A turn renders the same whatever follows it, so the prompt grows only at its end.
    assert t.render(msgs, add_generation_prompt=False) in t.render([*msgs, {"role": "assistant", "content": "x"}])


def test_template_kwargs_are_checked() -> None:
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(InvalidInput, match="messages"):
        check_template_kwargs({"messages": []})
    with pytest.raises(InvalidInput, match="must be an object"):
        check_template_kwargs(["enable_thinking"])  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="namespace"):  # a helper the template calls
        check_template_kwargs({"namespace": 1})
    with pytest.raises(InvalidConfig, match="tools"):
        warmkv.RuntimeConfig(chat_template_kwargs={"tools": 1})
    t = ChatTemplate(QWEN3.read_text(), adds_bos=False)
    off = t.render([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
