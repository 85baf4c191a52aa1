"""A GGUF file's metadata scalars and tensor types, read without its arrays.

backend="auto" needs a handful of keys and the layers' tensor types before anything loads.
gguf.GGUFReader builds a numpy view of every array element: 2.4 s for the default model's
49K-token vocabulary and merges, and ~10 s for Gemma 3's 262K tokens on two cores. This walk
skips arrays by their lengths (a string array still costs one length read per element) and
can stop at the first key that settles the question.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
# GGUF value types (gguf.GGUFValueType): fixed sizes; 8 is a string, 9 an array
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class NotGGUF(ValueError):
    """The file is not a GGUF file this walk reads (version 2 or 3)."""


@dataclass
class GGUFHeader:
    """Scalar metadata (strings and numbers; arrays are left out) and each tensor's type name."""

    meta: dict[str, object] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)
    tensor_dims: dict[str, int] = field(default_factory=dict)
    complete: bool = True  # False: stopped early, at the caller's request


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 0

    def unpack(self, fmt: str) -> object:
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = int(self.unpack("<Q"))  # type: ignore[call-overload]
        s = self.buf[self.at : self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return s

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", self.buf, self.at)
            self.at += 8 + n

    def value(self, kind: int) -> object:
        if kind in _FIXED:
            return self.unpack(_FIXED[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = int(self.unpack("<I")), int(self.unpack("<Q"))  # type: ignore[call-overload]
            if elem == _STRING:
                self.skip_strings(count)
            elif elem in _FIXED:
                self.at += struct.calcsize(_FIXED[elem]) * count
            else:
                for _ in range(count):  # arrays of arrays: none in practice
                    self.value(elem)
            return None
        raise NotGGUF(f"unknown GGUF value type {kind}")


def read_header(path: Path, stop: Callable[[dict[str, object]], bool] | None = None) -> GGUFHeader:
    """The metadata scalars and tensor types of a GGUF file. stop(meta), asked after each key,
    ends the walk early (complete=False) once the caller has what it needs."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise NotGGUF(f"{path.name} does not start with {GGUF_MAGIC!r}")
        c = _Cursor(buf)
        c.at = 4
        version = int(c.unpack("<I"))  # type: ignore[call-overload]
        if version not in (2, 3):
            raise NotGGUF(f"GGUF version {version}")
        n_tensors, n_kv = int(c.unpack("<Q")), int(c.unpack("<Q"))  # type: ignore[call-overload]
        out = GGUFHeader()
        try:
            for _ in range(n_kv):
                key = c.string()
                v = c.value(int(c.unpack("<I")))  # type: ignore[call-overload]
                if v is not None:
                    out.meta[key] = v
                if stop is not None and stop(out.meta):
                    out.complete = False
                    return out
            for _ in range(n_tensors):
                name = c.string()
                dims = int(c.unpack("<I"))  # type: ignore[call-overload]
                c.at += 8 * dims
                kind = int(c.unpack("<I"))  # type: ignore[call-overload]
                c.at += 8  # the data offset
                try:
                    out.tensor_types[name] = GGMLQuantizationType(kind).name
                except ValueError:
                    out.tensor_types[name] = f"type {kind}"
                out.tensor_dims[name] = dims
        except struct.error as e:
            raise NotGGUF(f"{path.name} ends inside its header: {e}") from None
        return out
