"""The check `make run` does before the window opens: the xcb plugin's missing system libraries, and the one
apt-get line that installs them."""

from __future__ import annotations

from pathlib import Path

from app import qt_deps

# What ldd prints for PySide6 6.11's libqxcb.so on a minimal Ubuntu 22.04 with X but without the xcb extras.
LDD_MISSING = """\
\tlinux-vdso.so.1 (0x00007ffc4d7f2000)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/plugins/platforms/../../lib/libQt6XcbQpa.so.6 (0x00007f0c1c400000)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-cursor.so.0 => not found
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f0c1c3d0000)
\tlibxcb-icccm.so.4 => not found
\tlibxkbcommon-x11.so.0 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0c1bc00000)
"""
LDD_COMPLETE = "\n".join(line for line in LDD_MISSING.splitlines() if "not found" not in line)
X11 = {"DISPLAY": ":0"}


def fake_ldd(output: str, calls: list):
    def run(argv):
        calls.append(argv)
        return output

    return run


def test_missing_libraries_are_read_from_ldd_once_each():
    assert qt_deps.not_found(LDD_MISSING) == [
        "libxcb-icccm.so.4",
        "libxcb-keysyms.so.1",
        "libxcb-cursor.so.0",
        "libxkbcommon-x11.so.0",
    ]
    assert qt_deps.not_found(LDD_COMPLETE) == []


def test_the_install_line_names_each_package_once():
    line = qt_deps.install_line(["libxcb-keysyms.so.1", "libxcb-icccm.so.4", "libxkbcommon-x11.so.0"])
    assert line == "sudo apt-get install -y libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0"
    assert qt_deps.install_line(["libxcb-cursor.so.0", "libweird.so.9"]) == (
        "sudo apt-get install -y libxcb-cursor0\n(and the packages providing libweird.so.9)"
    )


def test_check_runs_ldd_on_the_plugin_and_says_what_to_install(tmp_path):
    plugin = tmp_path / "libqxcb.so"
    plugin.write_bytes(b"")
    calls: list = []
    ok, message = qt_deps.check(fake_ldd(LDD_MISSING, calls), plugin, X11)
    assert not ok and calls == [["ldd", str(plugin)]]
    assert "missing libxcb-icccm.so.4, libxcb-keysyms.so.1, libxcb-cursor.so.0, libxkbcommon-x11.so.0" in message
    assert message.endswith("sudo apt-get install -y libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0")
    ok, message = qt_deps.check(fake_ldd(LDD_COMPLETE, calls), plugin, X11)
    assert ok and "finds all its libraries" in message


def test_nothing_is_checked_where_qt_will_not_use_xcb(tmp_path):
    calls: list = []
    for env in (
        {"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"},
        {"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"},
        {},
    ):
        ok, _ = qt_deps.check(fake_ldd(LDD_MISSING, calls), tmp_path / "libqxcb.so", env)
        assert ok
    assert calls == []
    assert qt_deps.xcb_in_use({"QT_QPA_PLATFORM": "xcb"}) and qt_deps.xcb_in_use({"QT_QPA_PLATFORM": "xcb:foo"})


def test_the_installed_plugin_is_checked_with_the_real_ldd():
    plugin = qt_deps.xcb_plugin()
    assert plugin is not None and plugin.name == "libqxcb.so"
    missing = qt_deps.missing_libraries(plugin)
    import subprocess

    real = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True).stdout
    assert missing == [line.split("=>")[0].strip() for line in dict.fromkeys(real.splitlines()) if "not found" in line]
    assert all(lib in qt_deps.XCB_PACKAGES for lib in missing), missing  # each gets its package named
    assert Path(plugin).exists()
