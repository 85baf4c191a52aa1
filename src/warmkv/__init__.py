"""warmkv: keep the KV cache of a stable prefix warm; re-prefill only what changed."""

# First: before torch or llama.cpp loads libgomp, which reads its settings once (_threads.py).
from . import _threads  # noqa: F401
from .backends import available_backends, registered_backends
from .config import DecodeConfig, RuntimeConfig
from .engine.completions import Completion
from .engine.runtime import Runtime
from .engine.session import Session
from .errors import (
    BackendUnavailable,
    CacheCorrupt,
    CacheEntryGone,
    CacheFull,
    ContextOverflow,
    EngineError,
    ForwardFailed,
    InvalidConfig,
    InvalidInput,
    InvalidModelFile,
    KVCacheFull,
    ManifestMismatch,
    ModelNotFound,
    ModelUnloaded,
    NoPrefix,
    RestoreMismatch,
    SchedulerClosed,
    SessionBusy,
    SessionClosed,
    SessionFatal,
    SessionLimit,
    SnapshotNotFound,
    StoreCorrupt,
    StoreError,
    StoreFull,
    StoreNoSpace,
    StreamLimit,
    Unsupported,
    WarmkvError,
)
from .manifest import ContextManifest, Segment, hash_token_ids
from .models import default_model_path
from .prompt.constraint import Constraint
from .types import (
    ContextReport,
    Divergence,
    PrefixInput,
    PrefixStatus,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenLogprob,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "CacheCorrupt",
    "CacheEntryGone",
    "CacheFull",
    "Completion",
    "Constraint",
    "ContextManifest",
    "ContextOverflow",
    "ContextReport",
    "DecodeConfig",
    "Divergence",
    "EngineError",
    "ForwardFailed",
    "InvalidConfig",
    "InvalidInput",
    "InvalidModelFile",
    "KVCacheFull",
    "ManifestMismatch",
    "ModelNotFound",
    "ModelUnloaded",
    "NoPrefix",
    "PrefixInput",
    "PrefixStatus",
    "RestoreMismatch",
    "Runtime",
    "RuntimeConfig",
    "SchedulerClosed",
    "Segment",
    "Session",
    "SessionBusy",
    "SessionClosed",
    "SessionFatal",
    "SessionLimit",
    "SnapshotNotFound",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreNoSpace",
    "StreamChunk",
    "StreamLimit",
    "SuffixInput",
    "SuffixStatus",
    "TokenLogprob",
    "Unsupported",
    "Usage",
    "WarmkvError",
    "available_backends",
    "default_model_path",
    "hash_token_ids",
    "registered_backends",
]
