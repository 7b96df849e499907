"""Opening an engine for a model source: a local model (engine.engine.Engine) or a remote server
(engine.remote.RemoteEngine, its API key from the key store or $GAPLESS_REMOTE_API_KEY: saved_key_first)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from engine.protocol import EngineLike
from engine.types import EngineOptions, Progress, is_remote

API_KEY_ENV = "GAPLESS_REMOTE_API_KEY"
keys_dir: Optional[Path] = None  # where the app keeps API keys (its config folder); None: the default one
# Which key a remote model is opened with where both are there: on the command line $GAPLESS_REMOTE_API_KEY is the
# key given for this run, before one saved for the server; in the app the key typed in the Remote dialog for
# that server comes first, the variable only where none was saved (app.gui sets this).
saved_key_first = False
# Whether a remote model's base URL is the app's own running server (app.serve_app.AppServer.serves; None outside
# the app): every load of a remote model is checked, from the Remote dialog, the Recent menu or asked for earlier.
own_server: Optional[Callable[[str], bool]] = None
SELF_REMOTE = (
    "it is this app's own server (the Server panel): a model cannot answer through itself (each would wait for "
    "the other); open the model itself instead"
)


def load_engine(
    source: str, options: EngineOptions, progress: Optional[Callable[[Progress], None]] = None
) -> EngineLike:
    if is_remote(source):  # httpx is imported only for a remote model
        from app.keys import KeyStore
        from app.paths import AppPaths
        from engine.remote import RemoteEngine, RemoteSource

        remote = RemoteSource.parse(source)
        serves = own_server
        if serves is not None and serves(remote.base_url):
            from engine.errors import ModelLoadError

            raise ModelLoadError(f"{remote.base_url}: {SELF_REMOTE}")
        saved = KeyStore(keys_dir or AppPaths.resolve().config).get(remote.base_url)
        given = os.environ.get(API_KEY_ENV)
        key = (saved or given) if saved_key_first else (given or saved)
        return RemoteEngine.load(remote, options, progress, api_key=key)
    from engine.engine import Engine

    return Engine.load(source, options, progress)
