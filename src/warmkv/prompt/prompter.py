"""The Prompter: one loaded model's prompts, from messages and text to the token ids a session takes.

It holds what turning a request into tokens needs for one model: the chat template chosen at load
(rendered as the template says, or keeping earlier turns' reasoning), the tool call format it implies,
the plain tokenizations of recent prompts, the generated turns remembered so a resent conversation
tokenizes to the model's own tokens, the fill-in-the-middle tokens, the vocabulary a constrained
decode is guided over, and embedding inputs (tokenized, then pooled by the backend). The runtime owns
one and delegates its prompt methods to it; it is apart from the runtime because none of this is
about sessions or KV. Backend calls are made under the model lock it is given, after the runtime's
loaded check; it imports nothing of the engine.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..backends.base import Backend
from ..config import ResolvedConfig
from ..errors import InvalidConfig, InvalidInput, Unsupported
from ..tools import Call, ToolFormat
from ..tools import resolve as resolve_tool_format
from ..types import PrefixInput
from .chat import ChatTemplate, TemplateChoice, check_template_kwargs, resolve_template
from .constraint import Constraint, Guide, build_tokenizer
from .embeddings import EmbedInput, l2_normalize, split_inputs
from .infill import ExtraFile, FimTokens, check_extra, find_fim_tokens, infill_tokens
from .reasoning import template_thinks
from .reasoning_history import KeptRenderer
from .text import as_text
from .tokens import spell
from .turn_memory import TurnMemory

RECENT_PROMPTS = 8  # plain tokenizations kept: a few sessions' stable prefixes


def _has_chatml(backend: Backend) -> bool:
    """Whether ChatML's markers are control tokens of this vocabulary (else they would read as text)."""
    for marker in ("<|im_start|>", "<|im_end|>"):
        ids = backend.tokenize(marker, add_bos=False, parse_special=True)
        if len(ids) != 1 or backend.token_bytes(ids[0]):
            return False
    return True


