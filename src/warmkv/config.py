"""Frozen, validated configuration.

"auto" values are resolved by :meth:`RuntimeConfig.resolved` before a backend
sees the config; nothing mutates a config after construction.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .cache.remote.seal import read_key
from .cache.remote.types import check_prefill_rate, parse_remote_url
from .errors import InvalidConfig, InvalidInput
from .prompt.chat import check_template_kwargs
from .prompt.constraint import Constraint

# llama.cpp names; the native engine also takes f32 and bf16 (each backend rejects what it can't store).
# "auto": each backend's own default (RuntimeConfig.resolved's kv_auto).
KV_CACHE_TYPES = ("auto", "f16", "q8_0", "q4_0", "f32", "bf16")
QUANTIZED_KV = ("q8_0", "q4_0")
FLASH_ATTN = ("auto", "on", "off")
PROMPT_FORMATS = ("auto", "chatml", "raw")
# How earlier assistant turns' reasoning is rendered. "keep": every turn keeps the reasoning the
# model wrote, where it stands, so the prompt only grows and a tool loop stays warm across the
# next user message. "template": exactly as the chat template says (most drop it there).
THINKING_HISTORY = ("keep", "template")
# "exact": reuse only the resident common prefix (warm == cold). "chunks": also move runs of
# resident KV that shifted position, recomputing the first tokens of each (approximate).
REUSE_MODES = ("exact", "chunks")
MIN_CHUNK_TOKENS = 16
# Sliding-window layers (e.g. Gemma 3): "window" keeps about n_swa + n_ubatch cells for them
# and checkpoints their state so a cut-back sequence stays exact; "full" keeps every position.
SWA_CACHES = ("window", "full")
# Upper bound for num_ctx when the caller leaves it to the model: keeps the
# preallocated KV modest on small machines while fitting agent contexts.
DEFAULT_MAX_CTX = 4096
# `warmkv serve` out of the box: 20 resident sessions, 16 of them the pool for plain /v1
# requests (16 concurrent streams) and SESSIONS_RESERVED for /v1/sessions.
SERVE_N_SEQ_MAX = 20
# A server's prefill piece: against 256, a long prompt beside running streams stalls them 3.1x
# less (236 vs 729 ms, native int4, 2 cores) and prefills 1.09x slower alone.
SERVE_PREFILL_CHUNK = 64
# A server's step budget: decode rows, then prefill. Native int4 cuts pieces to it (depth-weighted)
# inside the decode forward. A 3,000-token prompt beside 3 streams (docs/benchmarks.md, concurrent
# streams): 13 held their gaps to 2.3-2.9x their own pace at p99 and took 2.0-2.5x its time alone
# on a 2-thread Zen 3 EPYC (5 runs), where 12 took 2.35-2.71x (3 of 4 runs over 2.5x) and 14
# stalled or took more in 1 of 5; on Zen 1, 12 gave 2.5-3.0x / 2.4-2.5x and 14 3.0-3.1x / 2.1x.
# 64 stalled them 8.6x and took 1.27x. Where pieces cannot be cut (llama.cpp), one whole piece
# still runs each step.
SERVE_STEP_TOKENS = 13
SESSIONS_RESERVED = 4


def _int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        hi = f" and <= {maximum}" if maximum is not None else ""
        raise InvalidConfig(f"{name} must be >= {minimum}{hi}, got {value}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidConfig(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How a model is loaded and its context laid out.

    num_ctx is the context window of one session; the backend reserves KV for
    n_seq_max sessions of that size. None means "the model's training context,
    capped at 4096".
    """

    num_ctx: int | None = None
    num_batch: int = 512
    num_ubatch: int = 512
    num_threads: int | None = None
    n_gpu_layers: int = 0
    flash_attn: str = "auto"
    # "auto": q8_0 on the native engine where its int8-score attention kernel runs (16K tokens deep a
    # warm turn 1.5x sooner than f16, half the bytes), else f16 (see the backends' kv_auto)
    kv_cache_type: str = "auto"
    n_seq_max: int = 4
    prompt_format: str = "auto"
    disable_bos: bool = False
    # The chat template's source (None: the model's own, else its family's, else ChatML), and extra
    # variables every render gets (enable_thinking...); requests may add their own.
    chat_template: str | None = field(default=None, repr=False)
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    thinking_history: str = "keep"
    # Warm tiers (no effect on numerics, so not in the manifest).
    prefix_cache_mb: int = 1024
    pin_share: float = 0.5  # the part of the memory and disk tiers clients' pins (cache hints) may hold
    kv_store_dir: str | None = None
    kv_store_mb: int = 8192
    cache_block_tokens: int = 64
    # The remote tier below the disk (Redis or Valkey, shared by several nodes): redis://HOST:PORT/DB
    # or rediss:// (TLS); a password in the URL or in $WARMKV_KV_REMOTE_PASSWORD. None: no remote tier.
    kv_remote: str | None = field(default=None, repr=False)  # the URL may hold a password
    # The fleet key sealing the remote tier's values (cache/remote/seal.py): a file holding it, else
    # $WARMKV_KV_REMOTE_KEY (never the key itself here: a command line shows in `ps`). None and no
    # variable: the remote tier is trusted as-is.
    kv_remote_key_file: str | None = None
    kv_remote_timeout_ms: int = 200  # connect and read timeout of a probe or read; spills get 10x
    # Tokens/s a remote read must beat to be used; None: this runtime's measured prefill rate.
    kv_remote_prefill_rate: float | None = None
    # Tokens prefilled between chances for other sessions' decode steps to run.
    prefill_chunk: int = 256
    # Prompt reuse: "chunks" loads the backend so KV runs can move (see REUSE_MODES).
    reuse_mode: str = "exact"
    chunk_min_tokens: int = 64  # shortest moved run
    chunk_recompute: int = 8  # tokens recomputed at the start of each moved run
    # Sliding-window models only (see SWA_CACHES).
    swa_cache: str = "window"
    # Layers that cannot be cut back (sliding-window layers on a window cache, recurrent layers of
    # hybrid models): a checkpoint of their state is taken where a prompt ends and each time a
    # prefill passes a multiple of checkpoint_tokens (0: at prompt ends only); a partial hit
    # restores the nearest one at or before it.
    checkpoint_tokens: int = 512

    def __post_init__(self) -> None:
        if self.num_ctx is not None:
            _int("num_ctx", self.num_ctx, minimum=16, maximum=1 << 20)
        _int("num_batch", self.num_batch, minimum=1, maximum=1 << 16)
        _int("num_ubatch", self.num_ubatch, minimum=1, maximum=1 << 16)
        if self.num_ubatch > self.num_batch:
            raise InvalidConfig(f"num_ubatch ({self.num_ubatch}) must be <= num_batch ({self.num_batch})")
        if self.num_threads is not None:
            _int("num_threads", self.num_threads, minimum=1, maximum=1024)
        _int("n_gpu_layers", self.n_gpu_layers, minimum=-1)
        _choice("flash_attn", self.flash_attn, FLASH_ATTN)
        _choice("kv_cache_type", self.kv_cache_type, KV_CACHE_TYPES)
        if self.kv_cache_type in QUANTIZED_KV and self.flash_attn == "off":
            raise InvalidConfig(
                f"kv_cache_type={self.kv_cache_type} needs flash_attn 'on' or 'auto' "
                "(a quantized V cache requires flash attention)"
            )
        _int("n_seq_max", self.n_seq_max, minimum=1, maximum=256)
        _choice("prompt_format", self.prompt_format, PROMPT_FORMATS)
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise InvalidConfig("chat_template must be a non-empty template string")
        if not isinstance(self.chat_template_kwargs, Mapping):
            raise InvalidConfig(f"chat_template_kwargs must be a mapping, got {self.chat_template_kwargs!r}")
        try:
            check_template_kwargs(self.chat_template_kwargs)
        except InvalidInput as e:
            raise InvalidConfig(str(e)) from None
        object.__setattr__(self, "chat_template_kwargs", MappingProxyType(dict(self.chat_template_kwargs)))
        _choice("thinking_history", self.thinking_history, THINKING_HISTORY)
        _int("prefix_cache_mb", self.prefix_cache_mb, minimum=0)
        p = self.pin_share
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            raise InvalidConfig(f"pin_share must be a number in [0, 1], got {p!r}")
        _int("kv_store_mb", self.kv_store_mb, minimum=0)
        _int("cache_block_tokens", self.cache_block_tokens, minimum=1, maximum=65536)
        if self.kv_remote is not None:
            parse_remote_url(self.kv_remote)
        if self.kv_remote_key_file is not None:
            if not isinstance(self.kv_remote_key_file, str) or not self.kv_remote_key_file:
                raise InvalidConfig(f"kv_remote_key_file must be a path string, got {self.kv_remote_key_file!r}")
            read_key(self.kv_remote_key_file)  # a missing, unreadable or short key fails here, not at first use
        _int("kv_remote_timeout_ms", self.kv_remote_timeout_ms, minimum=1, maximum=60_000)
        check_prefill_rate(self.kv_remote_prefill_rate, "kv_remote_prefill_rate")
        _int("prefill_chunk", self.prefill_chunk, minimum=1, maximum=1 << 16)
        _choice("reuse_mode", self.reuse_mode, REUSE_MODES)
        _int("chunk_min_tokens", self.chunk_min_tokens, minimum=MIN_CHUNK_TOKENS, maximum=self.num_ctx)
        _int("chunk_recompute", self.chunk_recompute, minimum=0, maximum=self.chunk_min_tokens - 1)
        _choice("swa_cache", self.swa_cache, SWA_CACHES)
        _int("checkpoint_tokens", self.checkpoint_tokens, minimum=0, maximum=1 << 20)
        if self.kv_store_dir is not None and not isinstance(self.kv_store_dir, str):
            raise InvalidConfig(f"kv_store_dir must be a path string, got {self.kv_store_dir!r}")
        if not isinstance(self.disable_bos, bool):
            raise InvalidConfig(f"disable_bos must be a bool, got {self.disable_bos!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> RuntimeConfig:
        """Build from keyword arguments, rejecting unknown names with the valid ones listed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidConfig(f"unknown runtime option(s) {unknown}; valid: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def resolved(self, *, n_ctx_train: int, kv_auto: str = "f16") -> ResolvedConfig:
        """A copy with every "auto"/None value made concrete for this model; kv_auto is what the
        backend makes of kv_cache_type="auto" (a quantized one only where flash_attn is not off)."""
        num_ctx = self.num_ctx or min(max(n_ctx_train, 16), DEFAULT_MAX_CTX)
        threads = self.num_threads or max(1, os.cpu_count() or 1)
        kv = self.kv_cache_type
        if kv == "auto":
            kv = "f16" if kv_auto in QUANTIZED_KV and self.flash_attn == "off" else kv_auto
        flash = self.flash_attn
        if flash == "auto":
            # Quantized V needs flash attention; otherwise keep llama.cpp's
            # tested default path (off on CPU) so numerics are predictable.
            flash = "on" if kv in QUANTIZED_KV else "off"
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        resolved = {"num_ctx": num_ctx, "num_threads": threads, "flash_attn": flash, "kv_cache_type": kv}
        return ResolvedConfig(**{**values, **resolved})


@dataclass(frozen=True)
class ResolvedConfig(RuntimeConfig):
    """A RuntimeConfig as a loaded backend uses it: num_ctx and num_threads are numbers, flash_attn on/off."""

    num_ctx: int = DEFAULT_MAX_CTX
    num_threads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_ctx", "num_threads"):
            if getattr(self, name) is None:
                raise InvalidConfig(f"a resolved config needs a concrete {name}")
        if self.flash_attn == "auto":
            raise InvalidConfig("a resolved config needs flash_attn 'on' or 'off'")
        if self.kv_cache_type == "auto":
            raise InvalidConfig("a resolved config needs a concrete kv_cache_type")

    def resolved(self, *, n_ctx_train: int, kv_auto: str = "f16") -> ResolvedConfig:
        return self


MAX_TOP_LOGPROBS = 20
MAX_DRAFT = 32


@dataclass(frozen=True)
class DecodeConfig:
    """How tokens are chosen and when generation stops.

    temperature 0 is greedy. max_tokens None means "until the context is full".
    """

    max_tokens: int | None = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: each token's logprob and the n most likely (n <= 20)
    constraint: Constraint | None = None  # output must match a JSON schema, regex or grammar
    speculative: int = 0  # greedy only: verify up to n tokens drafted from the context per step (0: off)

    def __post_init__(self) -> None:
        # Accept lists and a bare string for convenience; store tuples (hashable, frozen).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, minimum=1)
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise InvalidConfig(f"{name} must be a number, got {value!r}")
        if self.temperature < 0:
            raise InvalidConfig(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidConfig(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidConfig(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise InvalidConfig(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        _int("top_k", self.top_k, minimum=0)
        _int("repeat_last_n", self.repeat_last_n, minimum=0)
        if self.seed is not None:
            _int("seed", self.seed, minimum=0, maximum=2**32 - 1)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidConfig(f"constraint must be a warmkv.Constraint, got {type(self.constraint).__name__}")
        _int("speculative", self.speculative, minimum=0, maximum=MAX_DRAFT)
        if self.speculative:
            others = {
                "temperature 0 (greedy)": not self.greedy,
                "repeat_penalty 1": self.repeat_penalty != 1.0,
                "no constraint": self.constraint is not None,
                "no logprobs": self.logprobs is not None,
            }
            missing = [need for need, bad in others.items() if bad]
            if missing:
                raise InvalidConfig(f"speculative decoding needs {', '.join(missing)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidConfig(f"stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids[]", t, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
