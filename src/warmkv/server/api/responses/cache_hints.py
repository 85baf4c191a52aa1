"""A Responses request's cache hints: how long its prefix is pinned, and the blocks it marks.

prompt_cache_retention ("in_memory": 10 minutes, "24h": a day) and prompt_cache_options (ttl "30m",
the API's one value; also the lifetime of a prompt_cache_breakpoint sent alone) each ask for a
lifetime: the pin lasts the longest one asked. Mode "implicit" (the API's default) keeps the whole
prompt, as the API's own implicit breakpoint at its end does; mode "explicit" keeps the prompt up
to the last input_text part marked with prompt_cache_breakpoint, and without one asks for no pin
(the API then caches nothing), leaving prompt_cache_retention's.
"""

from __future__ import annotations

from ...turn.pins import RETENTION_S, Mark
from .schemas import FunctionCallOutputItem, MessageItem, ResponsesRequest, TextPart

OPTIONS_TTL_S = {None: 1800.0, "30m": 1800.0}


def marks(req: ResponsesRequest) -> tuple[Mark, ...]:
    """The text of each marked part of the request's input, in order."""
    if isinstance(req.input, str):
        return ()
    out: list[Mark] = []
    for item in req.input:
        parts = item.content if isinstance(item, MessageItem) else None
        parts = item.output if isinstance(item, FunctionCallOutputItem) else parts
        if isinstance(parts, list):
            out += [p.text for p in parts if isinstance(p, TextPart) and p.prompt_cache_breakpoint is not None]
    return tuple(out)


def hint(req: ResponsesRequest) -> tuple[float | None, tuple[Mark, ...]]:
    """(how long to pin, None: no pin; the marks the pin ends at, () : the whole prompt)."""
    opts = req.prompt_cache_options
    marked = marks(req)
    explicit = opts is not None and opts.mode == "explicit"
    asked = [RETENTION_S[req.prompt_cache_retention]] if req.prompt_cache_retention else []
    if (opts is not None or marked) and (marked or not explicit):
        asked.append(OPTIONS_TTL_S[opts.ttl if opts is not None else None])
    return max(asked, default=None), (marked if explicit else ())
