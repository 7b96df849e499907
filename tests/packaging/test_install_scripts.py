"""packaging/linux/install.sh and uninstall.sh on a small stand-in for the bundle: what goes where, the manifest,
that uninstall removes exactly what was installed, and that the user's data stays unless --purge.

The real bundle is checked end to end by packaging/check_install.sh (it needs a PyInstaller build)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the Linux installer scripts")

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "packaging" / "linux"
VERSION = "9.8.7"


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """An unpacked installer archive whose bundle is a shell script, a library stand-in, a subfolder and a link."""
    top = tmp_path / "gapless-archive"
    bundle = top / "gapless"
    (bundle / "_internal" / "models").mkdir(parents=True)
    exe = bundle / "gapless"
    exe.write_text(f'#!/bin/sh\necho "gapless {VERSION} $*"\n')
    exe.chmod(0o755)
    (bundle / "_internal" / "libpython3.11.so.1.0").write_bytes(b"\x7fELF stand-in")
    (bundle / "_internal" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(64))
    (bundle / "_internal" / "libpython3.so").symlink_to("libpython3.11.so.1.0")
    share = top / "share"
    share.mkdir()
    shutil.copy(LINUX / "gapless.desktop", share / "gapless.desktop")
    shutil.copy(ROOT / "assets" / "gapless.svg", share / "gapless.svg")
    (share / "gapless-256.png").write_bytes(b"\x89PNG stand-in")
    (share / "VERSION").write_text(VERSION + "\n")
    for script in ("install.sh", "uninstall.sh"):
        shutil.copy(LINUX / script, top / script)
        (top / script).chmod(0o755)
    return top


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def user_env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), PATH=f"{home}/.local/bin:/usr/bin:/bin", **extra)
    return env


def run(
    script: Path, *args: str, env: dict, ok: bool = True, cwd: Optional[Path] = None
) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, f"{script.name} {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def tree(root: Path) -> set[str]:
    """Every path under root, relative, folders marked with a trailing slash."""
    out = set()
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        out.add(rel + "/" if p.is_dir() and not p.is_symlink() else rel)
    return out


def manifest_paths(app_dir: Path) -> list[str]:
    lines = (app_dir / "install-manifest.txt").read_text().splitlines()
    return [line[2:] for line in lines if line and not line.startswith("#")]


def test_per_user_install_puts_each_part_in_its_xdg_place(archive: Path, home: Path):
    env = user_env(home)
    out = run(archive / "install.sh", env=env).stdout
    app = home / ".local/share/gapless-app"
    launcher = home / ".local/bin/gapless"
    desktop = home / ".local/share/applications/gapless.desktop"
    svg = home / ".local/share/icons/hicolor/scalable/apps/gapless.svg"
    png = home / ".local/share/icons/hicolor/256x256/apps/gapless.png"

    assert (app / "_internal/models/SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"GGUF" + bytes(64)
    assert os.readlink(app / "_internal/libpython3.so") == "libpython3.11.so.1.0"  # relative links kept as links
    assert os.access(app / "uninstall.sh", os.X_OK)
    assert launcher.is_symlink() and os.readlink(launcher) == str(app / "gapless")
    assert (
        subprocess.run([str(launcher), "--version"], capture_output=True, text=True).stdout
        == f"gapless {VERSION} --version\n"
    )
    assert svg.read_bytes() == (ROOT / "assets/gapless.svg").read_bytes()
    assert png.read_bytes() == b"\x89PNG stand-in"

    entry = dict(line.split("=", 1) for line in desktop.read_text().splitlines() if "=" in line)
    assert entry["Exec"] == f'"{app}/gapless" gui'
    assert entry["TryExec"] == f"{app}/gapless"
    assert entry["Icon"] == str(svg)
    assert "@" not in desktop.read_text()
    if shutil.which("desktop-file-validate"):  # desktop-file-utils, where installed
        check = subprocess.run(["desktop-file-validate", str(desktop)], capture_output=True, text=True)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout

    listed = manifest_paths(app)
    installed = {str(home / p.rstrip("/")) for p in tree(home)}
    assert set(listed) == installed  # every path the install made, and nothing else (home was empty)
    assert len(listed) == len(set(listed))
    assert str(launcher) in out and "uninstall.sh" in out


def test_uninstall_removes_exactly_the_manifest_and_keeps_user_data(archive: Path, home: Path):
    env = user_env(home)
    # Things that were there before the install: a folder on the way and a file beside the launcher.
    (home / ".local/bin").mkdir(parents=True)
    (home / ".local/bin/other-tool").write_text("#!/bin/sh\n")
    before = tree(home)
    run(archive / "install.sh", env=env)
    # What the app writes while used: chats, settings, logs, the cache.
    user_files = [
        home / ".local/share/gapless/chats.sqlite3",
        home / ".config/gapless/settings.json",
        home / ".local/state/gapless/log/gapless.log",
        home / ".cache/gapless/models/smollm2/bundled-abc.verified",
    ]
    for f in user_files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("kept")

    out = run(home / ".local/share/gapless-app/uninstall.sh", env=env).stdout
    folders = [home / d / "gapless" for d in (".local/share", ".config", ".local/state", ".cache")]
    assert f"kept your chats, settings, logs and caches: {' '.join(map(str, folders))} (uninstall.sh" in out
    user_tree = {
        ".local/",
        ".local/share/",
        ".local/share/gapless/",
        ".local/share/gapless/chats.sqlite3",
        ".config/",
        ".config/gapless/",
        ".config/gapless/settings.json",
        ".local/state/",
        ".local/state/gapless/",
        ".local/state/gapless/log/",
        ".local/state/gapless/log/gapless.log",
        ".cache/",
        ".cache/gapless/",
        ".cache/gapless/models/",
        ".cache/gapless/models/smollm2/",
        ".cache/gapless/models/smollm2/bundled-abc.verified",
    }
    assert tree(home) == before | user_tree
    assert all(f.read_text() == "kept" for f in user_files)


def test_purge_deletes_the_user_data_too(archive: Path, home: Path):
    env = user_env(home)
    run(archive / "install.sh", env=env)
    (home / ".local/share/gapless").mkdir(parents=True)
    (home / ".local/share/gapless/chats.sqlite3").write_text("x")
    (home / ".config/gapless").mkdir(parents=True)
    (home / ".config/gapless/settings.json").write_text("{}")
    (home / ".cache/gapless").mkdir(parents=True)
    (home / "notes.txt").write_text("not ours")

    out = run(home / ".local/share/gapless-app/uninstall.sh", "--purge", env=env).stdout
    assert f"deleted {home}/.local/share/gapless" in out
    # The purge removes the gapless folders; then ~/.local/share, made by the installer, is empty and goes too.
    # ~/.config and ~/.cache were made by the app (here: the test), so they stay.
    assert tree(home) == {"notes.txt", ".config/", ".cache/"}


def test_prefix_install_and_uninstall_leave_the_prefix_as_it_was(archive: Path, home: Path, tmp_path: Path):
    prefix = tmp_path / "opt"
    prefix.mkdir()
    (prefix / "keep.txt").write_text("mine")
    env = user_env(home)
    run(archive / "install.sh", "--prefix", str(prefix), env=env)
    app = prefix / "lib/gapless-app"
    assert (prefix / "bin/gapless").is_symlink() and os.readlink(prefix / "bin/gapless") == str(app / "gapless")
    assert (prefix / "share/applications/gapless.desktop").is_file()
    assert (prefix / "share/icons/hicolor/scalable/apps/gapless.svg").is_file()
    assert tree(home) == set()  # nothing per-user

    run(app / "uninstall.sh", env=env)
    assert tree(prefix) == {"keep.txt"}


def valid_desktop_entry(path: Path) -> None:
    """desktop-file-validate finds nothing in it, where the tool is installed."""
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(path)], capture_output=True, text=True)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout


def test_a_path_with_spaces_is_quoted_in_the_desktop_entry(archive: Path, home: Path, tmp_path: Path):
    prefix = tmp_path / "my apps"
    run(archive / "install.sh", "--prefix", str(prefix), env=user_env(home))
    entry = (prefix / "share/applications/gapless.desktop").read_text()
    assert f'Exec="{prefix}/lib/gapless-app/gapless" gui\n' in entry
    valid_desktop_entry(prefix / "share/applications/gapless.desktop")


@pytest.mark.parametrize("name", ["R&D", "50%off", "a|b"])
def test_a_path_with_characters_sed_or_the_desktop_entry_read_as_their_own(archive, home, tmp_path, name):
    """sed read "&" as the match (Exec="/tmp/R@EXEC@D/..." installed without a word) and "|" as its separator
    (the install failed, leaving an empty desktop file that refused the next install); a "%" in Exec is a field
    code unless written "%%"."""
    prefix = tmp_path / name
    env = user_env(home)
    run(archive / "install.sh", "--prefix", str(prefix), env=env)
    entry = (prefix / "share/applications/gapless.desktop").read_text()
    app = str(prefix / "lib/gapless-app/gapless")
    assert f'Exec="{app.replace("%", "%%")}" gui\n' in entry and f"TryExec={app}\n" in entry
    valid_desktop_entry(prefix / "share/applications/gapless.desktop")
    run(prefix / "lib/gapless-app/uninstall.sh", env=env)
    assert not prefix.exists()


def test_a_path_the_desktop_entry_cannot_quote_is_refused(archive: Path, home: Path, tmp_path: Path):
    proc = run(archive / "install.sh", "--prefix", str(tmp_path / "a$b"), env=user_env(home), ok=False)
    assert proc.returncode == 1 and "may not contain" in proc.stderr
    assert not (tmp_path / "a$b").exists()


def test_relative_prefix_and_no_desktop(archive: Path, home: Path, tmp_path: Path):
    env = user_env(home)
    run(archive / "install.sh", "--prefix", "rel", "--no-desktop", env=env, cwd=tmp_path)
    prefix = tmp_path / "rel"
    assert (prefix / "bin/gapless").is_symlink()
    assert not (prefix / "share").exists()
    run(prefix / "lib/gapless-app/uninstall.sh", env=env)
    assert not prefix.exists()  # the installer made it, so the uninstaller removes it


def test_files_added_inside_the_app_folder_are_left_with_a_warning(archive: Path, home: Path):
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    (app / "_internal/user-plugin.txt").write_text("someone else's")
    proc = run(app / "uninstall.sh", env=env)
    assert f"left {app}/_internal (holds files Gapless did not install)" in proc.stderr
    assert tree(home) == {
        ".local/",
        ".local/share/",
        ".local/share/gapless-app/",
        ".local/share/gapless-app/_internal/",
        ".local/share/gapless-app/_internal/user-plugin.txt",
        ".local/share/gapless-app/uninstall-left.txt",  # the folder's record for the next install
    }


def test_a_foreign_launcher_is_only_replaced_with_force(archive: Path, home: Path):
    env = user_env(home)
    foreign = home / ".local/bin/gapless"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("#!/bin/sh\necho pip-installed\n")
    proc = run(archive / "install.sh", env=env, ok=False)
    assert proc.returncode == 1
    assert f"{foreign} already exists" in proc.stderr and "--force" in proc.stderr
    assert foreign.read_text() == "#!/bin/sh\necho pip-installed\n"
    assert not (home / ".local/share").exists()  # refused before anything was written

    run(archive / "install.sh", "--force", env=env)
    assert foreign.is_symlink()


def test_a_foreign_app_folder_is_refused(archive: Path, home: Path):
    env = user_env(home)
    app = home / ".local/share/gapless-app"
    app.mkdir(parents=True)
    (app / "something").write_text("x")
    proc = run(archive / "install.sh", env=env, ok=False)
    assert proc.returncode == 1 and "was not made by this installer" in proc.stderr
    assert tree(app) == {"something"}


def test_reinstall_replaces_the_previous_installation(archive: Path, home: Path):
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    first = set(manifest_paths(app))
    (archive / "gapless/_internal/new-in-this-version.so").write_bytes(b"new")
    (archive / "gapless/_internal/libpython3.11.so.1.0").unlink()
    (archive / "gapless/_internal/libpython3.so").unlink()
    out = run(archive / "install.sh", env=env).stdout
    assert "replacing the Gapless installation" in out
    second = set(manifest_paths(app))
    assert second - first == {str(app / "_internal/new-in-this-version.so")}
    assert first - second == {str(app / "_internal/libpython3.11.so.1.0"), str(app / "_internal/libpython3.so")}
    assert not (app / "_internal/libpython3.11.so.1.0").exists()
    run(app / "uninstall.sh", env=env)
    assert tree(home) == set()


def test_a_failed_install_removes_what_it_had_done(archive: Path, home: Path):
    env = user_env(home)
    # A file where the menu folder should be: the install fails after the bundle was copied.
    (home / ".local/share").mkdir(parents=True)
    (home / ".local/share/applications").write_text("in the way")
    proc = run(archive / "install.sh", env=env, ok=False)
    assert proc.returncode != 0
    assert "failed; removing what was installed" in proc.stderr
    assert tree(home) == {".local/", ".local/share/", ".local/share/applications"}


def stopping(tmp_path: Path, command: str, signal: str, before: bool = False) -> str:
    """A folder for PATH whose `command` runs the real one and sends `signal` to the install script (its parent)
    after it, or before it with `before`."""
    folder = tmp_path / f"stop-at-{command}"
    folder.mkdir()
    real = shutil.which(command, path="/usr/bin:/bin")
    step = f'{real} "$@"'
    kill = f"kill -{signal} $PPID"
    (folder / command).write_text(f"#!/bin/sh\n{kill if before else step}\n{step if before else kill}\n")
    (folder / command).chmod(0o755)
    return str(folder)


@pytest.mark.parametrize("command", ["cp", "ln"])
def test_an_install_killed_halfway_is_cleared_by_the_next_install(archive, home, tmp_path, command):
    """Killed (SIGKILL: no clean-up of its own) after copying the bundle, or after making the launcher: the next
    install takes what it left for its own (it was refused as a folder \"not made by this installer\", and the
    launcher as another installation's), and its uninstall leaves nothing."""
    env = user_env(home)
    killed = run(
        archive / "install.sh", env={**env, "PATH": f"{stopping(tmp_path, command, 'KILL')}:{env['PATH']}"}, ok=False
    )
    assert killed.returncode == -9
    app = home / ".local/share/gapless-app"
    assert (app / "_internal/models/SmolLM2-135M-Instruct.Q4_1.gguf").exists()  # left behind
    assert not (app / "install-manifest.txt").exists()
    assert (home / ".local/bin/gapless").is_symlink() == (command == "ln")

    out = run(archive / "install.sh", env=env).stdout
    assert f"removing what an unfinished installation left in {app}" in out
    assert not (app / "install-unfinished.txt").exists()
    assert set(manifest_paths(app)) == {str(home / p.rstrip("/")) for p in tree(home)}
    run(app / "uninstall.sh", env=env)
    assert tree(home) == set()


def test_an_interrupted_install_removes_what_it_had_done(archive: Path, home: Path, tmp_path: Path):
    """SIGTERM (or Ctrl+C, or the terminal closed) while the bundle is copied: the copy finishes, then all of it
    is removed (the script died at once, leaving a half-copied app folder the next install refused)."""
    env = user_env(home)
    path = f"{stopping(tmp_path, 'cp', 'TERM', before=True)}:{env['PATH']}"
    proc = run(archive / "install.sh", env={**env, "PATH": path}, ok=False)
    assert proc.returncode == 143
    assert "install: interrupted; removing what was installed" in proc.stderr
    assert tree(home) == set()


def test_uninstall_without_a_manifest_removes_nothing(tmp_path: Path, home: Path):
    script = tmp_path / "uninstall.sh"
    shutil.copy(LINUX / "uninstall.sh", script)
    (tmp_path / "gapless").write_text("x")
    proc = run(script, env=user_env(home), ok=False)
    assert proc.returncode == 1 and "no manifest" in proc.stderr
    assert (tmp_path / "gapless").exists()


def test_render_icon_writes_png_and_ico(qapp, tmp_path: Path):
    """Rendered with the QApplication the tests share: a QGuiApplication of its own, made first, was the
    process's application for every later test, and no widget could be made there."""
    sys.path.insert(0, str(ROOT / "packaging"))
    try:
        from render_icon import SIZE, render
    finally:
        sys.path.remove(str(ROOT / "packaging"))
    png, ico = render(ROOT / "assets" / "gapless.svg", tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ico.read_bytes()[:4] == b"\x00\x00\x01\x00"  # ICO header: reserved 0, type 1 (icon)
    from PySide6.QtGui import QImage

    image = QImage(str(png))
    assert (image.width(), image.height()) == (SIZE, SIZE)
    assert image.pixelColor(2, 2).alpha() == 0  # the corner outside the bubble stays transparent
    assert image.pixelColor(SIZE // 2, SIZE // 5).alpha() == 255


def test_uninstall_names_only_the_user_folders_that_exist(archive: Path, home: Path):
    env = user_env(home)
    run(archive / "install.sh", env=env)
    (home / ".cache/gapless").mkdir(parents=True)  # the only folder the app wrote
    out = run(home / ".local/share/gapless-app/uninstall.sh", env=env).stdout
    assert f"kept your chats, settings, logs and caches: {home}/.cache/gapless (uninstall.sh" in out
    run(archive / "install.sh", env=env)
    (home / ".cache/gapless").rmdir()
    out = run(home / ".local/share/gapless-app/uninstall.sh", env=env).stdout
    assert "kept your" not in out


@pytest.mark.parametrize("theirs", [None, "/opt/mine/lib"])
def test_the_bundle_hands_programs_it_starts_the_user_s_library_path(theirs: Optional[str]):
    """The launcher's LD_LIBRARY_PATH (the bundle's own older libraries first) reached the compiler and xdg-open."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_LIBRARY_PATH")}
    env["LD_LIBRARY_PATH"] = "/bundle/_internal"
    if theirs is not None:
        env["LD_LIBRARY_PATH_ORIG"] = theirs
    hook = Path(__file__).resolve().parents[2] / "packaging" / "rthook_gapless.py"
    code = (
        "import os, runpy, sys; sys.frozen = True; runpy.run_path(sys.argv[1]); "
        "print(repr(os.environ.get('LD_LIBRARY_PATH')), repr(os.environ.get('LD_LIBRARY_PATH_ORIG')))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(hook)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [repr(theirs), "None"]


def failing(tmp_path: Path, command: str) -> str:
    """A folder for PATH whose `command` fails (exit 1) without doing anything."""
    folder = tmp_path / f"fail-at-{command}"
    folder.mkdir()
    (folder / command).write_text("#!/bin/sh\necho 'no space left' >&2\nexit 1\n")
    (folder / command).chmod(0o755)
    return str(folder)


def put_user_files(app: Path) -> dict[Path, str]:
    """What a user keeps in the app folder: a notes file, a models folder of their own, a file among the bundle's."""
    files = {
        app / "my notes.txt": "my notes",
        app / "models/mine.gguf": "GGUF of mine",
        app / "_internal/user-plugin.txt": "someone else's",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


USER_TREE = {"my notes.txt", "models/", "models/mine.gguf", "_internal/", "_internal/user-plugin.txt"}
LEFT = "_internal/user-plugin.txt, models/mine.gguf, my notes.txt"


@pytest.mark.parametrize("how", ["failed", "interrupted"])
def test_a_failed_reinstall_removes_only_what_it_installed(archive: Path, home: Path, tmp_path: Path, how: str):
    """A reinstall that fails or is interrupted after copying the bundle: its rollback deleted everything in the app
    folder, the user's own files with it. Now only the installer's files go, the rest is named, and the next
    install takes the folder back."""
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    files = put_user_files(app)
    stop = failing(tmp_path, "ln") if how == "failed" else stopping(tmp_path, "ln", "TERM")
    proc = run(archive / "install.sh", env={**env, "PATH": f"{stop}:{env['PATH']}"}, ok=False)
    assert proc.returncode == (1 if how == "failed" else 143)
    assert all(path.read_text() == text for path, text in files.items())
    assert f"install: {how}; removing what was installed" in proc.stderr
    assert f"install: left in {app} what Gapless did not install: {LEFT}" in proc.stderr
    assert tree(app) == USER_TREE | {"install-unfinished.txt"}  # the folder's record for the next install
    assert not (home / ".local/bin/gapless").exists()

    out = run(archive / "install.sh", env=env).stdout
    assert f"removing what an unfinished installation left in {app}" in out
    assert f"install: kept in {app} what Gapless did not install: {LEFT}" in out
    run(app / "uninstall.sh", env=env)
    assert all(path.read_text() == text for path, text in files.items())
    assert tree(home) == {".local/", ".local/share/", ".local/share/gapless-app/"} | {
        f".local/share/gapless-app/{p}" for p in USER_TREE | {"uninstall-left.txt"}
    }


def test_a_reinstall_killed_halfway_leaves_the_user_s_files_to_the_next(archive: Path, home: Path, tmp_path: Path):
    """Killed outright while a reinstall copies the bundle: the next install removed all the app folder held
    (it took the folder to have been empty when the killed one began)."""
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    files = put_user_files(app)
    killed = run(
        archive / "install.sh", env={**env, "PATH": f"{stopping(tmp_path, 'cp', 'KILL')}:{env['PATH']}"}, ok=False
    )
    assert killed.returncode == -9
    out = run(archive / "install.sh", env=env).stdout
    assert f"removing what an unfinished installation left in {app}" in out
    assert all(path.read_text() == text for path, text in files.items())
    assert set(manifest_paths(app)) == {str(home / p.rstrip("/")) for p in tree(home)} - {
        str(app / p.rstrip("/")) for p in USER_TREE - {"_internal/"}
    }
    run(app / "uninstall.sh", env=env)
    assert tree(app) == USER_TREE | {"uninstall-left.txt"}


def test_a_file_of_the_user_s_where_the_new_version_installs_one_is_refused(archive: Path, home: Path):
    """The user's file at a path the new version installs is neither overwritten nor removed: the reinstall stops
    before it removes anything, naming it."""
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    (app / "_internal/new-in-this-version.so").write_text("the user's")
    (archive / "gapless/_internal/new-in-this-version.so").write_bytes(b"new")
    before = tree(home)
    proc = run(archive / "install.sh", env=env, ok=False)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"install: error: {app} holds files Gapless did not install where this version installs its own: "
        "_internal/new-in-this-version.so; move them out of the app folder, then run install.sh again\n"
    )
    assert tree(home) == before  # the installed version is still there, whole
    assert (app / "_internal/new-in-this-version.so").read_text() == "the user's"


def test_a_reinstall_into_the_same_folder_spelled_another_way_replaces_it(archive: Path, home: Path, tmp_path: Path):
    """`--prefix DIR/` then `--prefix DIR`, or HOME given with a "/" at its end: the reinstall compared the
    manifest's paths as written, took every file of the installed bundle for the user's and refused."""
    prefix = tmp_path / "prefix"
    env = user_env(home)
    run(archive / "install.sh", "--prefix", f"{prefix}//", "--no-desktop", env=env)
    app = prefix / "lib/gapless-app"
    assert all("//" not in p and not p.endswith("/") for p in manifest_paths(app))
    (app / "my notes.txt").write_text("mine")
    out = run(archive / "install.sh", "--prefix", str(prefix), "--no-desktop", env=env).stdout
    assert "replacing the Gapless installation" in out
    assert f"kept in {app} what Gapless did not install: my notes.txt" in out
    run(app / "uninstall.sh", env=env)
    assert tree(prefix) == {
        "lib/",
        "lib/gapless-app/",
        "lib/gapless-app/my notes.txt",
        "lib/gapless-app/uninstall-left.txt",
    }

    run(archive / "install.sh", "--no-desktop", env=env)
    user_app = home / ".local/share/gapless-app"
    manifest = user_app / "install-manifest.txt"
    # as an installation made with HOME spelled "home//" wrote it
    manifest.write_text(manifest.read_text().replace(str(home), f"{home}//"))
    out = run(archive / "install.sh", "--no-desktop", env=env).stdout
    assert "replacing the Gapless installation" in out
    run(user_app / "uninstall.sh", env=env)
    assert tree(home) == set()


def test_an_unfinished_install_of_an_earlier_version_is_cleared_without_a_refusal(archive: Path, home: Path):
    """The list an unfinished install of the version before left names only what it made outside the app folder
    (that version cleared the whole folder): its half-made copy of the bundle was refused as the user's files."""
    env = user_env(home)
    run(archive / "install.sh", "--no-desktop", env=env)
    app = home / ".local/share/gapless-app"
    launcher = home / ".local/bin/gapless"
    # What that version's install, stopped after the copy and the launcher, left: its list, without a header.
    (app / "install-manifest.txt").unlink()
    (app / "install-unfinished.txt").write_text(
        f"d {home / '.local/bin'}\nl {launcher}\nd {app}\nf {app / 'install-unfinished.txt'}\n"
    )
    (app / "my notes.txt").write_text("mine")
    out = run(archive / "install.sh", "--no-desktop", env=env).stdout
    assert f"removing what an unfinished installation left in {app}" in out
    assert "installed Gapless" in out
    assert (app / "my notes.txt").read_text() == "mine"
    run(app / "uninstall.sh", env=env)
    assert tree(app) == {"my notes.txt", "uninstall-left.txt"}


def link_user_folders(app: Path, tmp_path: Path) -> dict[Path, str]:
    """The user's own models folder linked in place of the bundle's (with a file of the bundle's name in it), and
    their own library linked in place of one of the bundle's files."""
    mine = tmp_path / "my-models"
    mine.mkdir()
    files = {
        mine / "SmolLM2-135M-Instruct.Q4_1.gguf": "my own fine-tune",
        mine / "notes.txt": "my notes",
        tmp_path / "my-libpython.so": "my build",
    }
    for path, text in files.items():
        path.write_text(text)
    shutil.rmtree(app / "_internal/models")
    (app / "_internal/models").symlink_to(mine)
    (app / "_internal/libpython3.11.so.1.0").unlink()
    (app / "_internal/libpython3.11.so.1.0").symlink_to(tmp_path / "my-libpython.so")
    return files


def user_links_left(app: Path) -> list[str]:
    """What uninstall.sh says it left of an app folder given `link_user_folders`."""
    note = "a link Gapless did not make; it and what it points to are left as they are"
    return [
        f"uninstall: left {app}/_internal/libpython3.11.so.1.0 ({note})",
        f"uninstall: left {app}/_internal/models ({note})",
        f"uninstall: left {app}/_internal (holds files Gapless did not install)",
        f"uninstall: left {app} (holds files Gapless did not install)",
    ]


def test_uninstall_never_removes_through_a_link_the_user_put_in_the_app_folder(archive, home, tmp_path):
    """A bundle folder replaced by a link to the user's own folder: the files there with the bundle's names were
    deleted through it. The links stay and are named, and what they point to is untouched; a launcher the user
    replaced with a script of their own stays too."""
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    files = link_user_folders(app, tmp_path)
    launcher = home / ".local/bin/gapless"
    launcher.unlink()
    launcher.write_text("#!/bin/sh\nexec my-wrapper\n")
    proc = run(app / "uninstall.sh", env=env)
    assert all(path.read_text() == text for path, text in files.items())
    assert launcher.read_text() == "#!/bin/sh\nexec my-wrapper\n"
    library, *folders = user_links_left(app)
    assert proc.stderr.splitlines() == [library, f"uninstall: left {launcher} (no longer a link)", *folders]
    assert tree(app) == {"_internal/", "_internal/libpython3.11.so.1.0", "_internal/models", "uninstall-left.txt"}
    assert os.readlink(app / "_internal/models") == str(tmp_path / "my-models")


@pytest.mark.parametrize("linked", ["install", "uninstall"])
def test_an_app_folder_reached_through_a_linked_folder_above_it_uninstalls_the_same(archive, home, tmp_path, linked):
    """The manifest names paths as the install spelled them; uninstall.sh run through a link to a folder above the
    app folder (or, after an install through one, run through the real path) matched none of the paths it found
    in the app folder with the manifest's: the user's file of the bundle's name was deleted through their link
    to their own models folder, and nothing said which folders stayed for files Gapless did not install."""
    env = user_env(home)
    prefix = tmp_path / "prefix"
    alias = tmp_path / "alias"
    prefix.mkdir()
    alias.symlink_to(prefix)
    installed, uninstalled = (alias, prefix) if linked == "install" else (prefix, alias)
    run(archive / "install.sh", "--prefix", str(installed), env=env)
    app = installed / "lib/gapless-app"
    files = link_user_folders(app, tmp_path)
    proc = run(uninstalled / "lib/gapless-app/uninstall.sh", env=env)
    assert all(path.read_text() == text for path, text in files.items())
    assert proc.stderr.splitlines() == user_links_left(app)
    assert tree(prefix / "lib/gapless-app") == {
        "_internal/",
        "_internal/libpython3.11.so.1.0",
        "_internal/models",
        "uninstall-left.txt",
    }


def test_a_reinstall_over_a_link_the_user_put_in_the_app_folder_is_refused(archive, home, tmp_path):
    """The reinstall removed the installed version through the user's link (their file of the bundle's name went),
    then failed to copy the bundle's folder over the link, removing the rest. Now it stops before anything is
    removed, naming the links."""
    env = user_env(home)
    run(archive / "install.sh", env=env)
    app = home / ".local/share/gapless-app"
    files = link_user_folders(app, tmp_path)
    before = tree(home)
    proc = run(archive / "install.sh", env=env, ok=False)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"install: error: {app} holds files Gapless did not install where this version installs its own: "
        "_internal/libpython3.11.so.1.0, _internal/models; move them out of the app folder, then run install.sh "
        "again\n"
    )
    assert tree(home) == before
    assert all(path.read_text() == text for path, text in files.items())


def test_an_install_after_an_uninstall_that_kept_the_user_s_files_takes_the_folder_back(archive, home, tmp_path):
    """uninstall.sh leaves the app folder when the user keeps a file in it; the next install refused that folder
    ("exists and was not made by this installer") though the user did nothing wrong. The uninstall's record of the
    folders it left lets the next install in: it keeps the user's files and names them, and its own uninstall
    removes the installer's folders once they are empty."""
    env = user_env(home)
    prefix = tmp_path / "prefix"
    run(archive / "install.sh", "--prefix", str(prefix), env=env)
    app = prefix / "lib/gapless-app"
    (app / "notes.txt").write_text("n")
    (app / "_internal/user-plugin.txt").write_text("someone else's")
    run(app / "uninstall.sh", env=env)
    assert (app / "uninstall-left.txt").read_text().splitlines()[2:] == [
        f"d {prefix}",
        f"d {prefix}/lib",
        f"d {app}",
        f"d {app}/_internal",
        f"f {app}/uninstall-left.txt",
    ]

    out = run(archive / "install.sh", "--prefix", str(prefix), env=env).stdout
    assert f"install: installing into {app}, which an earlier uninstall.sh left for the files Gapless did not" in out
    assert f"install: kept in {app} what Gapless did not install: _internal/user-plugin.txt, notes.txt\n" in out
    assert (app / "notes.txt").read_text() == "n"
    assert (app / "_internal/user-plugin.txt").read_text() == "someone else's"
    assert not (app / "uninstall-left.txt").exists()
    assert set(manifest_paths(app)) == {str(prefix)} | {str(prefix / p.rstrip("/")) for p in tree(prefix)} - {
        str(app / "notes.txt"),
        str(app / "_internal/user-plugin.txt"),
    }

    # Once the user's files are gone, nothing of the installation is left, the prefix the first install made neither.
    run(app / "uninstall.sh", env=env)
    (app / "notes.txt").unlink()
    (app / "_internal/user-plugin.txt").unlink()
    run(archive / "install.sh", "--prefix", str(prefix), env=env)
    run(app / "uninstall.sh", env=env)
    assert not prefix.exists()


def test_a_reinstall_refused_for_another_menu_entry_keeps_the_installation(archive: Path, home: Path, tmp_path: Path):
    """A reinstall with the menu entry, over one installed without it, where another program's gapless.desktop is:
    the installed version was removed first, then the install refused the entry, leaving no installation and an
    app folder the next install refused too. Now it stops before it removes anything."""
    env = user_env(home)
    prefix = tmp_path / "prefix"
    run(archive / "install.sh", "--prefix", str(prefix), "--no-desktop", env=env)
    app = prefix / "lib/gapless-app"
    (app / "notes.txt").write_text("n")
    theirs = prefix / "share/applications/gapless.desktop"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("[Desktop Entry]\nName=another\n")
    before = tree(prefix)
    proc = run(archive / "install.sh", "--prefix", str(prefix), env=env, ok=False)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"install: error: {theirs} already exists (another Gapless installation?); use --force to replace it\n"
    )
    assert tree(prefix) == before
    assert theirs.read_text() == "[Desktop Entry]\nName=another\n"

    out = run(archive / "install.sh", "--prefix", str(prefix), "--force", env=env).stdout
    assert "replacing the Gapless installation" in out and (app / "notes.txt").read_text() == "n"
    assert theirs.read_text().startswith("[Desktop Entry]\n") and f"TryExec={app}/gapless\n" in theirs.read_text()


def test_an_upgrade_where_a_folder_of_the_bundle_became_a_file_goes_ahead(archive: Path, home: Path):
    """A folder of the installed bundle that the new version has as a file (or a link): the installer's own
    folder was taken for the user's file and the upgrade refused. One holding a file of the user's still is."""
    env = user_env(home)
    (archive / "gapless/_internal/thing").mkdir()
    (archive / "gapless/_internal/thing/part.so").write_bytes(b"old")
    run(archive / "install.sh", "--no-desktop", env=env)
    app = home / ".local/share/gapless-app"
    shutil.rmtree(archive / "gapless/_internal/thing")
    (archive / "gapless/_internal/thing").write_bytes(b"new")
    (app / "_internal/thing/mine.txt").write_text("mine")
    proc = run(archive / "install.sh", "--no-desktop", env=env, ok=False)
    assert proc.returncode == 1 and "where this version installs its own: _internal/thing;" in proc.stderr
    (app / "_internal/thing/mine.txt").unlink()
    out = run(archive / "install.sh", "--no-desktop", env=env).stdout
    assert "replacing the Gapless installation" in out
    assert (app / "_internal/thing").read_bytes() == b"new"
    run(app / "uninstall.sh", env=env)
    assert tree(home) == set()


def test_a_launcher_folder_made_a_link_since_the_install_still_loses_the_launcher(archive, home, tmp_path):
    """~/.local/bin, made by the installer, moved into a dotfiles folder and linked back: the uninstall left the
    launcher there, dangling, and a reinstall removed the installation, then refused its own launcher."""
    env = user_env(home)
    run(archive / "install.sh", "--no-desktop", env=env)
    dots = tmp_path / "dots"
    (home / ".local/bin").rename(dots)
    (home / ".local/bin").symlink_to(dots)
    out = run(archive / "install.sh", "--no-desktop", env=env).stdout
    assert "installed Gapless" in out and (dots / "gapless").is_symlink()
    app = home / ".local/share/gapless-app"
    run(app / "uninstall.sh", env=env)
    assert not (dots / "gapless").exists() and not (dots / "gapless").is_symlink()
    assert tree(home) == {".local/", ".local/bin"}  # the user's link stays


def test_a_script_of_the_user_s_in_place_of_the_launcher_stops_a_reinstall_before_it_removes_anything(archive, home):
    """The launcher replaced by the user's own wrapper script: the reinstall removed the installation, kept the
    script (no longer the installer's link) and then refused it, leaving nothing installed."""
    env = user_env(home)
    run(archive / "install.sh", "--no-desktop", env=env)
    launcher = home / ".local/bin/gapless"
    launcher.unlink()
    launcher.write_text("#!/bin/sh\nexec my-wrapper\n")
    before = tree(home)
    proc = run(archive / "install.sh", "--no-desktop", env=env, ok=False)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"install: error: {launcher} already exists (another Gapless installation?); use --force to replace it\n"
    )
    assert tree(home) == before and launcher.read_text() == "#!/bin/sh\nexec my-wrapper\n"
    run(archive / "install.sh", "--no-desktop", "--force", env=env)
    assert launcher.is_symlink()
