"""Everything a route needs, built once per app: runtime, scheduler, pool, registry, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from ..reasoning import parses
from ..runtime import Runtime
from ..scheduler import Scheduler
from ..tools import ToolFormat
from .admission import Admission
from .errors import ApiError
from .message_log import MessageLog
from .metrics import ServerMetrics
from .pool import SessionPool
from .reasoning_store import ReasoningStore
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
    messages_log: MessageLog = field(default_factory=MessageLog)  # /v1/messages fingerprints for diagnostics
    reasoning: ReasoningStore = field(default_factory=ReasoningStore)  # signed reasoning clients send back
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every name of the served model: its id, its file's name and stem, and the configured aliases."""
        p = Path(self.runtime.info.path)
        given = tuple(a for a in self.settings.model_aliases if a != "*")
        return tuple(dict.fromkeys((self.model_id, p.name, p.stem, *given)))

    def check_model(self, model: str, route: str = "openai") -> str:
        """The requested name (responses echo it), if it names the served model on this route; 404 otherwise.

        On the Ollama routes a name matches whatever its case, after its registry and namespace
        ("library/") and its ":tag" are dropped, and the model's GGUF basename is a name too:
        "smollm2:latest" and "SmolLM2-135M-Instruct.Q4_1:latest" name the default model.
        """
        anything = "*" in self.settings.model_aliases or (route == "anthropic" and not self.settings.model_aliases)
        if anything or model in self.aliases or (route == "ollama" and self._ollama_name(model)):
            return model
        if route == "ollama":  # Ollama's own wording first: clients look for "not found"
            raise ApiError(
                404,
                f"model '{model}' not found; this server serves '{self.model_id}' (GET /api/tags); "
                "`warmkv serve --model-alias NAME` adds a name",
                code="model_not_found",
                param="model",
            )
        raise ApiError(
            404,
            f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models); "
            "`warmkv serve --model-alias NAME` adds a name",
            code="model_not_found",
            param="model",
        )

    def _ollama_name(self, model: str) -> bool:
        base = model.rsplit("/", 1)[-1].split(":", 1)[0].lower()
        basename = self.runtime.info.metadata.get("general.basename", "")
        return base in {n.lower() for n in (*self.aliases, basename) if n}

    @property
    def thinks(self) -> bool:
        """Whether replies' think blocks are parsed out (so reasoning comes back, and is taken back)."""
        return parses(self.settings.reasoning_format, self.runtime.template_choice.source)

    @property
    def queue_depth(self) -> int:
        return self.admission.waiting


def get_state(request: Request) -> ServerState:
    return request.app.state.warmkv


State = Annotated[ServerState, Depends(get_state)]
