"""Whether the native engine is the faster engine for a model file, read from its metadata alone.

backend="auto" asks this before loading anything. The native engine leads llama.cpp where its C++
loop runs the layers on 4-bit codes (docs/benchmarks.md: 4.0x prefill and 1.7x decode at 135M,
1.6x / 1.1x at the 1.7B shape); elsewhere it would run float32 weights or a Python layer loop.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ...errors import Unsupported
from ..gguf_header import NotGGUF, read_header
from .cpp import decode_ext
from .load.tokenizer import check_gguf_tokenizer
from .model.args import ARCHITECTURES
from .setup import INT4_NATIVE_TYPES

# Architectures the C++ layer loop runs (gemma3's post-norms, GELU and local layers it has not).
CPP_LOOP_ARCHITECTURES = frozenset(ARCHITECTURES) - {"gemma3"}


def native_unfit(path: Path) -> str | None:
    """Why the native engine is not the one for this model on the CPU, or None when it is."""
    if path.is_dir():  # a Hugging Face folder: llama.cpp reads GGUF files only
        try:
            arch = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return None  # the native loader names what is wrong with the folder
        return None if arch in ARCHITECTURES else f"architecture {arch!r} is not one the native engine runs"
    try:
        st = path.stat()
    except OSError:
        return None  # the native loader names what is wrong with it
    why = _gguf_unfit(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if why is not None:
        return why
    if decode_ext.extension("auto") is None:
        return "the native engine's C++ loop cannot be built here (see the warning above)"
    return None


@functools.lru_cache(maxsize=32)
def _gguf_unfit(path: str, size: int, mtime_ns: int, inode: int) -> str | None:
    """native_unfit's reading of a GGUF file, once per version of the file: the walk skips the
    vocabulary's strings one by one (~0.1 s of every reload of the default model)."""
    del size, mtime_ns, inode  # the cache key: a file written again is read again
    try:  # the architecture comes first in a GGUF file: a model the loop does not run stops there
        header = read_header(
            Path(path), stop=lambda m: str(m.get("general.architecture", "llama")) not in CPP_LOOP_ARCHITECTURES
        )
    except (NotGGUF, OSError, ValueError):
        return None  # not a readable GGUF: the native loader names what is wrong with it
    meta = header.meta
    arch = str(meta.get("general.architecture", ""))
    if arch not in CPP_LOOP_ARCHITECTURES:
        runs = ", ".join(sorted(CPP_LOOP_ARCHITECTURES))
        return f"architecture {arch!r}: the native engine's C++ loop runs {runs}"
    layer_types = {t.type_name for t in header.tensors if t.name.startswith("blk.") and len(t.dims) == 2}
    if not layer_types or not layer_types <= INT4_NATIVE_TYPES:
        found = ", ".join(sorted(layer_types)) or "none"
        return f"layer weights {found}: the native engine runs 4-bit codes from {', '.join(sorted(INT4_NATIVE_TYPES))}"
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "llama3"):
        return f"rope scaling {scaling!r} is not one the native engine runs"
    try:
        check_gguf_tokenizer(meta)
    except Unsupported as e:
        return str(e)
    return None
