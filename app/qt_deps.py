"""Before the window opens on an X11 desktop: are the system libraries of Qt's xcb platform plugin there?

Without them Qt only says "Could not load the Qt platform plugin "xcb"" and aborts. This asks `ldd` which
libraries the plugin (and what it links) cannot find, names the Debian/Ubuntu packages that hold them and
prints the one `apt-get install` line. `python -m app.qt_deps` exits 1 when something is missing (`make run`
runs it first), 0 otherwise or where the xcb plugin is not the one Qt will use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

# The shared libraries Qt 6's xcb plugin needs beyond a base system, and the Debian/Ubuntu package of each.
XCB_PACKAGES: dict[str, str] = {
    "libxcb.so.1": "libxcb1",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-xinput.so.0": "libxcb-xinput0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0",
}

Runner = Callable[[list[str]], str]  # argv -> stdout


def xcb_plugin() -> Optional[Path]:
    """The xcb platform plugin of the installed PySide6, if it has one."""
    import PySide6

    path = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return path if path.exists() else None


def not_found(ldd_output: str) -> list[str]:
    """The libraries `ldd` reports as "not found", once each, in the order it names them."""
    out: list[str] = []
    for line in ldd_output.splitlines():
        name, sep, where = line.strip().partition("=>")
        if sep and where.strip() == "not found" and name.strip() not in out:
            out.append(name.strip())
    return out


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout


def missing_libraries(plugin: Path, run: Runner = _run) -> list[str]:
    """What the plugin, or a library it links, cannot find (ldd lists the whole tree)."""
    return not_found(run(["ldd", str(plugin)]))


def install_line(missing: list[str]) -> str:
    """The one apt-get line that installs the packages of `missing` (a library of no known package is named
    after the line)."""
    packages = sorted({XCB_PACKAGES[lib] for lib in missing if lib in XCB_PACKAGES})
    unknown = [lib for lib in missing if lib not in XCB_PACKAGES]
    line = f"sudo apt-get install -y {' '.join(packages)}" if packages else ""
    if unknown:
        line += ("\n" if line else "") + f"(and the packages providing {', '.join(unknown)})"
    return line


def xcb_in_use(environ: Optional[dict] = None) -> bool:
    """Qt will try the xcb plugin: on Linux, with an X display, and no other platform asked for."""
    env = os.environ if environ is None else environ
    platform = env.get("QT_QPA_PLATFORM", "")
    if platform:
        return platform.split(":")[0].split(";")[0] == "xcb"
    return sys.platform.startswith("linux") and bool(env.get("DISPLAY")) and not env.get("WAYLAND_DISPLAY")


def check(run: Runner = _run, plugin: Optional[Path] = None, environ: Optional[dict] = None) -> tuple[bool, str]:
    """(ok, message for the user)."""
    if not xcb_in_use(environ):
        return True, "the xcb platform plugin is not in use here; nothing to check"
    plugin = plugin or xcb_plugin()
    if plugin is None:
        return True, "this PySide6 has no xcb platform plugin"
    if run is _run and shutil.which("ldd") is None:
        return True, "ldd is not installed: the xcb plugin's libraries were not checked"
    missing = missing_libraries(plugin, run)
    if not missing:
        return True, "the xcb platform plugin finds all its libraries"
    return False, (
        f"Qt's xcb platform plugin cannot start: missing {', '.join(missing)}.\n"
        f"Install them with:\n  {install_line(missing)}"
    )


def main() -> int:
    ok, message = check()
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
