"""Source files with one line changed: prompts whose divergence depth is known.

Partial-hit checks (sliding-window and hybrid models) keep one prompt resident, then send
the same file with line `changed` edited; the prompts share every token before that line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def prompt(changed: int | None = None, lines: int = 72) -> str:
    """`lines` handler functions (~47 tokens each) and a question; line `changed` edited."""
    out = []
    for i in range(lines):
        if i == changed:
            out.append(f"def handler_{i}(request, retries=99):  # moved to /legacy/{i}\n    return legacy(request)\n")
        else:
            out.append(
                f"def handler_{i}(request, retries={i % 7}):  # route /api/v{i % 3}/item/{i * 13 % 97}\n"
                f"    return dispatch(request, 'item', {i}, timeout={i * 0.5})\n"
            )
    return "".join(out) + "\nSummarize what the handlers above do:\n"


def divergence(tokenize: Callable[[str], Sequence[int]], changed: int, lines: int = 72) -> int:
    """The first token where the prompt with `changed` edited differs from the unchanged one."""
    a, b = tokenize(prompt(None, lines)), tokenize(prompt(changed, lines))
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
