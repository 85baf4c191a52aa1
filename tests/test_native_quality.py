"""The native engine on the default model: greedy agreement with llama.cpp, int8 KV perplexity."""

from __future__ import annotations

import math

import numpy as np
import pytest

import warmkv
from warmkv.backends import available_backends, load_backend
from warmkv.backends.base import Backend, ForwardRow

PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive three tips for writing unit tests.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins",
)
TEXT = (
    "The printing press is a mechanical device for applying pressure to an inked surface resting upon a print "
    "medium, thereby transferring the ink. It marked a dramatic improvement on earlier printing methods in which "
    "the cloth, paper or other medium was brushed or rubbed repeatedly to achieve the transfer of ink, and "
    "accelerated the process. Typically used for texts, the invention and global spread of the printing press "
    "was one of the most influential events in the second millennium."
)
# Perplexity needs a longer text: over ~90 tokens, bf16 rounding noise alone moves it by 1%.
LONG_TEXT = TEXT + (
    "\n\nAround 1440, a goldsmith in Mainz combined several known techniques into a working system: metal type "
    "cast in a hand mould, an oil-based ink that clung to metal, and a screw press adapted from those used to "
    "make wine and paper. A skilled worker could now print thousands of pages a day, where a copyist had "
    "managed a few. Within fifty years presses were running in more than two hundred cities across Europe, "
    "and millions of books had been printed.\n\n"
    "The effects reached far beyond the workshop. Cheaper books meant that more people learned to read, and "
    "scholars in distant cities could work from identical copies of the same text, so that errors were found "
    "and corrected instead of being copied again. Pamphlets and broadsheets carried news and argument quickly, "
    "which helped religious and political movements spread their ideas. Scientists published their "
    "observations with exact diagrams and tables, and other scientists could check them.\n\n"
    "The basic design changed little for three centuries. In the early nineteenth century, iron presses "
    "replaced wooden ones, and steam power drove rotary presses that printed on continuous rolls of paper. "
    "Newspapers could then be produced in huge numbers every morning. Later, machines that set whole lines of "
    "type from a keyboard removed the slowest step of the old process, and offset printing, which transfers "
    "the image from a plate to a rubber blanket and then to paper, became the common method for books, "
    "magazines and packaging. Today most printing is digital, yet the idea of making many identical copies "
    "of a text cheaply remains the same."
)


def greedy(backend: Backend, prompt: str, n: int) -> list[int]:
    seq = backend.acquire_seq()
    try:
        ids = backend.tokenize(prompt, add_bos=backend.info.add_bos, parse_special=True)
        (logits,) = backend.forward([ForwardRow(seq, ids, 0)])
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            (logits,) = backend.forward([ForwardRow(seq, out[-1:], len(ids) + len(out) - 1)])
        return out
    finally:
        backend.release_seq(seq)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.skipif("llamacpp" not in available_backends(), reason="llama.cpp backend not installed")
def test_greedy_tokens_follow_llamacpp() -> None:
    """llama.cpp multiplies Q4_1 weights with quantized activations; native dequantizes to fp32.

    Their logits differ by ~0.5 (of ~25), so greedy paths may part at a near-tie. Check that
    they agree up to the first divergence, that each divergence is a near-tie for native
    (llama.cpp's pick is within 0.1 logit of native's), and report the divergence points.
    """
    path = str(warmkv.default_model_path())
    cfg = warmkv.RuntimeConfig(num_ctx=256, n_seq_max=1)
    outs: dict[str, list[list[int]]] = {}
    native = load_backend("native", path, cfg, compute_dtype="float32")
    try:
        llama = load_backend("llamacpp", path, cfg)
        try:
            outs = {name: [greedy(b, p, 32) for p in PROMPTS] for name, b in (("native", native), ("llamacpp", llama))}
        finally:
            llama.close()
        points = [first_divergence(a, b) for a, b in zip(outs["native"], outs["llamacpp"], strict=True)]
        print(f"first divergence per prompt (None = all 32 tokens equal): {points}")
        for prompt, point, theirs in zip(PROMPTS, points, outs["llamacpp"], strict=True):
            if point is None:
                continue
            ids = native.tokenize(prompt, add_bos=native.info.add_bos, parse_special=True) + theirs[:point]
            seq = native.acquire_seq()
            (logits,) = native.forward([ForwardRow(seq, ids, 0)])
            native.release_seq(seq)
            assert logits is not None
            gap = float(logits.max() - logits[theirs[point]])
            print(f"  at token {point}: llama.cpp's token is {gap:.3f} below native's best")
            assert gap < 0.1, f"divergence at token {point} is not a near-tie (gap {gap:.3f})"
        assert sum(p is None for p in points) >= 2, points
    finally:
        native.close()


