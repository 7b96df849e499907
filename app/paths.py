"""The app's folders: data (chats), config (settings), logs. Overridable for tests and the smoke test."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.paths import absolute, cache_dir, platform_dir


@dataclass(frozen=True)
class AppPaths:
    data: Path  # chats.sqlite3
    config: Path  # settings.json
    logs: Path  # gapless.log (rotating)
    cache: Path  # default model, compiled artifacts

    @classmethod
    def resolve(cls, data_dir: Optional[Path] = None) -> "AppPaths":
        """The platformdirs folders, or all four under `data_dir` (or $GAPLESS_DATA_DIR) when given."""
        root = data_dir or (Path(os.environ["GAPLESS_DATA_DIR"]) if os.environ.get("GAPLESS_DATA_DIR") else None)
        if root is not None:
            root = absolute(root, "the data folder (--data-dir, GAPLESS_DATA_DIR)")
            paths = cls(data=root / "data", config=root / "config", logs=root / "logs", cache=_cache_under(root))
        else:
            paths = cls(
                data=platform_dir("data"),
                config=platform_dir("config"),
                logs=platform_dir("log"),
                cache=cache_dir(),
            )
        return paths

    def ensure(self) -> "AppPaths":
        """The data and config folders made where missing; OutputPathError where one cannot be (a file in the way, no
        rights). The logs and the cache are not needed to run: where they cannot be made, the log file is left out
        (app.logs) and what the cache would keep is made again each time (engine.paths)."""
        from engine.errors import OutputPathError

        for p in (self.data, self.config):
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputPathError(f"cannot use {p} as a folder of the app's: {exc.strerror or exc}") from None
        return self

    @property
    def database(self) -> Path:
        return self.data / "chats.sqlite3"

    @property
    def settings_file(self) -> Path:
        return self.config / "settings.json"

    @property
    def log_file(self) -> Path:
        return self.logs / "gapless.log"


def _cache_under(root: Path) -> Path:
    # A private data dir still shares the model cache unless GAPLESS_CACHE_DIR says otherwise:
    # the smoke test must not download the default model again.
    return cache_dir()
