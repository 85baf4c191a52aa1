"""Chat templates: the model's own Jinja template, rendered as HF renders it.

Which template a runtime uses (resolve_template): the one the user gives
(RuntimeConfig.chat_template, `--chat-template-file`), else the model's own, else its
family's known format when the file carries none (Gemma's GGUFs often do not), else
ChatML when the vocabulary has ChatML's control tokens; otherwise chat is refused with
an error that says how to give one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidInput, Unsupported

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's turn format (gemma, gemma2, gemma3): `model` is the assistant's role, a system
# message is folded into the first user turn, and turns alternate. Messages in a row on one
# side (a harness's mid-conversation system message after the user's, several tool results)
# share one turn, a blank line apart, where Gemma's own template would refuse them.
GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] in ('system', 'developer') %}"
    "{% set first_prefix = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% set ns = namespace(side='') %}"
    "{% for message in turns %}"
    "{% set side = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{% if side == ns.side %}{{ '\\n\\n' }}{% else %}"
    "{% if ns.side %}<end_of_turn>\n{% endif %}{{ '<start_of_turn>' + side + '\\n' }}{% endif %}"
    "{{ (first_prefix if loop.first else '') + message['content'] | trim }}"
    "{% set ns.side = side %}"
    "{% endfor %}"
    "{% if ns.side %}<end_of_turn>\n{% endif %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FAMILY_TEMPLATES = {"gemma": GEMMA, "gemma2": GEMMA, "gemma3": GEMMA}
ROLES = ("system", "user", "assistant", "tool", "developer")
# Names the template's own variables; a request's chat_template_kwargs may not set them.
# With the helpers every template may call (warmkv's and Jinja's own globals).
RESERVED_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
    | set(jinja2.Environment().globals)
)


def _raise(message: str) -> None:
    raise InvalidInput(f"chat template rejected the messages: {message}")


def content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInput(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise InvalidInput(f"messages[{index}].content must be a string, got {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidInput("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidInput(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidInput(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        out.append({**m, "role": role, "content": content_text(m.get("content"), i)})
    return out


def _fold_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    if message.get("role") != "assistant" or not isinstance(reasoning, str) or not reasoning:
        return message
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    out["content"] = f"<think>\n{reasoning}\n</think>\n\n{message.get('content') or ''}"
    return out


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", adds_bos: bool = True) -> None:
        """adds_bos: the runtime prepends BOS itself, so a BOS the template writes first is dropped.

        Without that policy the template's text stays whole: SmolLM2's BOS is <|im_start|>,
        which its template writes first and nothing else would add.
        """
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise Unsupported("chat template", f"the model's template does not compile: {e}") from e
        self.source = source
        # A template that does not read reasoning_content gets an assistant turn's reasoning
        # inside its content, as the model wrote it; otherwise it would vanish from the prompt.
        self.reads_reasoning = "reasoning_content" in source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.adds_bos = adds_bos

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """template_kwargs: extra variables for the template (enable_thinking...), as transformers passes them."""
        msgs = normalize_messages(messages)
        if not self.reads_reasoning:
            msgs = [_fold_reasoning(m) for m in msgs]
        extra = check_template_kwargs(template_kwargs)
        try:
            text = self._template.render(
                **extra,
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # a variable of the wrong type, too
            raise InvalidInput(f"chat template failed to render: {e}") from e
        # The runtime adds BOS by policy; a template that also writes it would double it.
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def check_template_kwargs(kwargs: Mapping[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra template variables: a JSON object whose keys are not the template's own variables."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidInput(f"{param} must be an object, got {type(kwargs).__name__}", param=param)
    clash = sorted(RESERVED_KWARGS & set(kwargs))
    if clash:
        raise InvalidInput(f"{param} may not set {', '.join(clash)}: warmkv passes them itself", param=param)
    try:
        json.dumps(dict(kwargs))
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{param} must hold JSON values only: {e}", param=param) from None
    return dict(kwargs)


@dataclass(frozen=True)
class TemplateChoice:
    """The template a runtime renders chat with, and where it came from (for `warmkv info`)."""

    source: str | None  # None: no chat (raw prompts only)
    origin: str  # given, model, family:<arch>, chatml, raw, or none
    why_none: str = ""  # when source is None: what chat answers


def resolve_template(
    prompt_format: str,
    *,
    given: str | None = None,
    model_template: str | None = None,
    architecture: str = "",
    has_chatml: bool = True,
) -> TemplateChoice:
    """The template for a prompt_format: auto (given, model's, family's, ChatML), chatml, or raw (none).

    has_chatml: the vocabulary has <|im_start|> and <|im_end|> as tokens; ChatML is never used
    for a model that would read its markers as plain text.
    """
    no_chatml = (
        f"this {architecture or 'model'}'s vocabulary has no ChatML tokens (<|im_start|>, <|im_end|>) and the "
        "model file carries no chat template; give one with --chat-template-file PATH (RuntimeConfig.chat_template)"
    )
    if prompt_format == "raw":
        return TemplateChoice(None, "raw", "prompt_format='raw' has no chat template")
    if prompt_format == "chatml":
        if not has_chatml:
            raise InvalidInput(f"prompt_format='chatml': {no_chatml}")
        return TemplateChoice(CHATML, "chatml")
    if prompt_format != "auto":
        raise InvalidInput(f"unknown prompt_format {prompt_format!r}; use auto, chatml or raw")
    if given:
        return TemplateChoice(given, "given")
    if model_template:
        return TemplateChoice(model_template, "model")
    if architecture in FAMILY_TEMPLATES:
        return TemplateChoice(FAMILY_TEMPLATES[architecture], f"family:{architecture}")
    if has_chatml:
        return TemplateChoice(CHATML, "chatml")
    return TemplateChoice(None, "none", no_chatml)
