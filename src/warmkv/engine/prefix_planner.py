"""Planning a prompt against a session, and the session's side of carrying the plan out.

plan_prefix checks the input (text, tokens, segments, manifest), tokenizes it, compares it with
the session's resident tokens and decides what is reused (back to the nearest exact point of
window or recurrent layers), which runs move (reuse_mode="chunks"), where the prompt diverged
and why, in words, the prefix is warm or cold; reuse_mode checks the reuse a prompt asks for
(Runtime.reuse_mode). The KV is not touched, so a rejected prompt changes nothing. It is apart
from the session, which only calls it (Session.plan_prefix), and from prefix_plan.py, which
holds the plan record and its execution. begin_load and finish_load are where a plan's
PrefixLoad starts and where its result becomes the session's prefix (manifest, hashes, status).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..backends.base import Backend, exact_cut
from ..config import REUSE_MODES
from ..errors import ContextOverflow, InvalidInput, ManifestMismatch, Unsupported
from ..manifest import ContextManifest, validate_segments
from ..prompt.text import as_text
from ..prompt.tokens import as_tuple, common_prefix_len, continuations, spell
from ..types import Divergence, PrefixInput, PrefixStatus
from .prefix_plan import DiskRead, PrefixLoad, PrefixPlan, plan_moves
from .region_map import CHECK

if TYPE_CHECKING:
    from .session import Session

DIVERGENCE_TOKENS = 12  # excerpt of each side where reuse stopped
DIVERGENCE_CHARS = 48


def plan_prefix(session: Session, prefix: PrefixInput | str | bytes) -> PrefixPlan:
    """Check a prompt and decide what making it resident in session takes; the KV is not touched."""
    s, rt = session, session._rt
    inp = PrefixInput.coerce(prefix)
    text = as_text(inp.text, "prefix text")
    if not text:
        raise InvalidInput("prefix text is empty; ensure_prefix needs at least one token")
    raw = text.encode("utf-8")
    add_bos = rt.default_add_bos if inp.add_bos is None else bool(inp.add_bos)
    segments = validate_segments(inp.segments, len(raw))
    manifest = rt.manifest(add_bos).with_segments(segments)
    if inp.expect_manifest is not None and inp.expect_manifest != manifest.digest:
        raise ManifestMismatch(
            f"prefix expects manifest {inp.expect_manifest[:16]} but this runtime is {manifest.digest[:16]}"
        )
    with s._lock():
        s._check_usable()
        ctx = s.ctx
        # KV made under another cache salt is never reused, nor compared (no divergence is reported)
        same = s._manifest is not None and s._manifest == manifest and s.cache_salt == inp.cache_salt
        if inp.tokens is not None:
            tokens, reused = _given_tokens(s, inp.tokens, ctx.tokens if same else ())
        else:
            tokens = rt.prompt_tokens(text, add_bos=add_bos, parse_special=inp.parse_special)
            reused = common_prefix_len(ctx.tokens, tokens) if same else 0
        if not tokens:
            raise InvalidInput("prefix text produced no tokens")
        if len(tokens) > s._num_ctx:
            raise ContextOverflow("ensure_prefix", reused, len(tokens) - reused, s._num_ctx)
        chunks = reuse_mode(s._backend, inp.reuse_mode) == "chunks"
        if not chunks:
            reused = min(reused, ctx.exact)  # an exact reuse never takes moved KV
        cfg = rt.config
        runs = (cfg.chunk_min_tokens, cfg.chunk_recompute) if chunks else None
        moves = plan_moves(tokens, ctx.tokens, reused, *runs) if runs is not None and same else ()
        common = reused
        if reused < len(ctx.tokens):  # window or recurrent layers: back to the nearest exact point
            reused = exact_cut(s._backend, s._seq, reused)
        reason = _prefix_reason(s, same, manifest, reused, len(tokens), inp.cache_salt)
        if reused < common:
            layers = getattr(s._backend, "cut_layers", "window")
            reason += f" (diverged at token {common}; the nearest exact point of the {layers} layers is {reused})"
        return PrefixPlan(
            tokens=as_tuple(tokens),
            raw=raw,
            manifest=manifest,
            reused=reused,
            detach=same and reused == len(tokens) and len(ctx.tokens) > reused,
            dropped=len(ctx.tokens) + len(ctx.pending) - reused,
            reason=reason,
            divergence=_divergence(s, tokens, common, add_bos) if same and common < len(ctx.tokens) else None,
            moves=moves,
            runs=runs,
            salt=inp.cache_salt,
            cuts=ctx.cuts,
            context=ctx,
        )


def begin_load(session: Session, plan: PrefixPlan, disk: DiskRead | None = None) -> PrefixLoad:
    """Start executing a plan (model lock held): drop what diverged, load from a tier (Session.begin_load)."""
    load = PrefixLoad(session.ctx, plan, session._rt.tiers, session._num_ctx)
    session._manifest, session.cache_salt = plan.manifest, plan.salt
    load.begin(disk)
    return load


def disk_read(session: Session, plan: PrefixPlan) -> Callable[[], DiskRead] | None:
    """The read of the tiers below memory begin_load would make for plan, or None (Session.disk_read)."""
    tiers = session._rt.tiers
    if tiers is None:
        return None
    tokens = plan.tokens
    keys = tiers.keys(plan.manifest.digest, tokens, plan.salt)
    return tiers.disk_read(plan.manifest.digest, tokens, keys, plan.reused)


def finish_load(session: Session, load: PrefixLoad) -> PrefixStatus:
    """The plan's prompt is resident: it becomes the session's prefix (model lock held)."""
    status = load.status()
    ctx, prompt = session.ctx, load.plan.tokens
    n = min(len(prompt), len(ctx.tokens))  # its last id may wait as the pending token
    if CHECK and tuple(ctx.tokens[:n]) != prompt[:n]:
        raise AssertionError(f"a loaded prompt of {len(prompt)} tokens is not what the session holds")
    session._line = (prompt, ctx.cuts, n)
    session._byte_hash = status.stable_byte_hash
    session._token_hash = status.stable_token_hash
    session._cached_since_decode = status.cached_tokens
    session._last_prefix = status
    return status


def _given_tokens(session: Session, tokens: Sequence[int], resident: Sequence[int]) -> tuple[Sequence[int], int]:
    """(the prompt's tokens, how many of them are resident). Those equal to the resident ones are
    taken from them (they are this model's token ids: evaluated); only the rest is checked, one by
    one. A continued conversation's prompt is checked in the time of its new tokens: a check of all
    of a 32K-token history's ints took ~8 ms of every turn (a cold prompt's check is ~0.1% of its
    prefill). A prompt built to continue another (continuations: ints this process made) is kept as
    it is: the block keys and the store then compare it with that one in the time of its tail."""
    given = tokens if isinstance(tokens, list | tuple) else list(tokens)
    known = _known_resident(session, given) if resident else 0
    if known:
        k = known + common_prefix_len(resident[known:], given[known:])
    else:
        k = common_prefix_len(resident, given) if resident else 0
    n = session._backend.info.n_vocab
    tail = given[k:]
    for i, t in enumerate(tail, k):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
            raise InvalidInput(f"prefix tokens[{i}] = {t!r} is out of range [0, {n})")
    if continuations.made(given):
        return given, k
    return [*resident[:k], *tail], k


def _known_resident(session: Session, given: Sequence[int]) -> int:
    """Leading ids of given known to be resident without a compare: it was built to continue the prompt
    the session last made resident, and since then the session's tokens were only appended to."""
    line = session._line
    if line is None or session.ctx.cuts != line[1]:
        return 0
    prompt, _, n = line
    return min(continuations.known(prompt, given), n)


def _divergence(session: Session, tokens: Sequence[int], reused: int, add_bos: bool) -> Divergence:
    """Where the new prompt parted from the resident tokens (before any of them is dropped)."""
    backend, resident = session._backend, session.ctx.tokens
    start = 1 if add_bos and tokens and tokens[0] == backend.info.bos_token_id else 0
    return Divergence(
        token=reused,
        char=session._rt.spelled.count(tokens[start:reused]),
        old=spell(backend, resident[reused : reused + DIVERGENCE_TOKENS])[:DIVERGENCE_CHARS],
        new=spell(backend, tokens[reused : reused + DIVERGENCE_TOKENS])[:DIVERGENCE_CHARS],
        resident=len(resident),
    )


def _prefix_reason(
    session: Session, same: bool, manifest: ContextManifest, reused: int, n: int, salt: str | None
) -> str:
    resident = session._manifest
    if resident is None or not session.ctx.tokens:
        return f"cold: nothing resident; prefilled {n} tokens"
    if session.cache_salt != salt:  # says nothing of what the other salt's KV holds
        return f"cold: nothing resident under this cache salt; prefilled {n} tokens"
    if not same:
        return f"cold: manifest changed ({resident.diff(manifest)}); prefilled {n} tokens"
    if reused == 0:
        return f"cold: first token differs from the resident context; prefilled {n} tokens"
    if reused == n:
        return f"warm: all {n} prefix tokens were resident"
    return f"warm: reused {reused} of {n} prefix tokens; diverged at token {reused}, prefilled {n - reused}"


def reuse_mode(backend: Backend, mode: str | None = None) -> str:
    """The reuse mode a prompt asked for (None: the runtime's), checked against what the backend can."""
    if mode is None:
        return backend.config.reuse_mode
    if mode not in REUSE_MODES:
        raise InvalidInput(f"reuse_mode must be one of {', '.join(REUSE_MODES)}; got {mode!r}", param="reuse_mode")
    if mode == "chunks":
        why = backend.chunk_support()
        if why is not None:
            raise Unsupported("reuse_mode='chunks'", why)
    return mode
