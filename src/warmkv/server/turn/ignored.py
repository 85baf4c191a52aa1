"""Fields accepted without effect: one table per API, and the response headers that name them.

A harness sends fields that cannot change a local model's output: client metadata, hints
for a hosted cache, hosted tools warmkv cannot run, reasoning controls for a model that
does not reason. Refusing them would refuse the harness; ignoring them silently would hide
it. So each is accepted, listed here with the reason (docs/agents.md holds the same tables,
docs/server.md Ollama's, and tests keep them equal), and named in `x-warmkv-ignored` on every
response whose request set it. What a tool's or a response format's JSON schema asks that the
grammar cannot enforce exactly is named there too (`tools.NAME.KEYWORD`, `response_format.KEYWORD`;
tools/schema_fit.py says why each is loosened). `anthropic-beta` values warmkv does not act on go
in `x-warmkv-ignored-betas`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping

from ...tools.schema_fit import LOOSENED

IGNORED_HEADER = "x-warmkv-ignored"
BETAS_HEADER = "x-warmkv-ignored-betas"

_NO_REASONING = (
    "the model's chat template has no reasoning mode (no think blocks): it answers without thinking, "
    "whatever the request asks"
)

MESSAGES: dict[str, str] = {
    "thinking": _NO_REASONING,
    "thinking.budget_tokens": "the model thinks until it closes its think block (or max_tokens ends the reply)",
    "output_config.effort": "reasoning templates have no effort levels: thinking is on or off (thinking.type)",
    "thinking_blocks": "thinking blocks sent back are not rendered: the model's template has no reasoning to read",
    "redacted_thinking": "a redacted_thinking block this server did not sign cannot be read; it is not rendered",
    "cache_control.scope": "one server has one cache: a marked prefix is kept (pinned) for this server's clients",
    "metadata": "client identity; only metadata.user_id is used, as the routing key when no header before it "
    "names one (its session_id, when it holds one, also picks the pooled session)",
    "service_tier": "a hosted capacity tier; one local server has one",
    "speed": "a hosted serving mode; one local server has one",
    "inference_geo": "a hosted region; the model runs here",
}

RESPONSES: dict[str, str] = {
    "reasoning": _NO_REASONING,
    "reasoning.effort": "reasoning templates have no effort levels: thinking is on, or off with effort 'none'",
    "reasoning.summary": "reasoning items carry the whole reasoning text; no summary is written",
    "include": "reasoning.encrypted_content: the model's template has no reasoning, so there are no items to sign",
    "client_metadata": "client identity and telemetry ids",
    "metadata": "kept with a stored response and returned with it; not rendered",
    "user": "client identity; it changes no output, and routes the request when no X-Session-Id header nor "
    "prompt_cache_key names the conversation",
    "safety_identifier": "client identity for hosted abuse checks",
    "service_tier": "a hosted capacity tier; one local server has one",
    "tools.web_search": "a hosted tool: the server would run it, and warmkv cannot; not offered to the model",
    "tools.web_search_preview": "a hosted tool (as web_search); not offered to the model",
    "tools.file_search": "a hosted tool over hosted vector stores; not offered to the model",
    "tools.code_interpreter": "a hosted sandbox; not offered to the model",
    "tools.image_generation": "a hosted image model; not offered to the model",
    "tools.computer_use_preview": "a hosted computer; not offered to the model",
    "tools.mcp": "a remote MCP server the hosted API would call; not offered to the model",
}

_HOW_OLLAMA_RUNS = "how Ollama runs a model (threads, GPU layers, memory, batches); warmkv's are set at serve time"

OLLAMA: dict[str, str] = {
    "truncate": "warmkv never cuts a prompt: one past the context is a 400 naming num_ctx",
    "shift": "warmkv never shifts the context: a reply ends at its end (done_reason length)",
    "think": "a level (low, medium, high, max) turns thinking on: chat templates have no levels",
    "top_logprobs": "without logprobs=true no log-probabilities come back",
    "options": "no option changes an embedding",
    **{
        f"options.{name}": _HOW_OLLAMA_RUNS
        for name in ("num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa", "low_vram")
    },
    "options.num_keep": "tokens Ollama keeps when it shifts the context, which warmkv never does",
    "options.draft_num_predict": "the draft length of a draft model; warmkv has none",
    **{
        f"options.{name}": "options Ollama itself no longer reads"
        for name in ("f16_kv", "vocab_only", "logits_all", "embedding_only", "penalize_newline")
    },
    **{f"options.{name}": "tunes mirostat, which is off" for name in ("mirostat_tau", "mirostat_eta")},
}

# Betas whose features warmkv implements; every other anthropic-beta value is named as ignored.
HONORED_BETAS = frozenset(
    {
        "context-management-2025-06-27",  # context_management edits
        "mid-conversation-system-2026-04-07",  # role "system" inside messages
        "fine-grained-tool-streaming-2025-05-14",  # tool input streams as it is decoded, always
        "structured-outputs-2025-11-13",  # output_format, as output_config.format: the reply follows the schema
    }
)


def headers(table: dict[str, str], names: Iterable[str], betas: Iterable[str] = ()) -> dict[str, str]:
    """The response headers for the ignored fields `names` (each a key of `table`) and beta values."""
    out: dict[str, str] = {}
    fields = list(dict.fromkeys(names))
    unknown = [n for n in fields if n not in table]
    if unknown:  # a route named a field the table (and so the docs) does not explain
        raise KeyError(f"ignored fields missing from the table: {unknown}")
    if fields:
        out[IGNORED_HEADER] = ", ".join(fields)
    skipped = [b for b in dict.fromkeys(betas) if b not in HONORED_BETAS]
    if skipped:
        out[BETAS_HEADER] = ", ".join(skipped)
    return out


def schema_names(where: str, keywords: Iterable[str]) -> list[str]:
    """The x-warmkv-ignored names of the schema keywords `where` (a tool, a response format) loosened:
    `tools.Edit.oneOf`, `response_format.propertyNames` (each keyword one of tools/schema_fit.LOOSENED)."""
    out = []
    for k in keywords:
        if k not in LOOSENED:  # the fitter named a keyword the table (and so the docs) does not explain
            raise KeyError(f"loosened schema keyword missing from the table: {k}")
        out.append(f"{where}.{k}")
    return out


def merge(headers: MutableMapping[str, str], more: Mapping[str, str]) -> None:
    """Add `more` to `headers`, joining the names of x-warmkv-ignored (and its betas) instead of replacing them."""
    for key, value in more.items():
        if key in (IGNORED_HEADER, BETAS_HEADER) and headers.get(key):
            names = [*headers[key].split(", "), *value.split(", ")]
            headers[key] = ", ".join(dict.fromkeys(names))
        else:
            headers[key] = value


def beta_values(header: str | None) -> list[str]:
    """The comma-separated values of an anthropic-beta header."""
    return [b.strip() for b in (header or "").split(",") if b.strip()]
