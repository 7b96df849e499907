"""The window tests' shared fixtures: a data folder per test and the real app with the tiny model loaded."""

from __future__ import annotations

import pytest
from test_main_window import close_app, open_app


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "data"


@pytest.fixture
def app(qtbot, data_dir, tiny_llama):
    gui = open_app(qtbot, data_dir, tiny_llama)
    yield gui
    close_app(gui)
