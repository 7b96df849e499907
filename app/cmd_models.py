"""`gapless models fetch-default | list`: the default model's path, and the models Gapless knows about."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional, TextIO

from app.paths import AppPaths
from app.registry import ModelEntry, RecentModels, default_model_entry, scan_models_folder
from app.terminal import printable
from engine.paths import user_path
from engine.types import Progress

log = logging.getLogger(__name__)


class LineProgress:
    """Progress as one line on a terminal that rewrites itself (\\r); on a pipe, a new line every few seconds."""

    def __init__(self, stream: TextIO, every_s: float = 2.0):
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every_s = every_s
        self._last = 0.0
        self._width = 0

    def __call__(self, p: Progress) -> None:
        pct = f"{p.fraction * 100:5.1f}% " if p.fraction is not None else ""
        line = f"{p.stage}: {pct}{p.message}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = max(self._width, len(line))
        else:
            now = time.monotonic()
            final = p.fraction is not None and p.fraction >= 1.0
            if now - self._last < self.every_s and not final:
                return
            self._last = now
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


def run_models(args: Any, paths: AppPaths) -> int:
    if args.models_command == "fetch-default":
        return fetch_default(sys.stdout, sys.stderr)
    if args.models_command == "list":
        return list_models(paths, sys.stdout)
    raise ValueError(f"unknown models action {args.models_command!r}")


def fetch_default(out: TextIO, err: TextIO) -> int:
    from engine.default_model import ensure_default_model

    progress = LineProgress(err)
    try:
        path = ensure_default_model(progress=progress)
    finally:
        progress.close()
    out.write(f"{path}\n")
    return 0


def list_models(paths: AppPaths, out: TextIO) -> int:
    recent = RecentModels(paths.config)
    rows: list[tuple[str, ModelEntry]] = [("default", default_model_entry())]
    rows += [("recent", e) for e in recent.entries()]
    folder = _models_folder(paths)
    if folder is not None:
        rows += [("folder", e) for e in scan_models_folder(folder)]
    for where, e in rows:
        size = f"{e.size_bytes / 1e6:.0f} MB" if e.size_bytes is not None else "n/a"
        state = e.note or ("" if e.present else "missing")
        line = f"{where:<8} {e.kind:<10} {size:>8}  {e.name}  {e.path or e.source}{f'  ({state})' if state else ''}"
        out.write(printable(line) + "\n")
    for notice in recent.notices:
        print(f"gapless: {notice}", file=sys.stderr)
    if folder is not None and not any(w == "folder" for w, _ in rows):
        found = "no models found in" if _is_dir(folder) else "the models folder is not there (a drive not plugged in?):"
        print(f"gapless: {found} {folder}", file=sys.stderr)
    return 0


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a folder on the way that cannot be entered
        return False


def _models_folder(paths: AppPaths) -> Optional[Path]:
    from app.settings import SettingsStore

    settings, notices = SettingsStore(paths.settings_file, read_only=True).load()  # a file it cannot use stays
    for notice in notices:
        print(f"gapless: {notice}", file=sys.stderr)
    return user_path(settings.models_folder) if settings.models_folder else None
