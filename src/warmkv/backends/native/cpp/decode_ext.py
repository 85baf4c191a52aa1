"""The C++ decode loop: CPU decode steps run their layer loop in C++ (csrc/).

Between torch's matmul kernels, each operation is one pass of csrc/kernels.h: RMSNorm,
RoPE with the K/V cache write, attention read straight from the pool's storage dtype
(no gather, no conversion of the context), SiLU-gate. Results agree with the Python
loop to float32 rounding, not bitwise, so the manifest records which loop decoded.

Built with torch's JIT extension loader on first use (~40 s once) for the machine it
runs on (-march=native), under a name keyed by the sources, the flags and the CPU's
features, and loaded in well under a second after that. `cpp_decode="auto"` falls back
to the Python loop, with a warning, where no compiler is present (and on CUDA, which
decodes in Python); "on" makes that an error; "off" never builds it.

`main()` builds it ahead of time (the set-up script calls it).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ....errors import BackendUnavailable, InvalidConfig

if TYPE_CHECKING:
    from ..kv.paged_kv import PagedKVCache
    from ..model.attention import RowPlan
    from ..model.linear import Linear
    from ..model.transformer import Transformer

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "decode_step.cpp"
# -fopenmp: without it the `#pragma omp parallel` inside at::parallel_for compiles to nothing and
# every kernel runs on one thread (the process has one libgomp, torch's, either way).
FLAGS = ("-O3", "-march=native", "-fopenmp")
# Built results per (build dir, compiler): a failed build is not retried on every model load.
_built: dict[tuple[str, str], ModuleType | Exception] = {}


def _ensure_ninja() -> None:
    """torch's loader runs `ninja` from PATH; the pip package's binary is not on it outside an activated venv."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # type: ignore[import-not-found]
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build(flags: tuple[str, ...] = FLAGS) -> ModuleType:
    """Compile (or load the cached build of) the extension; flags other than FLAGS build a variant
    under its own name (the tests build one without AVX-512 to compare the register widths)."""
    from torch.utils import cpp_extension

    _ensure_ninja()
    t0 = time.perf_counter()
    log.info("loading the C++ decode loop (the first build on a machine takes ~40 s)")
    name = _build_name(flags)
    with _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
        module = cpp_extension.load(
            name, [str(SOURCE)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"], verbose=False
        )
    log.info("C++ decode loop ready in %.1f s", time.perf_counter() - t0)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder at a time, and no wait on a dead one. torch's loader marks a build with a `lock`
    file that it removes when done; a process killed mid-build leaves it, and every later load then
    waits on it for good. A flock dies with its holder: whoever holds it knows a `lock` file left
    in the directory is stale."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".flock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build_name(flags: tuple[str, ...] = FLAGS) -> str:
    """torch's loader watches only the listed source, not the header, and -march=native binds a
    build to its CPU: the name carries a digest of both, so any change builds anew. The sources'
    folder is in it too: the build files name the source by path, and two checkouts sharing one
    build directory would rebuild it for each other on every load."""
    h = hashlib.sha256(str(CSRC.resolve()).encode())
    for f in sorted(CSRC.glob("*.[ch]*")):  # the source and every header it includes
        h.update(f.name.encode() + f.read_bytes())
    h.update(" ".join(flags).encode() + _cpu_features().encode() + torch.__version__.encode())
    return f"warmkv_decode_{h.hexdigest()[:12]}"


@functools.cache
def build_id() -> str:
    """The default build's name: it changes with the sources, the flags, the CPU and torch (read
    once per process: every native load keys its cached parts by it)."""
    return _build_name()


def extension(mode: str) -> ModuleType | None:
    """The compiled module, or None for "off" (and for "auto" when it cannot be built)."""
    if mode not in MODES:
        raise InvalidConfig(f"cpp_decode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "off":
        return None
    key = (os.environ.get("TORCH_EXTENSIONS_DIR", ""), os.environ.get("CXX", ""))
    if key not in _built:
        try:
            _built[key] = _build()
        except Exception as e:  # a compiler error, a missing compiler or ninja, a failed import
            lines = str(e).strip().splitlines()
            _built[key] = RuntimeError(f"{type(e).__name__}: {lines[-1] if lines else ''}")
            if mode == "auto":
                log.warning("C++ decode loop unavailable, decoding in Python (slower): %s", _built[key])
    got = _built[key]
    if isinstance(got, Exception):
        if mode == "on":
            raise BackendUnavailable(f"cpp_decode='on' but the C++ decode loop cannot be built: {got}")
        return None
    return got


def _linear(lin: Linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, int, int]:
    return lin.w, lin.bias, lin.scale, lin.group, lin.qkind, lin.n


class DecodeLoop:
    """A Transformer's layers, handed to the C++ loop once; `run` replaces the Python layer loop.

    prefills: every layer's matmuls are qmatmul's 4/8-bit codes (no bfloat16 prefill copy), so
    prefill pieces run here too, each token alone over its own keys: a row's numbers are then
    the same whatever rows share its batch and wherever its piece begins, and a prompt's last
    token gets the logits a decode step would give it. Elsewhere (float, torch's int4 and int8
    kernels) the matmuls round differently for other row counts, and prefill stays in Python.
    """

    def __init__(self, module: ModuleType, model: Transformer) -> None:
        a = model.args
        # qmatmul takes and gives float32: rounding its input to bfloat16 would only lose bits.
        dtype = torch.float32 if model.layers and model.layers[0].qkv.qkind >= 0 else model.dtype
        self._loop = module.DecodeLoop(a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps, model.scale, dtype)
        self._module, self._head_dim, self._group = module, a.head_dim, a.n_heads // a.n_kv_heads
        linears = [x for layer in model.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.prefills = bool(linears) and all(x.qkind >= 0 and x.dense is None for x in linears)
        for layer in model.layers:
            self._loop.add_layer(
                [_linear(x) for x in (layer.qkv, layer.o, layer.gate_up, layer.down)],
                [layer.qk_norm, layer.attn_norm, layer.ffn_norm],
            )

    @property
    def attention(self) -> str:
        """The attention kernel: "f32" (the default), or "bf16" (bfloat16 products, float32 sums;
        where the CPU has AVX-512 BF16 and the head size is 64 or 128). Each rounds its own way."""
        return str(self._loop.attention())

    def bf16_usable(self) -> bool:
        """Whether the bf16 kernel is built for this CPU and this model's head size and group."""
        return bool(self._module.bf16_attention(self._head_dim, self._group))

    def set_attention(self, kind: str) -> None:
        """ "f32" or "bf16" (where it is built): side by side in benchmarks and tests."""
        self._loop.set_attention(kind)

    @staticmethod
    def takes(rows: list[RowPlan]) -> bool:
        """Steps whose every token attends alone: decode rows and verified drafts (where the loop
        prefills, Transformer.forward hands it every row before asking)."""
        return all(r.decode and (r.n == 1 or r.per_query) for r in rows)

    def run(
        self,
        x: torch.Tensor,
        cache: PagedKVCache,
        rows: list[RowPlan],
        write_slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        k_scale, v_scale = (cache.k_scale, cache.v_scale) if cache.quantized else (None, None)
        cos, sin = cos.reshape(len(write_slots), -1), sin.reshape(len(write_slots), -1)
        queries = [r.query(i) for r in rows for i in range(r.n)] if any(r.n > 1 for r in rows) else rows
        slots = [q.slots for q in queries]
        first = [-1 if q.first_slot is None else q.first_slot for q in queries]
        return self._loop.run(x, cache.k, cache.v, k_scale, v_scale, write_slots, slots, first, cos, sin)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = extension("auto")
    print(f"C++ decode loop: {module.__file__ if module else 'unavailable (decoding runs in Python)'}", file=sys.stderr)
