"""A session's suffix: the volatile part after the prefix (a diff, test output, a user turn).

Replacing the suffix reuses what the new one shares with the old (or with a detached suffix
that ensure_prefix left: a resent history); appending continues after the generated tokens.
The prefix's KV is never touched, and a call that is refused changes nothing. A function over
the session (Session.prefill_suffix delegates), apart because it is a whole operation of its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import ContextOverflow, ManifestMismatch, NoPrefix
from ..prompt.text import as_text
from ..prompt.tokens import common_prefix_len
from ..types import SuffixInput, SuffixStatus

if TYPE_CHECKING:
    from .session import Session


def prefill_suffix(session: Session, inp: SuffixInput) -> SuffixStatus:
    """Replace (or append to) the session's suffix: its op lock, then the model lock, as one operation."""
    s = session
    text = as_text(inp.text, "suffix text")
    with s._lock(publish=True):
        s._check_usable()
        ctx, manifest, n_ctx = s.ctx, s._manifest, s._num_ctx
        if manifest is None or ctx.prefix_len == 0:
            raise NoPrefix("prefill_suffix needs a prefix: call ensure_prefix first")
        if inp.manifest_digest is not None and inp.manifest_digest != manifest.digest:
            raise ManifestMismatch(
                f"suffix was built for manifest {inp.manifest_digest[:16]} but the resident KV "
                f"is {manifest.digest[:16]}"
            )
        tokens = s._rt.prompt_tokens(text, add_bos=False, parse_special=inp.parse_special) if text else []
        if inp.append:
            base, new, reused = ctx.live, [*ctx.pending, *tokens], 0
        else:
            base, new = ctx.prefix_len, tokens
            reused = common_prefix_len(ctx.tokens[base:], tokens)
        if base + len(new) > n_ctx:
            raise ContextOverflow("prefill_suffix", base + reused, len(new) - reused, n_ctx)
        t0 = time.perf_counter()
        if inp.append:
            ctx.append_suffix(tokens, between=s._rt.yield_model_lock)
        else:
            ctx.replace_suffix(tokens, reused, between=s._rt.yield_model_lock)
        s._cached_since_decode += reused
        return SuffixStatus(
            suffix_tokens=ctx.suffix_end - ctx.prefix_len,
            prefix_tokens=ctx.prefix_len,
            resident_tokens=len(ctx.tokens),
            available_tokens=n_ctx - len(ctx.tokens),
            manifest_digest=manifest.digest,
            reused_tokens=reused,
            prefilled_tokens=len(new) - reused,
            prefill_s=time.perf_counter() - t0,
        )
