"""Everything a route needs, built once per app: runtime, scheduler, pool, registry, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from ..runtime import Runtime
from ..scheduler import Scheduler
from ..tools import ToolFormat
from .admission import Admission
from .errors import ApiError
from .metrics import ServerMetrics
from .pool import SessionPool
from .registry import SessionRegistry
from .settings import ServerSettings


@dataclass
class ServerState:
    runtime: Runtime
    settings: ServerSettings
    scheduler: Scheduler
    pool: SessionPool
    registry: SessionRegistry
    admission: Admission
    metrics: ServerMetrics
    model_id: str
    tool_format: ToolFormat
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def aliases(self) -> tuple[str, ...]:
        p = Path(self.runtime.info.path)
        return (self.model_id, p.name, p.stem)

    def check_model(self, model: str) -> None:
        if model not in self.aliases:
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models)",
                code="model_not_found",
                param="model",
            )

    @property
    def queue_depth(self) -> int:
        return self.admission.waiting


def get_state(request: Request) -> ServerState:
    return request.app.state.warmkv


State = Annotated[ServerState, Depends(get_state)]
