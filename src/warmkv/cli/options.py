"""The options every `warmkv` command that loads a model shares, added by one decorator.

@runtime_options() gives a command the model, backend, context, KV, store and backend
options (--model, --backend, --num-ctx, --n-seq-max, --kv-cache-type, --compute-dtype,
--device, --prefix-cache-mb, ...) and hands them to it as one RuntimeOptions; from them it
builds RuntimeConfig and the backend's typed options, which validate every value.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from ..backends import BackendOptions, make_options
from ..backends.choose import AUTO
from ..config import RuntimeConfig
from ..engine.runtime import Runtime
from ..errors import InvalidConfig

# Piped into a file or a CI log, rich would lay tables out at 80 columns and cut the benches'
# cells short; a terminal, or COLUMNS, still sets the width.
PIPED_WIDTH = 200
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH)
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Spec:
    """One shared option: its parameter name, flags, type, help, and where it goes."""

    name: str
    flags: tuple[str, ...]
    type: Any
    help: str
    target: str  # "runtime" (a RuntimeConfig field), "backend" (a backend option) or "" (model, backend)
    field: str = ""  # the RuntimeConfig / backend option name when it differs from name

    @property
    def key(self) -> str:
        return self.field or self.name


SPECS = (
    Spec("model", ("--model", "-m"), str, "GGUF file or HF directory (default: bundled SmolLM2-135M)", ""),
    Spec(
        "backend",
        ("--backend", "-b"),
        str,
        "auto, native or llamacpp (auto: native where it runs the model fastest)",
        "",
    ),
    Spec(
        "num_ctx",
        ("--num-ctx",),
        int,
        "context window of each session (default: the model's, capped at 4096)",
        "runtime",
    ),
    Spec("n_seq_max", ("--n-seq-max",), int, "resident sessions; each holds num_ctx tokens of KV", "runtime"),
    Spec(
        "kv_cache_type",
        ("--kv-cache-type", "--kv-type"),
        str,
        "KV type: auto (q8_0 on native where its int8 attention runs, else f16), f16, bf16, f32, q8_0 or q4_0",
        "runtime",
    ),
    Spec("flash_attn", ("--flash-attn",), str, "auto, on or off", "runtime"),
    Spec("n_gpu_layers", ("--n-gpu-layers",), int, "llama.cpp: layers offloaded to the GPU (-1: all)", "runtime"),
    Spec("num_batch", ("--num-batch",), int, "tokens per engine step", "runtime"),
    Spec("threads", ("--threads",), int, "CPU threads (default: all)", "runtime", "num_threads"),
    Spec("prefill_chunk", ("--prefill-chunk",), int, "tokens prefilled between other sessions' steps", "runtime"),
    Spec(
        "reuse_mode",
        ("--reuse-mode",),
        str,
        "exact (warm == cold) or chunks (also move resident KV runs that shifted: approximate)",
        "runtime",
    ),
    Spec("chunk_min_tokens", ("--chunk-min-tokens",), int, "chunks mode: shortest moved run (>= 16)", "runtime"),
    Spec("chunk_recompute", ("--chunk-recompute",), int, "chunks mode: tokens recomputed per moved run", "runtime"),
    Spec(
        "chat_template_file",
        ("--chat-template-file",),
        str,
        "a Jinja chat template to use instead of the model's (default: the model's, else its family's)",
        "runtime",
    ),
    Spec(
        "chat_template_kwargs",
        ("--chat-template-kwargs",),
        str,
        "JSON object of template variables for every request, e.g. '{\"enable_thinking\": false}'",
        "runtime",
    ),
    Spec(
        "thinking_history",
        ("--thinking-history",),
        str,
        "keep (earlier turns keep their reasoning: tool loops stay warm) or template (render as it says)",
        "runtime",
    ),
    Spec(
        "swa_cache",
        ("--swa-cache",),
        str,
        "sliding-window models: window (about n_swa + n_ubatch cells, with checkpoints) or full (every position)",
        "runtime",
    ),
    Spec(
        "checkpoint_tokens",
        ("--checkpoint-tokens", "--swa-checkpoint-tokens"),
        int,
        "sliding-window and hybrid models: tokens between state checkpoints (0: prompt ends only)",
        "runtime",
    ),
    Spec("prefix_cache_mb", ("--prefix-cache-mb",), int, "shared prefix cache in RAM, MiB (0: off)", "runtime"),
    Spec("pin_share", ("--pin-share",), float, "part of each KV tier cache hints may pin", "runtime"),
    Spec("kv_store_dir", ("--kv-store-dir",), str, "persistent KV store directory (default: user cache)", "runtime"),
    Spec("kv_store_mb", ("--kv-store-mb",), int, "persistent KV store cap, MiB (0: off)", "runtime"),
    Spec(
        "kv_remote",
        ("--kv-remote",),
        str,
        "remote KV tier shared by several nodes: redis://HOST:PORT/DB or rediss:// (Redis or Valkey; "
        "password in the URL or $WARMKV_KV_REMOTE_PASSWORD)",
        "runtime",
    ),
    Spec(
        "kv_remote_key_file",
        ("--kv-remote-key-file",),
        str,
        "remote KV tier: a file holding the fleet key that seals its values (HMAC-SHA256; or "
        "$WARMKV_KV_REMOTE_KEY); without one the tier is trusted as-is",
        "runtime",
    ),
    Spec(
        "kv_remote_timeout_ms",
        ("--kv-remote-timeout-ms",),
        int,
        "remote KV tier: connect and read timeout, ms (default 200; spills get 10x)",
        "runtime",
    ),
    Spec(
        "kv_remote_prefill_rate",
        ("--kv-remote-prefill-rate",),
        float,
        "remote KV tier: tokens/s a read must beat (default: the measured prefill rate)",
        "runtime",
    ),
    Spec(
        "compute_dtype",
        ("--compute-dtype",),
        str,
        "native: auto (the default: int4 for a Q4_0/Q4_1 GGUF on the CPU, else float32), float32, bfloat16, "
        "int8 or int4",
        "backend",
    ),
    Spec("device", ("--device",), str, "native: cpu, cuda, cuda:N or auto", "backend"),
    Spec("cpp_decode", ("--cpp-decode",), str, "native: auto, on or off (the C++ CPU decode loop)", "backend"),
    Spec(
        "attention",
        ("--attention",),
        str,
        "native: the C++ loop's attention kernel: auto (bf16 with AVX-512 BF16 on 4-bit weights, else f32), "
        "f32 or bf16",
        "backend",
    ),
    Spec(
        "kv_cache_mb",
        ("--kv-cache-mb",),
        int,
        "native: KV pool budget in MiB (default: num_ctx per session)",
        "backend",
    ),
    Spec(
        "load_cache",
        ("--load-cache",),
        str,
        "where what a load derives from a GGUF is kept for the next load: auto (~/.cache/warmkv/native), "
        "a directory, or off",
        "backend",
    ),
    Spec("use_mmap", ("--mmap/--no-mmap",), bool, "llama.cpp: map the model file (default: on)", "backend"),
    Spec("use_mlock", ("--mlock/--no-mlock",), bool, "llama.cpp: lock the weights in RAM (default: off)", "backend"),
)
NAMES = frozenset(s.name for s in SPECS)


@dataclass(frozen=True)
class RuntimeOptions:
    """What the command line said about the model and how to load it (None: not given)."""

    model: str | None = None
    backend: str = AUTO
    runtime: dict[str, Any] = field(default_factory=dict)  # RuntimeConfig fields given
    backend_given: dict[str, Any] = field(default_factory=dict)  # backend option names given
    more_models: tuple[str, ...] = ()  # serve: the models after the first -m

    @classmethod
    def from_params(cls, values: dict[str, Any]) -> RuntimeOptions:
        by = {s.name: s for s in SPECS}
        runtime = {by[k].key: v for k, v in values.items() if v is not None and by[k].target == "runtime"}
        backend = {by[k].key: v for k, v in values.items() if v is not None and by[k].target == "backend"}
        model = values.get("model")
        more: tuple[str, ...] = ()
        if isinstance(model, list | tuple):  # serve takes -m more than once
            model, more = (model[0], tuple(model[1:])) if model else (None, ())
        return cls(model, values.get("backend") or AUTO, runtime, backend, more)

    def for_model(self, model: str | None, **given: Any) -> RuntimeOptions:
        """The same options for another model; given replaces options by their flag name (a preset's)."""
        by = {s.name: s for s in SPECS}
        unknown = sorted(set(given) - NAMES)
        if unknown:
            raise InvalidConfig(f"unknown model option(s) {unknown}; valid: {sorted(NAMES - {'model'})}")
        runtime = {**self.runtime, **{by[k].key: v for k, v in given.items() if by[k].target == "runtime"}}
        backend = {**self.backend_given, **{by[k].key: v for k, v in given.items() if by[k].target == "backend"}}
        return RuntimeOptions(model, given.get("backend", self.backend), runtime, backend)

    def config(self, **overrides: Any) -> RuntimeConfig:
        values = {**self.runtime, **overrides}
        path = values.pop("chat_template_file", None)
        if path is not None:
            try:
                values["chat_template"] = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidConfig(f"--chat-template-file {path}: {e}") from None
        kwargs = values.get("chat_template_kwargs")
        if isinstance(kwargs, str):
            try:
                values["chat_template_kwargs"] = json.loads(kwargs)
            except ValueError as e:
                raise InvalidConfig(f"--chat-template-kwargs is not JSON: {e}") from None
        return RuntimeConfig.from_kwargs(**values)

    def backend_options(self) -> BackendOptions | dict[str, Any]:
        """The backend's typed options; for "auto" the options given, typed once the backend is chosen."""
        if self.backend == AUTO:
            return dict(self.backend_given)
        return make_options(self.backend, **self.backend_given)

    def load(self, **overrides: Any) -> Runtime:
        """Load the runtime these options describe; overrides replace RuntimeConfig fields."""
        config, options = self.config(**overrides), self.backend_options()  # InvalidConfig before loading
        with err.status(f"loading {self.model or 'default model'} on {self.backend}..."):
            return Runtime.load(self.model, backend=self.backend, config=config, backend_options=options)

    def flags(self, **overrides: Any) -> list[str]:
        """These options as command-line flags (for the benchmarks that start `warmkv serve`)."""
        values: dict[str, Any] = {"model": self.model, "backend": self.backend}
        by_key = {s.key: s for s in SPECS}
        for key, v in {**self.runtime, **overrides, **self.backend_given}.items():
            values[by_key[key].name] = v
        out: list[str] = []
        for s in SPECS:
            v = values.get(s.name)
            if v is None:
                continue
            if s.type is bool:
                on, off = s.flags[0].split("/")
                out.append(on if v else off)
            else:
                out += [s.flags[0], str(v)]
        return out


def runtime_options(*, many_models: bool = False, **defaults: Any) -> Callable[[F], F]:
    """Give a command the shared runtime options; it receives them as `opts: RuntimeOptions`.

    defaults sets a command's own default for an option (e.g. serve's n_seq_max=20);
    many_models lets --model be given more than once (serve).
    """
    unknown = set(defaults) - NAMES
    if unknown:
        raise TypeError(f"runtime_options has no option(s) {sorted(unknown)}")

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)  # typer reads Annotated options from the signature
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        shared = []
        for s in SPECS:
            default = defaults.get(s.name, AUTO if s.name == "backend" else None)
            kind = s.type if s.name == "backend" else s.type | None
            if many_models and s.name == "model":
                kind = list[str] | None
            help_ = s.help + (f" [default: {default}]" if s.name in defaults else "")
            option = typer.Option(*s.flags, help=help_, show_default=s.name == "backend")
            shared.append(
                inspect.Parameter(
                    s.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]
                )
            )

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in list(kwargs) if name in NAMES}
            return fn(*args, opts=RuntimeOptions.from_params(values), **kwargs)

        command.__signature__ = sig.replace(parameters=[*own, *shared])  # type: ignore[attr-defined]
        return command  # type: ignore[return-value]

    return wrap


def fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)


def positive_ints(option: str, value: str, example: str) -> list[int]:
    """A comma-separated list of integers >= 1, or a clean exit naming the option."""
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        fail(ValueError(f"{option} must be positive integers like {example}; got {value!r}"))
    return out
