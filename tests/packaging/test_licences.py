"""packaging/licences.py, as the bundle's build runs it: every distribution Gapless runs on, here, has its licence
text written, Qt for Python's LGPL v3 with the GPL v3 it builds on, Python's own; one with none stops the build."""

from __future__ import annotations

import importlib.util
import shutil
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


def test_the_system_libraries_in_the_bundle_carry_their_packages_copyright_files(licences, tmp_path):
    """A library from the system goes with its package's copyright file, one per package; one from a wheel or from
    Python itself is covered by write_licences(); one that no package owns stops the build, naming it."""
    import site
    import sys

    docs = tmp_path / "doc"
    for package, text in (("libglib2.0-0", "glib: LGPL-2.1+\n"), ("zlib1g", "zlib licence\n")):
        (docs / package).mkdir(parents=True)
        (docs / package / "copyright").write_text(text)
    owners = {
        "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0": "libglib2.0-0",
        "/usr/lib/x86_64-linux-gnu/libgio-2.0.so.0": "libglib2.0-0",
        "/lib/x86_64-linux-gnu/libz.so.1": "zlib1g",
    }
    wheel = Path(site.getsitepackages()[0]) / "PySide6" / "Qt" / "lib" / "libQt6Core.so.6"
    binaries = [
        ("libglib-2.0.so.0", "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0"),
        ("libgio-2.0.so.0", "/usr/lib/x86_64-linux-gnu/libgio-2.0.so.0"),
        ("libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1"),
        ("PySide6/Qt/lib/libQt6Core.so.6", str(wheel)),
    ]

    def owner(path: Path):
        assert not str(path).startswith(str(wheel.parent)), "a wheel's library was looked up"
        return owners.get(path.as_posix())

    written = licences.write_system_licences(tmp_path / "out", binaries, owner=owner, doc_root=docs)
    assert written == {"libglib2.0-0": ["libgio-2.0.so.0", "libglib-2.0.so.0"], "zlib1g": ["libz.so.1"]}
    system = tmp_path / "out" / "licenses" / "system"
    assert sorted(p.relative_to(system).as_posix() for p in system.rglob("*") if p.is_file()) == [
        "libglib2.0-0/copyright",
        "zlib1g/copyright",
    ]
    assert (system / "libglib2.0-0" / "copyright").read_text() == "glib: LGPL-2.1+\n"

    toolkit = ("libcudart.so.13", "/usr/local/cuda-13.0/lib/libcudart.so.13")
    with pytest.raises(SystemExit) as stop:
        licences.write_system_licences(tmp_path / "out", [*binaries, toolkit], owner=owner, doc_root=docs)
    assert str(stop.value).startswith(
        "no licence text found for the system libraries: libcudart.so.13 (/usr/local/cuda-13.0/lib/libcudart.so.13: "
        "no package of this system owns it). Leave the library out"
    )
    if Path(sys.base_prefix).resolve() not in (Path("/usr"), Path("/")):  # a Python built apart: its licence
        python_lib = ("libpython3.so", str(Path(sys.base_prefix) / "lib" / "libpython3.so"))
        assert licences.write_system_licences(tmp_path / "out", [python_lib], owner=owner, doc_root=docs) == {}


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="a Debian system: dpkg knows each library's package")
def test_a_debian_library_is_found_with_its_copyright_file(licences, tmp_path):
    found = [
        p for p in (Path("/lib/x86_64-linux-gnu/libz.so.1"), Path("/usr/lib/x86_64-linux-gnu/libz.so.1")) if p.exists()
    ]
    if not found:
        pytest.skip("no x86_64 libz.so.1 here")
    libz = found[0]
    assert licences.debian_package(libz) == "zlib1g"
    written = licences.write_system_licences(tmp_path, [("libz.so.1", str(libz))])
    assert written == {"zlib1g": ["libz.so.1"]}
    copied = tmp_path / "licenses" / "system" / "zlib1g" / "copyright"
    assert copied.read_bytes() == Path("/usr/share/doc/zlib1g/copyright").read_bytes()


def test_a_build_without_dpkg_says_so_rather_than_that_no_package_owns_each_library(licences, monkeypatch, tmp_path):
    """Without dpkg-query every system library was reported as owned by no package, on any distribution but
    Debian's, which named the wrong cause."""

    def no_dpkg(*args, **kwargs):
        raise FileNotFoundError("dpkg-query")

    monkeypatch.setattr(licences.subprocess, "run", no_dpkg)
    with pytest.raises(SystemExit, match=r"cannot tell which package installed /usr/lib/libfoo\.so\.1: dpkg-query is"):
        licences.write_system_licences(tmp_path, [("libfoo.so.1", "/usr/lib/libfoo.so.1")])
