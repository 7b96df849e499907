"""Opening an engine for a model source: a local model (engine.engine.Engine) or a remote server
(engine.remote.RemoteEngine, its API key from the key store or $GAPLESS_REMOTE_API_KEY)."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from engine.types import EngineOptions, Progress

API_KEY_ENV = "GAPLESS_REMOTE_API_KEY"


def load_engine(source: str, options: EngineOptions, progress: Optional[Callable[[Progress], None]] = None) -> Any:
    from engine.remote import RemoteEngine, RemoteSource, is_remote

    if is_remote(source):
        from app.keys import KeyStore
        from app.paths import AppPaths

        remote = RemoteSource.parse(source)
        key = os.environ.get(API_KEY_ENV) or KeyStore(AppPaths.resolve().config).get(remote.base_url)
        return RemoteEngine.load(remote, options, progress, api_key=key)
    from engine.engine import Engine

    return Engine.load(source, options, progress)
