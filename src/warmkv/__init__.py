"""warmkv: keep the KV cache of a stable prefix warm; re-prefill only what changed."""

from .backends import available_backends, registered_backends
from .config import DecodeConfig, RuntimeConfig
from .constraint import Constraint
from .errors import (
    BackendUnavailable,
    CacheCorrupt,
    CacheEntryGone,
    CacheFull,
    ContextOverflow,
    InvalidConfig,
    InvalidInput,
    InvalidModelFile,
    KVCacheFull,
    ManifestMismatch,
    ModelNotFound,
    ModelUnloaded,
    NoPrefix,
    SessionClosed,
    SessionFatal,
    SessionLimit,
    SnapshotNotFound,
    StoreCorrupt,
    StoreError,
    StoreFull,
    Unsupported,
    WarmkvError,
)
from .manifest import ContextManifest, Segment, hash_token_ids
from .models import default_model_path
from .runtime import Completion, Runtime
from .session import Session
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
    "Runtime",
    "RuntimeConfig",
    "Segment",
    "Session",
    "SessionClosed",
    "SessionFatal",
    "SessionLimit",
    "SnapshotNotFound",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StreamChunk",
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
