"""Prompt-lookup speculative decoding on a copy task, against plain greedy decoding, in one run.

The session holds a source file and is asked to reproduce it, the way an agent
rewrites a file it was shown. Per draft size: decode tokens/s, drafted and accepted
tokens, and whether the output equals plain greedy decoding.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ...config import DecodeConfig
from ...engine.runtime import Runtime

SOURCE = Path(__file__).resolve().parents[2] / "prompt" / "tokens.py"  # a file of this package: same bytes everywhere


def copy_prompt(source: str) -> str:
    return (
        "<|im_start|>user\nHere is a file:\n```python\n"
        f"{source}```\nRepeat the file exactly.<|im_end|>\n<|im_start|>assistant\n```python\n"
    )


def run_speculative(rt: Runtime, drafts: tuple[int, ...], max_tokens: int = 160, repeats: int = 2) -> dict[str, Any]:
    prompt = copy_prompt(SOURCE.read_text())
    rows: list[dict[str, Any]] = []
    plain: list[int] | None = None
    with rt.session() as s:
        for k in (0, *drafts):
            best = None
            for _ in range(repeats):  # best of n: the machine is noisy, the work is the same
                s.ensure_prefix(prompt)
                t0 = time.perf_counter()
                chunks = list(s.decode(DecodeConfig(max_tokens=max_tokens, temperature=0, speculative=k)))
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            tokens = [t for c in chunks for t in c.token_ids]
            usage = chunks[-1].usage
            assert usage is not None and best is not None
            plain = tokens if k == 0 else plain
            rows.append(
                {
                    "draft": k,
                    "tokens": len(tokens),
                    "tokens_per_s": len(tokens) / best,
                    "drafted": usage.draft_tokens,
                    "accepted": usage.accepted_tokens,
                    "same_as_greedy": tokens == plain,
                }
            )
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    return {"backend": rt.backend.name, "prompt_tokens": rt.count_tokens(prompt), "rows": rows}
