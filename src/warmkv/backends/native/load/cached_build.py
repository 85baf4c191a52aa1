"""The native engine's files in the load cache (backends/load_cache.py): a GGUF's header (hyperparameters,
tokenizer, template, metadata) and its parts (every matrix in the engine's form) per set of build
choices.

A build's key digests the choices (dtype, weight-only quantization, the prefill copy, the kernels'
build) and the code that makes the parts, with torch's and gguf's versions, so a new warmkv or torch
never reads an older layout. The parts are mapped with their pages populated (mapped.py); the
packed matrices are copied from the mapping into the model's weight arena.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib.metadata import version
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from ....errors import InvalidModelFile
from ...load_cache import LoadCache, read_json
from ..model.args import ModelArgs
from ..model.parts import Parts
from .checkpoint import Checkpoint, Lazy
from .mapped import map_safetensors
from .tokenizer import TextTokenizer

FORMAT = 1
# Tokenizers by vocabulary digest, kept across unloads (a few MB each): a swap back reuses its own.
_TOKENIZERS: dict[str, TextTokenizer] = {}
_KEEP_TOKENIZERS = 8
_NATIVE = Path(__file__).resolve().parent.parent
_code: str | None = None


def code_digest() -> str:
    """The code that turns a checkpoint into parts (the loaders and the model's builders), torch's and
    gguf's versions: a change to any makes the cached files of other versions unreachable."""
    global _code
    if _code is None:
        h = hashlib.sha256(f"{FORMAT} {torch.__version__} {version('gguf')}".encode())
        for f in sorted([*(_NATIVE / "load").glob("*.py"), *(_NATIVE / "model").glob("*.py")]):
            h.update(f.name.encode() + f.read_bytes())
        _code = h.hexdigest()[:16]
    return _code


def _no_file(name: str) -> torch.Tensor:
    raise InvalidModelFile(f"weight {name} read from a load cache's header, which holds no weights")


def _tokenizer(cache: LoadCache, digest: str, vocab_digest: str) -> TextTokenizer:
    """The file's tokenizer: the one a load in this process made already (a swap back makes none:
    rebuilding a 49K-token BPE took ~0.2 s, most of a reload), else from tokenizer.json."""
    tok = _TOKENIZERS.get(vocab_digest)
    if tok is None:
        d = read_json(cache.path(digest, "tokenizer.json"))
        if d is None:
            raise ValueError("tokenizer.json is missing or not JSON")
        tok = _remember(TextTokenizer.restore(d))
    if tok.vocab.digest != vocab_digest:
        raise ValueError(f"tokenizer.json holds vocabulary {tok.vocab.digest[:12]}, not {vocab_digest[:12]}")
    return tok


def _remember(tok: TextTokenizer) -> TextTokenizer:
    _TOKENIZERS[tok.vocab.digest] = tok
    while len(_TOKENIZERS) > _KEEP_TOKENIZERS:
        del _TOKENIZERS[next(iter(_TOKENIZERS))]
    return tok


def read_header(cache: LoadCache, digest: str) -> Checkpoint | None:
    """The checkpoint's facts as a load of this file found them; its weights are not in it."""
    path = cache.path(digest, "header.json")
    d = read_json(path)
    if d is None or d.get("code") != code_digest():
        return None
    try:
        args = {k: tuple(v) if isinstance(v, list) else v for k, v in d["args"].items()}
        return Checkpoint(
            args=ModelArgs(**args),
            weights=Lazy({k: tuple(v) for k, v in d["shapes"].items()}, _no_file),
            tokenizer=_tokenizer(cache, digest, d["vocab_digest"]),
            chat_template=d["chat_template"],
            name=d["name"],
            add_bos=d["add_bos"],
            metadata=d["metadata"],
            layer_weight_types=frozenset(d["layer_weight_types"]),
        )
    except Exception as e:  # a damaged or foreign file is a miss
        cache.discard(path, e)
        return None


def write_header(cache: LoadCache, digest: str, ckpt: Checkpoint) -> None:
    doc = {
        "code": code_digest(),
        "args": dataclasses.asdict(ckpt.args),
        "shapes": {k: ckpt.weights.shape(k) for k in ckpt.weights},
        "vocab_digest": ckpt.tokenizer.vocab.digest,
        "chat_template": ckpt.chat_template,
        "name": ckpt.name,
        "add_bos": ckpt.add_bos,
        "metadata": ckpt.metadata,
        "layer_weight_types": sorted(ckpt.layer_weight_types),
    }
    cache.write_json(cache.path(digest, "tokenizer.json"), ckpt.tokenizer.state())
    cache.write_json(cache.path(digest, "header.json"), doc)  # last: a header is read only with its tokenizer
    _remember(ckpt.tokenizer)


def build_key(**choices: object) -> str:
    """<code>-<choices>: the code's part names the files an upgrade made unreachable (write_parts)."""
    text = json.dumps(choices, sort_keys=True, default=str)
    return f"{code_digest()[:8]}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def read_parts(cache: LoadCache, digest: str, build: str) -> Parts | None:
    path = cache.path(digest, f"parts-{build}.safetensors")
    if not path.exists():
        return None
    try:
        tensors, meta = map_safetensors(path)
        parts = Parts.from_tensors(tensors, json.loads(meta["spec"]))
    except Exception as e:  # a damaged or foreign file: read the GGUF instead
        cache.discard(path, e)
        return None
    cache.loaded(digest)
    return parts


def write_parts(cache: LoadCache, digest: str, build: str, parts: Parts) -> None:
    tensors, spec = parts.tensors()
    meta = {"spec": json.dumps(spec)}
    path = cache.path(digest, f"parts-{build}.safetensors")
    cache.write(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=meta), safetensors.SafetensorError)
    # Another version's builds are never read again (each upgrade left ~127 MB per model of the
    # default's size): they go, the other choices of this version stay.
    for old in path.parent.glob("parts-*.safetensors"):
        if not old.name.startswith(f"parts-{code_digest()[:8]}-"):
            old.unlink(missing_ok=True)
    cache.evict(keep=digest)
