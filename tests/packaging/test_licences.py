"""packaging/licences.py, as the bundle's build runs it: every distribution Gapless runs on, here, has its licence
text written, Qt for Python's LGPL v3 with the GPL v3 it builds on, Python's own; one with none stops the build."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def licences():
    spec = importlib.util.spec_from_file_location("gapless_licences", ROOT / "packaging" / "licences.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_distribution_gapless_runs_on_has_its_licence_text_in_the_bundle(licences, tmp_path):
    from packaging.utils import canonicalize_name

    written = licences.write_licences(tmp_path)
    names = {canonicalize_name(n) for n in written}
    for required in ("torch", "transformers", "tokenizers", "pyside6-essentials", "shiboken6", "nvidia-ml-py",
                     "numpy", "uvicorn", "starlette", "pyqtgraph", "gguf", "safetensors"):  # fmt: skip
        assert required in names, f"{required}: no licence written"
    assert "gapless" not in names and "pytest" not in names  # its own sits at the top; the test tools are not in
    folders = {p.name: p for p in (tmp_path / "licenses").iterdir()}

    def folder(name: str) -> Path:
        [found] = [p for n, p in folders.items() if n == name or n.startswith(f"{name}-")]
        return found

    qt = folder("PySide6_Essentials")
    assert "GNU LESSER GENERAL PUBLIC LICENSE" in (qt / "LGPL-3.0.txt").read_text()
    assert "GNU GENERAL PUBLIC LICENSE" in (qt / "GPL-3.0.txt").read_text()
    nvml = (folder("nvidia-ml-py") / "LICENSE.txt").read_text()
    assert nvml.startswith("Copyright (c)") and "NVIDIA" in nvml and "Redistribution and use" in nvml
    assert "Apache License" in (folder("tokenizers") / "LICENSE-Apache-2.0.txt").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (folder("Python") / "LICENSE.txt").read_text()
    for path in folders.values():
        assert any(f.stat().st_size > 0 for f in path.rglob("*") if f.is_file()), f"{path.name}: empty"


def test_a_distribution_without_a_licence_text_stops_the_build_naming_it(licences, tmp_path, monkeypatch):
    monkeypatch.delitem(licences.NO_TEXT_IN_WHEEL, "tokenizers")  # its wheel carries no licence file
    with pytest.raises(SystemExit, match=r"no licence text found for: tokenizers \S+ \(licence: "):
        licences.write_licences(tmp_path)
