"""Where the engine keeps downloaded models and compiled artifacts (the user cache dir, or $GAPLESS_CACHE_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "gapless"


def cache_dir() -> Path:
    override = os.environ.get("GAPLESS_CACHE_DIR")
    path = Path(override) if override else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_cache_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_cache_dir() -> Path:
    path = cache_dir() / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    return path
