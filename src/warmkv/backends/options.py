"""Each backend's own options: frozen, validated dataclasses that need none of the engines' packages.

Runtime.load and the CLI build them from keyword options; a name a backend does not take
is an InvalidConfig naming it. "auto" values are resolved by the backend, against the model
and the machine, before anything is built from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import InvalidConfig

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
CPP_DECODE = ("auto", "on", "off")
PREFILL_WEIGHTS = ("auto", "bf16", "int4")
ATTENTION = ("auto", "f32", "bf16")
# The KV types the native pool stores, and the torch dtype of each (llama.cpp also stores q4_0).
NATIVE_KV_STORAGE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "q8_0": "int8"}
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class BackendOptions:
    """Base of the backend option records."""

    @classmethod
    def names(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, backend: str, options: Mapping[str, Any]) -> BackendOptions:
        """Build from names, rejecting those this record lacks (naming them and the valid ones)."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise InvalidConfig(f"backend {backend!r} has no option(s) {unknown}; valid: {cls.names()}")
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NativeOptions(BackendOptions):
    """The native engine's options.

    compute_dtype: "auto", the default ("int4" on the CPU for a GGUF whose layer weights are all
    Q4_0/Q4_1: the file's own 4-bit codes, the fastest decode; else "float32"), "float32" (the
    exact reference, opt-in for a 4-bit file), "bfloat16", "int8" (int8 weights, bfloat16
    activations) or "int4" (4-bit weights in groups of 32).
    device: "cpu", "cuda", "cuda:N" or "auto" (CUDA when present); int8/int4 run on the CPU only.
    cpp_decode: "auto" (decode steps run their layer loop in C++ on the CPU, built on first use,
    else in Python), "on" (C++ or an error) or "off". kv_cache_mb: the KV pool's budget in MiB
    (None: room for num_ctx tokens in every sequence).
    prefill_weights (int4 on the CPU): "int4" prefills on the 4-bit codes with int8 activations, no
    copy; "bf16" keeps a bfloat16 copy of the layer weights, made once at load, for prefill's
    matmuls, at 2 bytes a weight (~3.2 GB more for 1.7B parameters); "auto" (default) is "int4"
    where the kernel has AVX-512 VNNI or AVX2 (the faster prefill there: 5x on an AVX2-only CPU),
    else "bf16" where the copy takes under half the available RAM, else "int4".
    attention (the C++ loop's kernel): "f32" (float32 throughout), "bf16" (bfloat16 products and
    float32 sums, where the CPU has AVX-512 BF16 and the head size is 64 or 128: a warm turn 16K
    tokens deep reaches its first token 2.1x sooner and decodes 0.94x as fast) or "auto" (default:
    "bf16" where it is built and the loop prefills on 4-bit codes, else "f32").
    load_cache: where a GGUF's derived form (packed matrices, tokenizer, hyperparameters) is kept so
    that the next load of the same file reads it instead of deriving it again: "auto" (default:
    $WARMKV_LOAD_CACHE, else ~/.cache/warmkv/native), a directory, or "off" (load_cache.py).
    """

    compute_dtype: str = "auto"
    device: str = "cpu"
    cpp_decode: str = "auto"
    kv_cache_mb: int | None = None
    prefill_weights: str = "auto"
    attention: str = "auto"
    load_cache: str = "auto"

    def __post_init__(self) -> None:
        _check_load_cache(self.load_cache)
        if self.attention not in ATTENTION:
            raise InvalidConfig(f"attention must be one of {', '.join(ATTENTION)}; got {self.attention!r}")
        if self.prefill_weights not in PREFILL_WEIGHTS:
            raise InvalidConfig(
                f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS)}; got {self.prefill_weights!r}"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InvalidConfig(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}; got {self.compute_dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise InvalidConfig(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got {self.device!r}")
        if self.cpp_decode not in CPP_DECODE:
            raise InvalidConfig(f"cpp_decode must be one of {', '.join(CPP_DECODE)}; got {self.cpp_decode!r}")
        mb = self.kv_cache_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise InvalidConfig(f"kv_cache_mb must be a positive integer, got {mb!r}")


@dataclass(frozen=True)
class LlamaCppOptions(BackendOptions):
    """llama.cpp's options. use_mmap: map the model file instead of reading it (pages load on use);
    use_mlock: lock the weights in RAM so the OS never pages them out; load_cache: where the file's
    and its vocabulary's digests are kept for the next load, as NativeOptions.load_cache."""

    use_mmap: bool = True
    use_mlock: bool = False
    load_cache: str = "auto"

    def __post_init__(self) -> None:
        _check_load_cache(self.load_cache)
        for name in ("use_mmap", "use_mlock"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfig(f"{name} must be a bool, got {getattr(self, name)!r}")


def _check_load_cache(value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidConfig(f"load_cache must be 'auto', 'off' or a directory; got {value!r}")
