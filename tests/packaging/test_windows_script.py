"""packaging/windows/gapless.iss read as Inno Setup reads it (it is compiled on Windows only): the files it names
relative to its folder exist, the licence page shows the project's licence, and the AppId that ties upgrades and
the uninstaller together is the one released."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "packaging" / "windows" / "gapless.iss"


def setup_section() -> dict[str, str]:
    text = SCRIPT.read_text(encoding="utf-8")
    section = re.search(r"^\[Setup\]\n(.*?)^\[", text, re.S | re.M)
    assert section, "no [Setup] section"
    out = {}
    for line in section.group(1).splitlines():
        if line.strip() and not line.lstrip().startswith((";", "#")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_the_licence_page_shows_the_project_s_licence():
    setup = setup_section()
    licence = SCRIPT.parent / setup["LicenseFile"].replace("\\", "/")  # from the script's folder, its SourceDir
    assert licence.resolve() == (ROOT / "LICENSE").resolve()
    assert "Apache License" in licence.read_text(encoding="utf-8")


def test_the_app_id_is_the_released_one_and_install_is_per_user():
    setup = setup_section()
    assert setup["AppId"] == "{{6A73AAFB-9802-4AFB-A844-2620C6453521}"  # changing it orphans installed copies
    assert setup["PrivilegesRequired"] == "lowest"


def test_the_build_script_looks_for_inno_setup_before_it_builds():
    """build.ps1 looked for ISCC.exe only after the default model's download and PyInstaller's build (several
    minutes), then stopped for want of it: the missing compiler is said at once now."""
    lines = (ROOT / "packaging" / "windows" / "build.ps1").read_text(encoding="utf-8").splitlines()

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line) and not line.lstrip().startswith("#"))

    check = first(r"Test-Path \$Iscc")
    assert "throw" in lines[check]
    assert check < first(r"models fetch-default") < first(r"-m PyInstaller") < first(r"& \$Iscc ")


def test_the_build_script_puts_the_checkout_before_the_user_s_pythonpath():
    """build.ps1 set PYTHONPATH to the checkout alone, dropping what the user had there (build.sh adds to it): each
    assignment keeps the user's entries after the checkout, with Windows's ";" between, and no empty entry (the
    current folder) where PYTHONPATH was unset."""
    lines = (ROOT / "packaging" / "windows" / "build.ps1").read_text(encoding="utf-8").splitlines()
    assignments = [line.strip() for line in lines if re.match(r"\s*\$env:PYTHONPATH\s*=", line, re.I)]
    assert assignments == ['$env:PYTHONPATH = if ($env:PYTHONPATH) { "$Root;$env:PYTHONPATH" } else { $Root }']
