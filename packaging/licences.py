"""The licence texts the bundle carries: those of every distribution Gapless runs on (its requirements, followed
through theirs, as installed) and Python's own, each in licenses/<distribution>/ inside the bundle.

Most wheels carry their licence files in their .dist-info; for the few that carry none, the text of the licence
their metadata names is taken from where it is (packaging/licenses/, a module's header). A distribution with
neither stops the build, naming it: a bundle is not shipped without the texts its licences ask to go with it.

The shared libraries PyInstaller takes from the build machine's system rather than from a wheel (glib, OpenSSL,
libstdc++, the X11 and xcb libraries Qt's plugins load, ...) carry the copyright file of the package that
installed them, in licenses/system/<package>/ (Debian's /usr/share/doc/<package>/copyright); one that no package
owns stops the build the same way.

    python packaging/licences.py OUT    writes OUT/licenses/ and prints what it holds
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, Optional

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEXTS = HERE / "licenses"
LICENCE_FILE = re.compile(r"^(licen[cs]e|copying|notice|authors)", re.IGNORECASE)


def _shipped(*names: str) -> Callable[[md.Distribution], dict[str, str]]:
    """The licence named, from packaging/licenses/ (the wheel carries no text of it)."""
    return lambda _dist: {name: (TEXTS / name).read_text(encoding="utf-8") for name in names}


def _apache(_dist: md.Distribution) -> dict[str, str]:
    return {"LICENSE-Apache-2.0.txt": (ROOT / "LICENSE").read_text(encoding="utf-8")}  # the same licence as ours


def _module_header(module: str) -> Callable[[md.Distribution], dict[str, str]]:
    """The licence as the module's own leading comment states it (its wheel ships the module's source)."""

    def read(dist: md.Distribution) -> dict[str, str]:
        source = dist.locate_file(module)
        lines = []
        for line in Path(str(source)).read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            if line.strip("#"):  # a rule of #s frames it
                lines.append(line[1:].removeprefix(" "))
        text = "\n".join(lines).strip()
        if "Redistribution" not in text:
            raise ValueError(f"{module} no longer starts with its licence")
        return {"LICENSE.txt": text + "\n"}

    return read


# Distributions whose wheels carry no licence file, by canonical name: where the text of the licence their
# metadata names comes from. Qt for Python is used under the LGPL v3, which is the GPL v3 with more permissions:
# both texts go with it.
NO_TEXT_IN_WHEEL: dict[str, Callable[[md.Distribution], dict[str, str]]] = {
    "pyside6-essentials": _shipped("LGPL-3.0.txt", "GPL-3.0.txt"),
    "shiboken6": _shipped("LGPL-3.0.txt", "GPL-3.0.txt"),
    "tokenizers": _apache,
    "kernels": _apache,
    "nvidia-ml-py": _module_header("pynvml.py"),
}


# Distributions the code imports where they are installed, not among its requirements: in the bundle (with their
# requirements) whenever the build's environment has them. Triton: the fused CUDA kernels (a requirement of the
# CUDA torch wheels, installed beside a CPU one too). The other optional imports are left out of the bundle
# (packaging/bundle_modules.py EXCLUDES).
OPTIONAL_IMPORTS = ("triton",)


def runtime_distributions(root: str = "gapless", extras: tuple[str, ...] = ()) -> list[md.Distribution]:
    """`root` and every distribution its requirements name on this machine, followed through theirs (the ones
    the environment's markers leave out are left out; an optional one not installed is skipped), and those of
    OPTIONAL_IMPORTS installed here."""
    env = default_environment()
    seen: dict[str, md.Distribution] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    for name in OPTIONAL_IMPORTS:
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            continue
        todo.append((name, ()))
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if key == canonicalize_name(root):
                raise
            continue  # a requirement of a requirement this machine does without (its marker said so elsewhere)
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(
                req.marker.evaluate({**env, "extra": extra}) for extra in (wanted or ("",))
            ):
                continue
            todo.append((req.name, tuple(req.extras)))
    return [seen[k] for k in sorted(seen)]


def licence_texts(dist: md.Distribution) -> dict[str, str]:
    """File name -> text of the licence files `dist` carries (in its .dist-info, licenses/ included), else of the
    licence NO_TEXT_IN_WHEEL finds for it; {} where there is none."""
    found: dict[str, str] = {}
    for f in dist.files or []:
        parts = f.parts
        if not parts or not parts[0].endswith(".dist-info"):
            continue
        inside = parts[1:]
        if (inside[:1] == ("licenses",) and len(inside) > 1) or (len(inside) == 1 and LICENCE_FILE.match(inside[0])):
            name = "/".join(inside[1:] if inside[:1] == ("licenses",) else inside)
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                found[name] = path.read_text(encoding="utf-8", errors="replace")
    if not found:
        fallback = NO_TEXT_IN_WHEEL.get(canonicalize_name(dist.metadata["Name"]))
        if fallback is not None:
            found = fallback(dist)
    return found


def python_licence() -> Optional[Path]:
    """Python's own LICENSE.txt (the interpreter and its standard library are in the bundle)."""
    for folder in (Path(sysconfig.get_paths()["stdlib"]), Path(sys.base_prefix)):
        if (folder / "LICENSE.txt").is_file():
            return folder / "LICENSE.txt"
    return None


def write_licences(out: Path, root: str = "gapless") -> dict[str, list[str]]:
    """Write out/licenses/<distribution>/<file> for every runtime distribution, and Python's; returns what was
    written. Raises SystemExit naming every distribution with no licence text to be found."""
    target = out / "licenses"
    if target.exists():
        shutil.rmtree(target)
    written: dict[str, list[str]] = {}
    missing = []
    for dist in runtime_distributions(root):
        name = dist.metadata["Name"]
        if canonicalize_name(name) == canonicalize_name(root):
            continue  # Gapless's own LICENSE and NOTICE sit at the bundle's top
        texts = licence_texts(dist)
        if not texts:
            missing.append(f"{name} {dist.version} (licence: {dist.metadata.get('License') or 'not stated'})")
            continue
        folder = target / f"{name}-{dist.version}"
        for file, text in texts.items():
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(text, encoding="utf-8")
        written[name] = sorted(texts)
    if missing:
        raise SystemExit(
            "no licence text found for: " + "; ".join(missing) + ". Add where its text comes from to "
            "NO_TEXT_IN_WHEEL in packaging/licences.py"
        )
    python = python_licence()
    if python is None:
        raise SystemExit(f"Python's LICENSE.txt is not in {sysconfig.get_paths()['stdlib']} or {sys.base_prefix}")
    (target / "Python").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(python, target / "Python" / "LICENSE.txt")
    written["Python"] = ["LICENSE.txt"]
    return written


# ---- shared libraries from the build machine's system -------------------------------------------------------------


def _under(path: Path, folders: Iterable[Path]) -> bool:
    return any(path == f or f in path.parents for f in folders)


def debian_package(path: Path) -> Optional[str]:
    """The Debian package that installed `path`, or None where no package owns it (SystemExit without dpkg). Tried as given and
    resolved, with and without /usr in front: with merged /usr a library is listed under /lib or /usr/lib."""
    candidates = [path, path.resolve()]
    for c in list(candidates):
        text = c.as_posix()
        candidates.append(Path(text[len("/usr") :] if text.startswith("/usr/") else "/usr" + text))
    for c in dict.fromkeys(candidates):
        try:
            done = subprocess.run(["dpkg-query", "-S", c.as_posix()], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise SystemExit(
                f"cannot tell which package installed {path}: dpkg-query is not here. The bundle's system libraries "
                "are matched to their packages' licence texts through Debian's package database: build on Debian or "
                "Ubuntu"
            ) from None
        if done.returncode == 0 and done.stdout:
            # "zlib1g:amd64: /lib/x86_64-linux-gnu/libz.so.1"; several packages are listed as "a, b: path"
            return done.stdout.split(": ", 1)[0].split(",")[0].split(":")[0].strip()
    return None


def write_system_licences(
    out: Path,
    binaries: Iterable[tuple[str, str]],
    owner: Callable[[Path], Optional[str]] = debian_package,
    doc_root: Path = Path("/usr/share/doc"),
) -> dict[str, list[str]]:
    """For the bundle's libraries, as (name in the bundle, source path): out/licenses/system/<package>/copyright for
    each package that installed one of those that come from the system, not from a wheel or from Python itself
    (whose texts write_licences() writes); returns package -> the bundle's libraries from it. Raises SystemExit
    naming every library whose package or copyright file cannot be found."""
    target = out / "licenses" / "system"
    if target.exists():
        shutil.rmtree(target)
    wheels = [Path(p).resolve() for p in {*site.getsitepackages(), *sysconfig.get_paths().values()} if p]
    python = Path(sys.base_prefix).resolve()
    own_python = python not in (Path("/usr"), Path("/"))  # pyenv, python.org, a conda base: not the system's
    found: dict[str, list[str]] = {}
    missing = []
    for name, source in binaries:
        path = Path(os.path.abspath(source))
        if _under(path, wheels) or _under(path.resolve(), wheels):
            continue
        if own_python and _under(path, [python]):
            continue  # libpython and lib-dynload of a Python built apart from the system's: Python's licence
        package = owner(path)
        if package is None:
            missing.append(f"{name} ({source}: no package of this system owns it)")
            continue
        copyright_file = doc_root / package / "copyright"
        if not copyright_file.is_file():
            missing.append(f"{name} ({source}: package {package} has no {copyright_file})")
            continue
        if package not in found:
            (target / package).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(copyright_file, target / package / "copyright")
        found.setdefault(package, []).append(name)
    if missing:
        raise SystemExit(
            "no licence text found for the system libraries: " + "; ".join(missing) + ". Leave the library out "
            "of the bundle (packaging/gapless.spec) or build where a package installed it"
        )
    return {package: sorted(names) for package, names in sorted(found.items())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python packaging/licences.py OUT")
    for dist, files in write_licences(Path(sys.argv[1])).items():
        print(f"{dist}: {', '.join(files)}")
