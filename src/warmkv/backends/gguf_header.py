"""A GGUF file's header: its metadata and its tensors' names, types, shapes and offsets.

gguf.GGUFReader builds a numpy view of every array element: 2.4 s for the default model's
49K-token vocabulary and merges, and 6-9 s for Gemma 3's 262K tokens on two cores. This walk
reads a numeric array in one numpy call and a string array with one length read per element;
it skips arrays altogether where the caller needs only scalars (backend="auto", `warmkv
models`), and can stop at the first key that settles the question.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
# GGUF value types (gguf.GGUFValueType): fixed sizes; 8 is a string, 9 an array
# (struct's format codes, which numpy reads as the same dtypes)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
_MAX_NESTING = 8  # arrays of arrays; none in practice
_MAX_DIMS = 4  # GGML_MAX_DIMS
_UINT32 = 4


class NotGGUF(ValueError):
    """The file is not a GGUF file this walk reads (version 2 or 3)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header lists it: dims fastest axis first (GGUF's order), the data's
    offset from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    kind: int  # GGMLQuantizationType's value
    offset: int

    @property
    def type_name(self) -> str:
        """GGMLQuantizationType's name ("type N" for one gguf does not know)."""
        try:
            return GGMLQuantizationType(self.kind).name
        except ValueError:
            return f"type {self.kind}"


@dataclass
class GGUFHeader:
    """Metadata (arrays as lists where asked for, else left out) and the tensors."""

    meta: dict[str, object] = field(default_factory=dict)
    types: dict[str, tuple[int, ...]] = field(default_factory=dict)  # GGUFValueType per key; arrays: (9, element's)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0  # where the tensors' data begins in the file
    complete: bool = True  # False: stopped early, at the caller's request

    @property
    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.type_name for t in self.tensors}


class _Cursor:
    def __init__(self, buf: mmap.mmap, arrays: bool) -> None:
        self.buf, self.at, self.arrays = buf, 0, arrays

    def unpack(self, fmt: str) -> object:
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = int(self.unpack("<Q"))  # type: ignore[call-overload]
        if self.at + n > len(self.buf):
            raise struct.error(f"a string of {n} bytes at offset {self.at}")
        s = self.buf[self.at : self.at + n].decode("utf-8")  # strict, as gguf and llama.cpp read it
        self.at += n
        return s

    def strings(self, count: int) -> list[str]:
        buf, at, out = self.buf, self.at, []
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, at)
            out.append(buf[at + 8 : at + 8 + n].decode("utf-8"))
            at += 8 + n
        if at > len(buf):
            raise struct.error(f"a string array runs past the end of the file, to offset {at}")
        self.at = at
        return out

    def numbers(self, kind: int, count: int) -> list[object]:
        dtype = np.dtype(_FIXED[kind])
        if self.at + dtype.itemsize * count > len(self.buf):
            raise struct.error(f"an array of {count} x {dtype.itemsize} bytes at offset {self.at}")
        out = np.frombuffer(self.buf, dtype, count, self.at).tolist()
        self.at += dtype.itemsize * count
        return out

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", self.buf, self.at)
            self.at += 8 + n

    def value(self, kind: int, depth: int = 0) -> object:
        if kind in _FIXED:
            return self.unpack(_FIXED[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = int(self.unpack("<I")), int(self.unpack("<Q"))  # type: ignore[call-overload]
            if self.arrays and elem == _STRING:
                return self.strings(count)
            if self.arrays and elem in _FIXED:
                return self.numbers(elem, count)
            if elem == _STRING:
                self.skip_strings(count)
            elif elem in _FIXED:
                self.at += struct.calcsize(_FIXED[elem]) * count
            else:
                if depth >= _MAX_NESTING:
                    raise NotGGUF(f"arrays nested deeper than {_MAX_NESTING} at offset {self.at}")
                items = [self.value(elem, depth + 1) for _ in range(count)]  # arrays of arrays: none in practice
                return items if self.arrays else None
            return None
        raise NotGGUF(f"unknown GGUF value type {kind}")


def read_header(
    path: Path, stop: Callable[[dict[str, object]], bool] | None = None, *, arrays: bool = False
) -> GGUFHeader:
    """The metadata and tensors of a GGUF file; arrays (a vocabulary, its merges) only with
    arrays=True, as lists, as GGUFReader's contents() gives them. stop(meta), asked after each
    key, ends the walk early (complete=False) once the caller has what it needs."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise NotGGUF(f"{path.name} does not start with {GGUF_MAGIC!r}")
        c = _Cursor(buf, arrays)
        c.at = 4
        version = int(c.unpack("<I"))  # type: ignore[call-overload]
        if version not in (2, 3):
            raise NotGGUF(f"GGUF version {version}")
        n_tensors, n_kv = int(c.unpack("<Q")), int(c.unpack("<Q"))  # type: ignore[call-overload]
        out = GGUFHeader()
        names: set[str] = set()
        try:
            for _ in range(n_kv):
                key = c.string()
                if key in out.types:
                    raise NotGGUF(f"{path.name}: the key {key!r} appears twice")
                kind = int(c.unpack("<I"))  # type: ignore[call-overload]
                out.types[key] = (kind, *struct.unpack_from("<I", buf, c.at)) if kind == _ARRAY else (kind,)
                v = c.value(kind)
                if v is not None:
                    out.meta[key] = v
                if stop is not None and stop(out.meta):
                    out.complete = False
                    return out
            for _ in range(n_tensors):
                name = c.string()
                if name in names:
                    raise NotGGUF(f"{path.name}: the tensor {name!r} appears twice")
                names.add(name)
                n_dims = int(c.unpack("<I"))  # type: ignore[call-overload]
                if n_dims > _MAX_DIMS:
                    raise NotGGUF(f"{path.name}: tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
                dims = struct.unpack_from(f"<{n_dims}Q", buf, c.at)
                c.at += 8 * n_dims
                kind = int(c.unpack("<I"))  # type: ignore[call-overload]
                offset = int(c.unpack("<Q"))  # type: ignore[call-overload]
                out.tensors.append(TensorInfo(name, tuple(dims), kind, offset))
            if c.at > len(buf):  # a skipped array ran past the end
                raise struct.error(f"the header runs to offset {c.at}, past the file's {len(buf)} bytes")
        except struct.error as e:
            raise NotGGUF(f"{path.name} ends inside its header: {e}") from None
        except UnicodeDecodeError as e:
            raise NotGGUF(f"{path.name}: a string in its header is not UTF-8: {e}") from None
        align = out.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if out.types.get("general.alignment", (_UINT32,)) != (_UINT32,):
            raise NotGGUF(
                f"{path.name}: general.alignment is of GGUF type {out.types['general.alignment']}, not uint32"
            )
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise NotGGUF(f"{path.name}: general.alignment {align!r} is not a power of two")
        out.data_start = -(-c.at // align) * align
        return out
