"""Chat templates: the model's own Jinja template, rendered as HF renders it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidInput, Unsupported

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")


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
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.adds_bos = adds_bos

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        msgs = normalize_messages(messages)
        try:
            text = self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise InvalidInput(f"chat template failed to render: {e}") from e
        # The runtime adds BOS by policy; a template that also writes it would double it.
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def resolve_template(prompt_format: str, model_template: str | None) -> str | None:
    """Template source for a prompt_format: auto (model's, else ChatML), chatml, or raw (none)."""
    if prompt_format == "auto":
        return model_template or CHATML
    if prompt_format == "chatml":
        return CHATML
    if prompt_format == "raw":
        return None
    raise InvalidInput(f"unknown prompt_format {prompt_format!r}; use auto, chatml or raw")