def perplexity(backend: Backend, text: str) -> float:
    """One forward with every position's logits: each query attends over the K/V as stored in the
    pool (int8, bf16...), as a decode step reads them. Token by token decode steps gave the same
    perplexity to 4 digits on all five configurations below (int8 weights to 0.04%), in 4x the time."""
    ids = backend.tokenize(text, add_bos=False, parse_special=False)
    seq = backend.acquire_seq()
    try:
        (logits,) = backend.forward([ForwardRow(seq, ids, 0, all_logits=True)])
        z = np.asarray(logits, dtype=np.float64)[:-1]
        top = z.max(axis=1)
        nll = np.log(np.exp(z - top[:, None]).sum(axis=1)) + top - z[np.arange(len(ids) - 1), ids[1:]]
        return math.exp(float(nll.mean()))
    finally:
        backend.release_seq(seq)


def test_int8_perplexity() -> None:
    """int8 KV and int4 weights (f16 or bf16 KV) stay within 1% of float32; int8 weights (a speed option) within 5%."""
    path = str(warmkv.default_model_path())
    ppl = {}
    for label, kv, compute in (
        ("f32", "f32", "float32"),
        ("int8 KV", "q8_0", "float32"),
        ("int8 weights", "f16", "int8"),
        ("int4 weights", "f16", "int4"),
        ("int4 weights, bf16 KV", "bf16", "int4"),
    ):
        cfg = warmkv.RuntimeConfig(num_ctx=512, n_seq_max=1, kv_cache_type=kv)
        b = load_backend("native", path, cfg, compute_dtype=compute)
        try:
            ppl[label] = perplexity(b, LONG_TEXT)
        finally:
            b.close()
    kv_change = ppl["int8 KV"] / ppl["f32"] - 1
    w_change = ppl["int8 weights"] / ppl["f32"] - 1
    print(f"perplexity: f32 {ppl['f32']:.4f}, int8 KV {ppl['int8 KV']:.4f} ({kv_change:+.3%}), ", end="")
    print(f"int8 weights {ppl['int8 weights']:.4f} ({w_change:+.3%}), ", end="")
    # int4 groups of 32 are the default model's own Q4_1 codes (bf16 scales): near-lossless.
    w4_change = ppl["int4 weights"] / ppl["f32"] - 1
    bf16_change = ppl["int4 weights, bf16 KV"] / ppl["f32"] - 1
    print(f"int4 weights {ppl['int4 weights']:.4f} ({w4_change:+.3%}), with bf16 KV ({bf16_change:+.3%})")
    assert abs(kv_change) <= 0.01, ppl
    assert abs(w_change) <= 0.05, ppl
    assert abs(w4_change) <= 0.01, ppl
    assert abs(bf16_change) <= 0.01, ppl


@pytest.mark.skipif("llamacpp" not in available_backends(), reason="llama.cpp backend not installed")
def test_embeddings_agree_across_backends() -> None:
    texts = [PROMPTS[1], TEXT, "x = 1"]
    vecs = {}
    for name, opts in (("native", {"compute_dtype": "float32"}), ("llamacpp", {})):
        with warmkv.Runtime.load(
            backend=name, num_ctx=256, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0, backend_options=opts
        ) as rt:
            vecs[name] = rt.embed(texts)
    cos = (vecs["native"] * vecs["llamacpp"]).sum(axis=1)
    print(f"embedding cosine native vs llama.cpp: {np.round(cos, 5).tolist()}")
    assert (cos > 0.999).all(), cos
