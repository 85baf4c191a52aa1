"""Every warmkv error type, in one place.

All errors subclass :class:`WarmkvError`. They carry the numbers that explain
them as attributes and in the message, so a caller can both read and act on them.
"""

from __future__ import annotations


class WarmkvError(Exception):
    """Base class of every error warmkv raises on purpose."""


class InvalidInput(WarmkvError, ValueError):
    """An argument of a public call is malformed; nothing was changed."""


class InvalidConfig(InvalidInput):
    """A configuration value is out of range or inconsistent."""


class ModelNotFound(WarmkvError, FileNotFoundError):
    """The model path does not exist, or the default model is not installed."""


class InvalidModelFile(WarmkvError):
    """The model file exists but is not a loadable model (e.g. not GGUF)."""


class BackendUnavailable(WarmkvError):
    """The requested backend is unknown or its dependencies are not installed."""


class Unsupported(WarmkvError):
    """The backend or model cannot do what was asked."""

    def __init__(self, feature: str, detail: str = "") -> None:
        self.feature = feature
        super().__init__(f"unsupported: {feature}" + (f" ({detail})" if detail else ""))


class SessionClosed(WarmkvError):
    """A call was made on a session after close()."""


class SessionLimit(WarmkvError):
    """More sessions were opened than the model has sequence slots for."""

    def __init__(self, open_sessions: int, n_seq_max: int) -> None:
        self.open_sessions = open_sessions
        self.n_seq_max = n_seq_max
        super().__init__(
            f"cannot open another session: {open_sessions} of n_seq_max={n_seq_max} "
            "sequence slots are in use; close a session or raise n_seq_max"
        )


class NoPrefix(WarmkvError):
    """prefill_suffix or decode was called before ensure_prefix."""


class ContextOverflow(WarmkvError):
    """The tokens asked for do not fit the context window. Nothing resident was lost."""

    def __init__(self, stage: str, resident: int, additional: int, num_ctx: int) -> None:
        self.stage = stage
        self.resident = resident
        self.additional = additional
        self.num_ctx = num_ctx
        super().__init__(
            f"context overflow at {stage}: {resident} resident + {additional} new tokens "
            f"= {resident + additional} > num_ctx={num_ctx}"
        )


class ManifestMismatch(WarmkvError):
    """Resident or stored KV was computed under another manifest; reuse would be wrong."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"manifest mismatch: {reason}")


class SessionFatal(WarmkvError):
    """The backend failed in a way that leaves the session's KV unknown; evict the session."""


class ModelUnloaded(WarmkvError):
    """The runtime (and its model) was closed."""
