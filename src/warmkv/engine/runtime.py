"""The runtime: loads one model into a backend, opens sessions, offers helpers.

Lock order (the one place it is written; other modules refer here):

1. A session's op lock (`Session._op`: one operation on that session at a time)
   comes before the model lock (`Runtime.lock`: every backend call, the KV pool,
   the memory tier). Never take an op lock while holding the model lock: close,
   restore and fork's error path take the op lock first, then the model lock.
   A thread may hold two op locks only as fork does: its own session's, then the
   op lock of the child it has just created and nobody else can reach yet.
2. The model lock may be let go and taken back inside an operation (prefill
   chunks, the disk read of a tier lookup) with the op lock still held, so a
   session's state is consistent at every such point.
3. The KV store's writer thread (cache.store_writer) takes no lock but its own
   and the store's. Its queue is never waited on while holding the model lock:
   spills copy the KV bytes under the lock and queue them without waiting
   (dropped when the queue is full); snapshot writes, flush and close wait with
   only the op lock held (or none). The writer refuses, with RuntimeError, a
   waiting call from a thread that holds the model lock.
4. Store reads (restore, disk-tier hits) run without the model lock: the blob is
   read and verified first, then the lock is taken to load it.
5. Readers that must not wait for a forward take no lock at all: `Runtime.stats`,
   `Scheduler.stats` and `Session.resident` are frozen records their owners replace
   (warmkv.engine.stats), the runtime's and the sessions' under the model lock. The server's
   event loop never takes the model lock: /health, /metrics and the pool's router read
   those, and sessions are opened and closed in worker threads.

6. The prompter's vocabulary lock (`Prompter.vocab_lock`: tokenization and its caches) is
   taken alone or after the model lock, and takes nothing after it: counting or tokenizing a
   request never waits for a forward, and close takes it, after the model lock, to free the
   vocabulary.

The decode Scheduler takes the model lock, and its own condition only outside it.
Lock-free helpers: `Session.cancel`, `Session.resident`; `Session.token_ids` takes
the model lock only. `Session.hold`/`let_go` (the turn a session runs) take only their own
small lock, which is taken last and takes nothing (the Scheduler's submit holds its condition
then, a step the model lock), as do `KeyMemo`'s and `prompt.tokens.Continuations`' locks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import numpy as np

from ..backends import Backend, BackendOptions, KVMemory, ModelInfo, ModelState, load_backend
from ..backends.choose import AUTO, BackendChoice
from ..cache.disk.types import Snapshot
from ..config import DecodeConfig, ResolvedConfig, RuntimeConfig
from ..errors import InvalidConfig, ModelUnloaded, Unsupported
from ..manifest import ContextManifest
from ..prompt.chat import ChatTemplate, TemplateChoice
from ..prompt.constraint import Constraint, Guide
from ..prompt.embeddings import EmbedInput
from ..prompt.infill import ExtraFile, FimTokens
from ..prompt.prompter import Prompter
from ..prompt.tokens import SpelledLengths
from ..tools import Call, ToolFormat
from ..types import PinnedPrefix, PrefixInput, StreamChunk
from . import load_options, pool_pressure, prefix_planner, runtime_tiers, session_copies
from .completions import Completion, Completions
from .model_lock import ModelLock
from .session import Session
from .stats import RuntimeStats
from .tiers import KVTiers


class Runtime:
    """One loaded model. Use :meth:`load`; close it (or use `with`) when done."""

    def __init__(self, backend: Backend, choice: BackendChoice | None = None) -> None:
        self.backend = backend
        self.backend_choice = choice or BackendChoice(backend.name, "asked for")
        if backend.config.reuse_mode == "chunks":
            why = backend.chunk_support()
            if why is not None:
                backend.close()
                raise Unsupported("reuse_mode='chunks'", why)
        # One lock per model: llama.cpp contexts and the KV pool are not thread-safe.
        self._model_lock = ModelLock()
        self.lock = self._model_lock.lock
        self._sessions: dict[str, Session] = {}
        self.spelled = SpelledLengths(backend)  # divergence offsets without spelling the whole prompt
        self._completions = Completions(self)  # complete, chat and infill on the runtime's own sessions
        c = self.config
        self.default_add_bos = backend.info.add_bos and not c.disable_bos
        try:  # the chat template, tokenization caches, turn memory and infill prompts
            self._prompter = Prompter(backend, self.lock, self._check_loaded, add_bos=self.default_add_bos)
        except InvalidConfig:
            backend.close()
            raise
        template = self._prompter.template_source
        try:  # the warm tiers the config asks for, where the backend can keep KV
            self.tiers: KVTiers | None = runtime_tiers.build(backend, c, self._model_lock)
        except BaseException:
            backend.close()
            raise
        self.parked = 0  # idle sessions whose KV moved to the tiers because the pool ran short
        self.weight_bytes = backend.weight_bytes()  # the weights in memory, fixed once loaded
        backend.set_reclaimer(self._reclaim)
        self._manifests = {
            bos: ContextManifest.build(
                model_digest=backend.info.file_digest,
                tokenizer_digest=backend.info.tokenizer_digest,
                chat_template=template,
                numerics=backend.numerics(),
                add_bos=bos,
                backend=backend.name,
            )
            for bos in (False, True)
        }
        self.stats = RuntimeStats(backend.state, 0, backend.kv_memory())

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill forward ran (model lock held): the measured rate a remote tier read must beat."""
        runtime_tiers.note_prefill(self.tiers, tokens, seconds)

    def publish_stats(self) -> None:
        """Replace `stats` with what the runtime holds now (call with the model lock held)."""
        b = self.backend
        if b.state is ModelState.UNLOADED:  # the backend cannot say any more: nothing is held
            kv = replace(self.stats.kv_memory, allocated=False, held_tokens=0)
        else:
            kv = b.kv_memory()
        self.stats = RuntimeStats(b.state, len(self._sessions), kv, self.parked)

    def _reclaim(self) -> bool:
        """The KV pool is short (the backend's reclaimer, model lock held): give blocks back (pool_pressure.py)."""
        return pool_pressure.reclaim(self)

    def reclaimable_tokens(self, kv: KVMemory) -> int:
        """About how many tokens the KV pool gets back when it runs short (model lock held; pool_pressure.py)."""
        return pool_pressure.reclaimable_tokens(self, kv)

    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        backend: str = AUTO,
        config: RuntimeConfig | None = None,
        backend_options: BackendOptions | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Runtime:
        """Load a model (default: the bundled SmolLM2-135M-Instruct GGUF).

        backend is "native", "llamacpp" or "auto" (the default: native where its C++ loop runs the
        model on 4-bit weights, llama.cpp otherwise; `backend_choice` says which and why).
        Options are RuntimeConfig fields (num_ctx=8192, kv_cache_type="q8_0", ...) and the
        backend's own (NativeOptions: compute_dtype, device, cpp_decode, kv_cache_mb;
        LlamaCppOptions: use_mmap, use_mlock), by name or as backend_options (a record or a mapping).
        """
        path, cfg, choice, opts = load_options.resolve(model, backend, config, backend_options, options)
        return cls(load_backend(choice.name, str(path), cfg, opts), choice)

    # -- facts ------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self.backend.info

    @property
    def config(self) -> ResolvedConfig:
        return self.backend.config

    @property
    def state(self) -> ModelState:
        return self.backend.state

    def kv_memory(self) -> KVMemory:
        """What the KV cache costs: bytes, and sequences x tokens per sequence (`stats` without the lock)."""
        with self.lock:
            self._check_loaded()
            return self.backend.kv_memory()

    def manifest(self, add_bos: bool | None = None) -> ContextManifest:
        return self._manifests[self.default_add_bos if add_bos is None else bool(add_bos)]

    def pin_prefix(
        self, digest: str, tokens: Sequence[int], seconds: float, salt: str | None = None, upto: int | None = None
    ) -> PinnedPrefix:
        """Keep tokens[:upto]'s prefix (under a cache salt) ahead of LRU for seconds, a client's cache hint, in
        memory and, for a long one, on disk (KVTiers.pin); the tokens pinned in each. No model lock."""
        tiers = self.tiers
        return PinnedPrefix() if tiers is None else tiers.pin(digest, tokens, seconds, salt, upto)

    def reuse_mode(self, mode: str | None = None) -> str:
        """The reuse mode a prompt asked for (None: the runtime's), checked against what the backend can."""
        return prefix_planner.reuse_mode(self.backend, mode)

    def _check_loaded(self) -> None:
        if self.backend.state is ModelState.UNLOADED:
            raise ModelUnloaded("the runtime was closed")

    # -- sessions -----------------------------------------------------------------

    def session(self) -> Session:
        """Open a session with its own resident sequence; SessionLimit past n_seq_max."""
        with self.lock:
            self._check_loaded()
            s = Session(self, self.backend.acquire_seq())
            self._sessions[s.id] = s
            self.publish_stats()
            return s

    def restore(self, name: str) -> Session:
        """A new session holding a snapshot's context, under this runtime's manifest only (session_copies.py).

        The snapshot is read and verified before the model lock is taken (lock order: module doc).
        """
        return session_copies.restore(self, name)

    def restore_snapshot(self, snap: Snapshot) -> Session:
        """A new session holding a verified snapshot's context (read from the disk store or the remote
        tier); ManifestMismatch unless it was taken under this runtime's manifest. Not under the model lock."""
        return session_copies.restore_snapshot(self, snap)

    @property
    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def _release(self, session: Session, seq: int) -> None:
        self._sessions.pop(session.id, None)
        if self.backend.state is not ModelState.UNLOADED:
            self.backend.release_seq(seq)
        self.publish_stats()

    # -- prompts (prompt/prompter.py) -----------------------------------------------

    @property
    def template_choice(self) -> TemplateChoice:
        """The chat template chosen at load, where it came from, or why there is none."""
        return self._prompter.template_choice

    def tokenize(self, text: str | bytes, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return self._prompter.tokenize(text, add_bos=add_bos, parse_special=parse_special)

    def prompt_tokens(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        """text's tokens, generated turns taking the model's own tokens (call with the model lock held)."""
        return self._prompter.prompt_tokens(text, add_bos=add_bos, parse_special=parse_special)

    def remember_turn(self, prompt: Sequence[int], generated: Sequence[int], calls: Sequence[Call] = ()) -> str | None:
        """Keep a generated turn's tokens (and its tool calls' raw text) for the requests that resend it."""
        return self._prompter.remember_turn(prompt, generated, calls)

    def raw_turn(self, calls: Sequence[Call]) -> str | None:
        """The raw text of the generated turn that made these tool calls, if remembered and unchanged."""
        return self._prompter.raw_turn(calls)

    def tool_format(self, name: str = "auto") -> ToolFormat:
        """How replies call tools: `name`, or detected from the chat template ("auto")."""
        return self._prompter.tool_format(name)

    def count_tokens(self, text: str | bytes, *, add_bos: bool | None = None) -> int:
        return len(self.tokenize(text, add_bos=add_bos))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._prompter.detokenize(tokens)

    def chat_template(self) -> ChatTemplate:
        return self._prompter.chat_template()

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
        return self._prompter.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
            thinking_history=thinking_history,
        )

    def template_kwargs(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The variables a render passes the template: the config's, then a request's own."""
        return self._prompter.template_kwargs(extra)

    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens; Unsupported (naming what is missing) without them."""
        return self._prompter.fim_tokens()

    def infill_prompt(
        self, prefix: str, suffix: str, extra: Sequence[ExtraFile] = (), *, repo: str | None = None
    ) -> PrefixInput:
        """The infill prompt as a prefix: its tokens (user text never parses as control tokens) and its text."""
        return self._prompter.infill_prompt(prefix, suffix, extra, repo=repo)

    # -- constrained decoding and embeddings -----------------------------------------

    def guide(self, constraint: Constraint) -> Guide:
        """A fresh constraint state for one decode; the model's vocabulary for it is built once."""
        return self._prompter.guide(constraint)

    def embedding_tokens(self, inputs: EmbedInput) -> list[list[int]]:
        """Token ids of each embedding input: texts get the BOS policy, id lists are taken as given."""
        return self._prompter.embedding_tokens(inputs)

    def embed(self, inputs: EmbedInput, *, normalize: bool = True) -> np.ndarray:
        """One row per input ([n, n_embd] float32): the mean of the model's final-norm hidden
        states over the input's tokens, L2-normalized unless normalize=False. Sessions are untouched."""
        return self.embed_tokens(self.embedding_tokens(inputs), normalize=normalize)

    def embed_tokens(self, token_lists: Sequence[Sequence[int]], *, normalize: bool = True) -> np.ndarray:
        return self._prompter.embed_tokens(token_lists, normalize=normalize)

    # -- helper completions (completions.py) -----------------------------------------

    def complete(
        self, prompt: str | bytes, config: DecodeConfig | None = None, *, stream: bool = False, **decode: Any
    ) -> Completion | Iterator[StreamChunk]:
        """Generate after a raw prompt, reusing the runtime's own warm sequence (completions.py)."""
        return self._completions.complete(prompt, config, stream=stream, **decode)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        config: DecodeConfig | None = None,
        *,
        stream: bool = False,
        **decode: Any,
    ) -> Completion | Iterator[StreamChunk]:
        """Chat through the model's template; consecutive turns reuse the shared prefix."""
        return self._completions.chat(messages, config, stream=stream, **decode)

    def infill(
        self,
        prefix: str,
        suffix: str,
        extra: Sequence[ExtraFile] = (),
        config: DecodeConfig | None = None,
        *,
        repo: str | None = None,
        stream: bool = False,
        **decode: Any,
    ) -> Completion | Iterator[StreamChunk]:
        """Fill in the code between prefix and suffix (the model's FIM tokens; extra files come first)."""
        return self._completions.infill(prefix, suffix, extra, config, repo=repo, stream=stream, **decode)

    @property
    def _spares(self) -> set[Session]:
        """The helper streams' own sessions now open (while another holds the warm helper)."""
        return self._completions.spares

    # -- lifecycle ------------------------------------------------------------------

    def yield_model_lock(self) -> None:
        """Let a thread waiting for the model lock take one turn, between prefill chunks (model_lock.py)."""
        self._model_lock.yield_turn()

    def model_unlocked(self) -> AbstractContextManager[None]:
        """Let go of the model lock completely for the block, if held (model_lock.py)."""
        return self._model_lock.unlocked()

    def spill_to_disk(self, timeout: float | None = None) -> tuple[int, bool]:
        """Write the memory tier's KV to the disk store and drop it from memory, for a server about to
        stop (or a model about to unload): (tokens queued, whether every queued write, these and earlier
        ones, finished within timeout). Without a store: nothing moves. Not under the model lock."""
        return runtime_tiers.spill_to_disk(self, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued KV store write is on disk; False on timeout. Not under the model lock."""
        return runtime_tiers.flush(self.tiers, timeout)

    def close(self) -> None:
        # Sessions first, without the model lock: closing one waits for its running call.
        for s in list(self._sessions.values()):
            s.close()
        self._completions.close()
        tiers = None
        with self.lock:
            self.backend.set_reclaimer(None)
            if self.tiers is not None:
                self.tiers.spill_all()  # copies the memory tier's KV while the backend is alive
                tiers, self.tiers = self.tiers, None
            with self._prompter.vocab_lock:  # no tokenization is under way in the vocabulary freed
                self.backend.close()
            self.publish_stats()
        if tiers is not None:
            tiers.close()  # writes to disk without the model lock

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
