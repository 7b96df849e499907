"""Opening an engine for a model source: a local model (engine.engine.Engine) or a remote server
(engine.remote.RemoteEngine, its API key from the key store or $GAPLESS_REMOTE_API_KEY)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from engine.protocol import EngineLike
from engine.types import EngineOptions, Progress, is_remote

API_KEY_ENV = "GAPLESS_REMOTE_API_KEY"
keys_dir: Optional[Path] = None  # where the app keeps API keys (its config folder); None: the default one


def load_engine(
    source: str, options: EngineOptions, progress: Optional[Callable[[Progress], None]] = None
) -> EngineLike:
    if is_remote(source):  # httpx is imported only for a remote model
        from app.keys import KeyStore
        from app.paths import AppPaths
        from engine.remote import RemoteEngine, RemoteSource

        remote = RemoteSource.parse(source)
        key = os.environ.get(API_KEY_ENV) or KeyStore(keys_dir or AppPaths.resolve().config).get(remote.base_url)
        return RemoteEngine.load(remote, options, progress, api_key=key)
    from engine.engine import Engine

    return Engine.load(source, options, progress)
