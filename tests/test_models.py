"""Model lookup: the names -m accepts, and Gemma 3 270M assembled by the set-up."""

from __future__ import annotations

import pytest

from warmkv import models
from warmkv.errors import ModelNotFound


def test_names_resolve_to_the_installed_files() -> None:
    assert models.resolve_model("smollm2-135m") == models.default_model_path()
    gemma = models.resolve_model("gemma3-270m")
    assert gemma.name == models.GEMMA3_FILE
    assert models._sha256(gemma) == models.GEMMA3_SHA256


def test_unknown_name_is_not_found() -> None:
    with pytest.raises(ModelNotFound, match="gemma4-1b"):
        models.resolve_model("gemma4-1b")
