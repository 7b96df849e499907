"""Test configuration: headless Qt, a private data dir per test session, tiny-model and default-model fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # The fused Triton kernels are tested through Triton's interpreter, which Triton chooses at its own import.
    os.environ.setdefault("GAPLESS_TRITON_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _private_dirs(tmp_path_factory):
    """Chats, settings and logs of the tests never touch the user's; the model cache is shared on purpose."""
    root = tmp_path_factory.mktemp("gapless-data")
    old = os.environ.get("GAPLESS_DATA_DIR")
    os.environ["GAPLESS_DATA_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("GAPLESS_DATA_DIR", None)
    else:
        os.environ["GAPLESS_DATA_DIR"] = old


@pytest.fixture(scope="session")
def _light_look(qapp):
    """Qt tests start on the look a window gives the application by default (Fusion, the light palette and style
    sheet): a window opened on it does not set it again, where a look set back to Qt's own after each test would
    be set again by each window, re-polishing every widget alive each time."""
    from ui.theme import ThemeManager

    ThemeManager(qapp, "light")


def _top_level_addresses() -> set[int]:
    """The top-level widgets alive, by their C++ address (a widget made in C++ gets a new Python wrapper each
    time it is listed, so wrappers cannot be compared)."""
    import shiboken6
    from PySide6.QtWidgets import QApplication

    return {shiboken6.getCppPointer(w)[0] for w in QApplication.topLevelWidgets()}


def _delete_new_windows(before: set[int]) -> None:
    """Delete the windows a test opened: left alive, each (about 860 widgets) stays polished and styled by every
    later test's theme switch. Only windows and dialogs, and whatever is still showing: pyqtgraph keeps its plots'
    menus and their option groups as parentless widgets that its plots use while they are deleted."""
    import shiboken6
    from PySide6.QtCore import QEvent
    from PySide6.QtWidgets import QApplication, QDialog, QMainWindow

    for w in QApplication.topLevelWidgets():
        if shiboken6.getCppPointer(w)[0] in before:
            continue
        if isinstance(w, (QMainWindow, QDialog)) or w.isVisible():
            w.close()
            w.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)


@pytest.fixture(autouse=True)
def _restore_app_look(request):
    """A window themes the whole application (style sheet, palette, style); every Qt test leaves the look as it
    found it, so a later test sees the look it started with."""
    if not {"qapp", "qtbot"} & set(request.fixturenames):
        yield
        return
    from PySide6.QtGui import QPalette

    qapp = request.getfixturevalue("qapp")
    request.getfixturevalue("_light_look")
    from PySide6.QtWidgets import QApplication, QDialog

    sheet, palette, style = qapp.styleSheet(), QPalette(qapp.palette()), qapp.style().name()
    before = _top_level_addresses()
    yield
    # A dialog a test left open would be seen by the next test's "no message box is showing" checks.
    for w in QApplication.topLevelWidgets():
        if isinstance(w, QDialog) and w.isVisible():
            w.reject()
    _delete_new_windows(before)
    # Only what changed is set back: each set re-polishes every widget alive, which is slow with many of them.
    if qapp.styleSheet() != sheet:
        qapp.setStyleSheet(sheet)
    if qapp.palette() != palette:
        qapp.setPalette(palette)
    if qapp.style().name() != style:
        qapp.setStyle(style)


@pytest.fixture
def ctl(qtbot):
    """An engine controller with a real worker thread (no model loaded), shut down after the test."""
    from app.worker import EngineController, EngineWorker

    controller = EngineController(EngineWorker())
    yield controller
    assert controller.shutdown(60)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """make(family, **overrides) -> a tiny model folder, cached per arguments for the session."""
    from tiny_models import make_tiny_model

    made: dict = {}

    def make(family: str = "llama", **kw) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1 GGUF), fetched once into the shared cache."""
    from engine.default_model import ensure_default_model

    return ensure_default_model()


def memory_for_candidates(monkeypatch, most: int) -> None:
    """The engine runs out of device memory for a batch of more than `most` candidates (simulated on any device)."""
    import torch

    from engine.engine import Engine

    real = Engine._runner

    def tight(self, opts, batch, needed):
        if batch > most:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, opts, batch, needed)

    monkeypatch.setattr(Engine, "_runner", tight)


@pytest.fixture
def memory_for_two_candidates(monkeypatch):
    """The engine runs out of device memory for a batch of more than two candidates (simulated on any device)."""
    memory_for_candidates(monkeypatch, 2)


@pytest.fixture
def memory_for_one_candidate(monkeypatch):
    """The engine runs out of device memory for any batch of candidates (simulated on any device)."""
    memory_for_candidates(monkeypatch, 1)