class Prompter:
    """Templates, tokenization and infill prompts for one backend.

    lock: the model lock; check_loaded raises when the model was unloaded (both the runtime's).
    add_bos: the runtime's BOS policy for text without its own.
    InvalidConfig when the configured prompt format or template cannot be used.
    """

    def __init__(
        self, backend: Backend, lock: AbstractContextManager[Any], check_loaded: Callable[[], None], *, add_bos: bool
    ) -> None:
        self.backend = backend
        self._lock = lock
        # Tokenization and its caches: after the model lock or alone (engine/runtime.py's lock order),
        # so that counting a request's tokens never waits for a forward.
        self.vocab_lock = threading.RLock()
        self._check_loaded = check_loaded
        self.default_add_bos = add_bos
        self._turns: TurnMemory | None = None  # generated turns' tokens, built on the first one remembered
        self._fim: FimTokens | None = None
        # The plain tokenizations of recent prompts: an agent resends the same prefix text every turn.
        self._recent_prompts: OrderedDict[tuple[str, bool, bool], tuple[int, ...]] = OrderedDict()
        c = self.config
        try:
            self.template_choice: TemplateChoice = resolve_template(
                c.prompt_format,
                given=c.chat_template,
                model_template=backend.info.chat_template,
                architecture=backend.info.architecture,
                has_chatml=_has_chatml(backend),
            )
        except InvalidInput as e:
            raise InvalidConfig(str(e)) from None
        self.template_source = self.template_choice.source
        self._template: ChatTemplate | None = None
        self._kept: KeptRenderer | None = None
        self._llg_tokenizer: Any = None  # llguidance's vocabulary, built on the first constrained decode

    @property
    def config(self) -> ResolvedConfig:
        return self.backend.config

    # -- chat templates -----------------------------------------------------------

    def chat_template(self) -> ChatTemplate:
        if self.template_source is None:
            raise Unsupported("chat", self.template_choice.why_none)
        if self._template is None:
            info = self.backend.info
            bos, eos = info.bos_token_id, info.eos_token_id
            self._template = ChatTemplate(
                self.template_source,
                bos_token=self.backend.token_text(bos) if bos is not None else "",
                eos_token=self.backend.token_text(eos) if eos is not None else "",
                adds_bos=self.default_add_bos,
            )
        return self._template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        thinking_history: str | None = None,
    ) -> str:
        """The prompt for a conversation. template_kwargs add to RuntimeConfig.chat_template_kwargs.

        thinking_history (None: the config's): "keep" lets earlier turns keep their reasoning where
        a reasoning template would drop it (reasoning_history.py); "template" renders as the template says.
        """
        template = self.chat_template()
        kw = self.template_kwargs(template_kwargs)
        args = {"add_generation_prompt": add_generation_prompt, "tools": tools, "template_kwargs": kw}
        mode = thinking_history or self.config.thinking_history
        if mode != "keep" or not template_thinks(template.source):
            return template.render(messages, **args)
        if self._kept is None:
            self._kept = KeptRenderer(template.render)
        return self._kept.render(messages, **args)

    def template_kwargs(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The variables a render passes the template: the config's, then a request's own."""
        return {**self.config.chat_template_kwargs, **check_template_kwargs(extra)}

    def tool_format(self, name: str = "auto") -> ToolFormat:
        """How replies call tools: `name`, or detected from the chat template ("auto")."""
        return resolve_tool_format(name, self.template_source)

    # -- tokens -------------------------------------------------------------------

    def tokenize(self, text: str | bytes, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        value = as_text(text, "text")
        with self.vocab_lock:
            self._check_loaded()
            bos = self.default_add_bos if add_bos is None else add_bos
            return self.prompt_tokens(value, add_bos=bos, parse_special=parse_special)

    def prompt_tokens(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        """text's tokens, generated turns taking the model's own tokens."""
        with self.vocab_lock:
            return self._prompt_tokens(text, add_bos=add_bos, parse_special=parse_special)

    def _prompt_tokens(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        memory = self._turns
        if parse_special and memory is not None and len(memory):
            return memory.tokenize(
                text, add_bos, lambda t, bos: self.backend.tokenize(t, add_bos=bos, parse_special=True)
            )
        key = (text, add_bos, parse_special)
        recent = self._recent_prompts
        tokens = recent.get(key)
        if tokens is None:
            tokens = recent[key] = tuple(self.backend.tokenize(text, add_bos=add_bos, parse_special=parse_special))
            if len(recent) > RECENT_PROMPTS:
                recent.popitem(last=False)
        else:
            recent.move_to_end(key)
        return list(tokens)

    def detokenize(self, tokens: Sequence[int]) -> str:
        n = self.backend.info.n_vocab
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
                raise InvalidInput(f"token id {t!r} out of range [0, {n})")
        with self.vocab_lock:
            self._check_loaded()
            return b"".join(self.backend.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    # -- generated turns ------------------------------------------------------------

    def remember_turn(self, prompt: Sequence[int], generated: Sequence[int], calls: Sequence[Call] = ()) -> str | None:
        """Keep a generated turn's tokens (and its tool calls' raw text) for the requests that resend it.

        prompt: the tokens it was generated after; generated: its tokens. Returns the turn's raw text
        (None when it cannot be kept, e.g. it ended inside a UTF-8 character).
        """
        with self.vocab_lock:
            self._check_loaded()
            if self._turns is None:
                b = self.backend
                control = {t: b.token_text(t) for t in range(b.info.n_vocab) if not b.token_bytes(t)}
                self._turns = TurnMemory(control, b.token_bytes, b.is_eog)
            memory = self._turns
        return memory.remember(prompt, generated, calls)

    def raw_turn(self, calls: Sequence[Call]) -> str | None:
        """The raw text of the generated turn that made these tool calls, if remembered and unchanged."""
        return None if self._turns is None else self._turns.raw_turn(calls)

    # -- fill in the middle ---------------------------------------------------------

    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens; Unsupported (naming what is missing) without them."""
        if self._fim is None:
            with self._lock:
                self._check_loaded()
                self._fim = find_fim_tokens(self.backend)
        return self._fim

    def infill_prompt(
        self, prefix: str, suffix: str, extra: Sequence[ExtraFile] = (), *, repo: str | None = None
    ) -> PrefixInput:
        """The infill prompt as a prefix: its tokens (user text never parses as control tokens) and its text."""
        prefix, suffix = as_text(prefix, "infill prefix"), as_text(suffix, "infill suffix")
        files = check_extra(extra)
        fim = self.fim_tokens()
        with self._lock:
            bos = self.default_add_bos
            tokens = infill_tokens(self.backend, fim, prefix, suffix, files, add_bos=bos, repo=repo)
            start = 1 if bos and tokens[0] == self.backend.info.bos_token_id else 0
            text = spell(self.backend, tokens[start:])
        return PrefixInput(text=text, tokens=tuple(tokens))

    # -- constrained decoding and embeddings ------------------------------------------

    def guide(self, constraint: Constraint) -> Guide:
        """A fresh constraint state for one decode; the model's vocabulary for it is built once."""
        with self._lock:
            self._check_loaded()
            if self._llg_tokenizer is None:
                self._llg_tokenizer = build_tokenizer(self.backend)
        return Guide(self._llg_tokenizer, constraint)

    def embedding_tokens(self, inputs: EmbedInput) -> list[list[int]]:
        """Token ids of each embedding input: texts get the BOS policy, id lists are taken as given."""
        return [self.tokenize(x, parse_special=False) if isinstance(x, str) else x for x in split_inputs(inputs)]

    def embed_tokens(self, token_lists: Sequence[Sequence[int]], *, normalize: bool = True) -> np.ndarray:
        """One row per token list: the backend's pooled embedding, L2-normalized unless normalize=False."""
        rows = []
        for tokens in token_lists:
            with self._lock:  # one input at a time: decode steps of other sessions go in between
                self._check_loaded()
                v = self.backend.embed(list(tokens))
            rows.append(l2_normalize(v) if normalize else v)
        return np.stack(rows).astype(np.float32)
