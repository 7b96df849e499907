"""Settings: round trip, atomic save, damaged or newer files moved aside with a notice, invalid parts defaulted."""

from __future__ import annotations

import base64
import json
import logging
import os
import sys

import pytest

from app.settings import SETTINGS_VERSION, Settings, SettingsError, SettingsStore
from engine.types import EngineOptions, SamplingParams


@pytest.fixture
def path(tmp_path):
    return tmp_path / "config" / "settings.json"


def asides(path, tag):
    return sorted(p.name for p in path.parent.glob(f"settings.json.{tag}-*"))


def test_missing_file_gives_defaults_quietly(path):
    s, notices = SettingsStore(path).load()
    assert s == Settings() and notices == []
    assert s.options() == EngineOptions() and s.sampling_params() == SamplingParams()


def test_two_windows_on_one_file_keep_each_other_s_changes(path):
    """Closing a second window (one data folder, two app instances) wrote back the settings it read at its
    start: the first window's saved system prompt, theme and send key were undone."""
    SettingsStore(path).save(Settings(theme="light"))
    a_store, b_store = SettingsStore(path), SettingsStore(path)
    a, _ = a_store.load()
    b, _ = b_store.load()
    a.system_prompt, a.theme, a.send_with = "You are a pirate.", "dark", "ctrl+enter"
    a_store.save(a)
    b.splitter_sizes = {"main": [300, 700]}  # the second window only moved its splitter, then closed
    b_store.save(b)
    now, _ = SettingsStore(path).load()
    assert (now.system_prompt, now.theme, now.send_with) == ("You are a pirate.", "dark", "ctrl+enter")
    assert now.splitter_sizes == {"main": [300, 700]}
    b.theme = "system"  # a later change of the second window's own is written over the first's
    b_store.save(b)
    assert SettingsStore(path).load()[0].theme == "system"


@pytest.mark.parametrize("first_run", [False, True])
def test_two_windows_keep_each_other_s_optimization_choices(path, first_run):
    """The Optimizations panel's choices are one object in the file: the window saving last wrote its whole
    object, the dtype the other window chose undone."""
    if not first_run:
        SettingsStore(path).save(Settings())
    a_store, b_store = SettingsStore(path), SettingsStore(path)
    a, _ = a_store.load()
    b, _ = b_store.load()
    a.engine_options = {**a.engine_options, "dtype": "bf16"}
    a.sampling = {**a.sampling, "temperature": 0.2}
    a_store.save(a)
    b.engine_options = {**b.engine_options, "kv_cache": "dynamic"}
    b.sampling = {**b.sampling, "top_k": 5}
    b_store.save(b)
    now, _ = SettingsStore(path).load()
    assert (now.options().dtype, now.options().kv_cache) == ("bf16", "dynamic")
    assert (now.sampling_params().temperature, now.sampling_params().top_k) == (0.2, 5)
    b.engine_options = {**b.engine_options, "dtype": "fp16"}  # a later choice of the second window's own wins
    b_store.save(b)
    assert SettingsStore(path).load()[0].options().dtype == "fp16"


def test_a_settings_file_that_is_a_link_is_written_through_and_kept(path, tmp_path):
    """Kept with the user's dotfiles: the save replaced the link with a file, and the dotfiles copy no longer
    changed."""
    kept = tmp_path / "dotfiles" / "gapless.json"
    kept.parent.mkdir()
    store = SettingsStore(kept)
    store.save(Settings(theme="light"))
    path.parent.mkdir(parents=True)
    path.symlink_to(kept)
    store = SettingsStore(path)
    settings, _ = store.load()
    settings.theme = "dark"
    store.save(settings)
    assert path.is_symlink() and json.loads(kept.read_text())["theme"] == "dark"


def test_two_windows_keep_each_other_s_changes_on_a_first_run_too(path):
    """With no settings file yet, every field counted as changed, and the second save undid the first's."""
    first, second = SettingsStore(path), SettingsStore(path)
    a, _ = first.load()
    b, _ = second.load()
    b.theme = "dark"
    second.save(b)
    a.system_prompt = "Be brief."
    first.save(a)
    now, _ = SettingsStore(path).load()
    assert (now.theme, now.system_prompt) == ("dark", "Be brief.")


def test_two_windows_saving_at_once_keep_each_other_s_changes(path, monkeypatch):
    """Two windows closing at once (a logout closes both): each read the file before the other wrote it, and the
    second write undid the first's changes."""
    import threading

    SettingsStore(path).save(Settings())
    a_store, b_store = SettingsStore(path), SettingsStore(path)
    a, _ = a_store.load()
    b, _ = b_store.load()
    a.theme = "dark"
    b.engine_options = EngineOptions(kv_cache="none").to_dict()
    b_reading = threading.Event()
    read_file = SettingsStore._current

    def current(store, notices):
        on_disk = read_file(store, notices)
        if store is b_store:
            b_reading.set()
        elif store is a_store and not b_reading.is_set():  # the first window has read the file: the second saves
            second = threading.Thread(target=b_store.save, args=(b,))
            second.start()
            a_store._second = second  # type: ignore[attr-defined]
            if b_reading.wait(timeout=1):  # it could read the file before the first window wrote it
                second.join()
        return on_disk

    monkeypatch.setattr(SettingsStore, "_current", current)
    a_store.save(a)
    a_store._second.join()  # type: ignore[attr-defined]
    now, _ = SettingsStore(path).load()
    assert now.theme == "dark" and now.options() == EngineOptions(kv_cache="none")


@pytest.mark.skipif(sys.platform == "win32", reason="flock is the lock of POSIX systems")
def test_a_file_system_without_locks_still_saves(path, monkeypatch, caplog):
    """A config folder on a file system without locks (some network and FUSE mounts: flock says ENOLCK): every
    save failed with "cannot save the settings", where saves worked before there was a lock."""
    import errno
    import fcntl

    real = fcntl.flock

    def no_locks(f, op):
        if op & fcntl.LOCK_EX:  # blocking or not
            raise OSError(errno.ENOLCK, "No locks available")
        return real(f, op)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    SettingsStore(path).save(Settings(theme="dark"))
    assert SettingsStore(path).load()[0].theme == "dark"
    assert f"settings saved without a lock: {path.parent / '.settings.json.lock'} cannot be locked" in caplog.text

    def broken(f, op):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", broken)  # any other failure is said, the file left as it was
    with pytest.raises(SettingsError, match="cannot save the settings to .*: Input/output error"):
        SettingsStore(path).save(Settings(theme="light"))
    assert SettingsStore(path).load()[0].theme == "dark"


def test_round_trip(path):
    s = Settings(
        theme="dark",
        send_with="ctrl+enter",
        last_model="/models/x.gguf",
        engine_options=EngineOptions(dtype="fp16", kv_cache="dynamic", candidates=4).to_dict(),
        sampling=SamplingParams(temperature=0.0, top_k=40, seed=7, stop=("###",)).to_dict(),
        models_folder="/models",
        window_geometry=base64.b64encode(b"\x01\xd9\xd0\xcb").decode(),
        window_state=base64.b64encode(b"state").decode(),
        hud_visible=False,
        splitter_sizes={"main": [200, 700, 400]},
        overflow_policy="stop",
        system_prompt="Be brief.",
    )
    store = SettingsStore(path)
    store.save(s)
    loaded, notices = store.load()
    assert notices == [] and loaded == s
    assert loaded.options() == EngineOptions(dtype="fp16", kv_cache="dynamic", candidates=4)
    assert loaded.sampling_params().stop == ("###",)
    assert json.loads(path.read_text())["version"] == SETTINGS_VERSION
    # no temp file left behind; the lock file of saves stays, empty
    assert sorted(p.name for p in path.parent.iterdir()) == [".settings.json.lock", "settings.json"]


@pytest.mark.parametrize(
    "content, reason",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON list, not an object"),
        ('{"version": "1"}', "its version is '1'"),
        ('{"theme": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),  # raised RecursionError
        ('{"version": 1' + "0" * 5000 + "}", "a number of more than 4300 digits"),  # raised ValueError
    ],
)
def test_damaged_file_is_moved_aside_with_a_notice(path, content, reason):
    path.parent.mkdir(parents=True)
    path.write_text(content)
    s, notices = SettingsStore(path).load()
    assert s == Settings()
    kept = asides(path, "corrupt")
    assert len(kept) == 1 and (path.parent / kept[0]).read_text() == content
    assert len(notices) == 1 and str(path) in notices[0] and reason in notices[0] and kept[0] in notices[0]
    assert not path.exists()


@pytest.mark.parametrize("case", ["no read permission", "a folder in its place"])
def test_a_file_that_cannot_be_read_is_moved_aside_not_written_over(path, case, monkeypatch):
    """A settings file without read permission gave the defaults with a notice, and the first save (any change,
    closing the window) wrote them over it: the user's settings were gone. A folder in its place made every save
    fail. Either is now kept aside whole, and the settings of this run are saved."""
    path.parent.mkdir(parents=True)
    if case == "a folder in its place":
        path.mkdir()
        (path / "mine.txt").write_text("kept")
        reason = "it cannot be read (Is a directory)"
    else:
        path.write_text(json.dumps({"version": 1, "theme": "dark", "system_prompt": "Be brief."}))
        os.chmod(path, 0)
        if os.geteuid() == 0:  # root reads it all the same: the read is refused as the kernel would
            read_text = type(path).read_text

            def refused(self, *args, **kwargs):
                if self == path and self.exists() and not self.stat().st_mode & 0o444:
                    raise PermissionError(13, "Permission denied", str(self))
                return read_text(self, *args, **kwargs)

            monkeypatch.setattr(type(path), "read_text", refused)
        reason = "it cannot be read (Permission denied)"
    store = SettingsStore(path)
    s, notices = store.load()
    assert s == Settings()
    kept = asides(path, "unreadable")
    assert len(kept) == 1
    assert notices == [
        f"The settings file {path} could not be used: {reason}. It was kept as {kept[0]} and default settings are used."
    ]
    s.theme = "light"
    store.save(s)
    monkeypatch.undo()
    assert SettingsStore(path).load()[0].theme == "light"
    aside = path.parent / kept[0]
    if case == "a folder in its place":
        assert (aside / "mine.txt").read_text() == "kept"
    else:
        os.chmod(aside, 0o600)
        assert json.loads(aside.read_text()) == {"version": 1, "theme": "dark", "system_prompt": "Be brief."}


@pytest.mark.parametrize(
    "case, content, tag, reason",
    [
        (
            "a newer version saved meanwhile",
            json.dumps({"version": SETTINGS_VERSION + 1, "theme": "sepia", "layout": "new"}),
            "newer",
            f"it was written by a newer version of Gapless (settings version {SETTINGS_VERSION + 1}, this version "
            f"reads up to {SETTINGS_VERSION})",
        ),
        (
            "a hand edit cut short",
            '{"version": 1, "system_prompt": "A prompt typed with care"',
            "corrupt",
            "it is not valid JSON: Expecting ',' delimiter (line 1, column 59)",
        ),
    ],
)
def test_a_file_damaged_or_newer_since_it_was_read_is_kept_aside_when_saving(path, case, content, tag, reason):
    """The file was read at start; what another instance (a newer version) or a hand edit put there since was
    written over by the next save, with no copy."""
    store = SettingsStore(path)
    s, _ = store.load()
    store.save(s)
    path.write_text(content)
    s.theme = "dark"
    notices = store.save(s)
    kept = asides(path, tag)
    assert len(kept) == 1 and (path.parent / kept[0]).read_text() == content
    assert notices == [
        f"The settings file {path} could not be used: {reason}. It was kept as {kept[0]} and the settings of this "
        "window were saved in its place."
    ]
    assert SettingsStore(path).load() == (s, [])
    assert store.save(s) == []  # once


def test_a_file_damaged_since_it_was_read_that_cannot_be_moved_aside_is_not_written_over(path, monkeypatch):
    import app.settings

    store = SettingsStore(path)
    s, _ = store.load()
    path.parent.mkdir(parents=True)
    path.write_text("{ cut")

    def refused(p, tag):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(app.settings, "move_aside", refused)
    with pytest.raises(SettingsError) as caught:
        store.save(s)
    assert str(caught.value) == (
        f"cannot save the settings to {path}: the file there could not be used (it is not valid JSON: Expecting "
        "property name enclosed in double quotes (line 1, column 3)) and could not be moved aside (Permission "
        "denied); it is left as it is"
    )
    assert path.read_text() == "{ cut"


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("theme", 3, "theme is 3, not one of system, light, dark"),
        ("theme", "Dark", 'theme is "Dark", not one of system, light, dark'),
        ("hud_visible", "yes", 'hud_visible is "yes", not true or false'),
        ("last_model", 2, "last_model is 2, not a string or null"),
        ("system_prompt", 3, "system_prompt is 3, not a string"),
        ("overflow_policy", "drop", 'overflow_policy is "drop", not one of rolling, truncate-middle, stop'),
        ("splitter_sizes", {"main": [1, -2]}, "splitter_sizes"),
        ("splitter_sizes", {"main": [100000000000]}, "splitter_sizes"),  # past Qt's 32-bit sizes
        ("window_geometry", "@@not base64@@", "window_geometry"),
        ("system_prompt", "Tu es \ud83d un assistant", "text that is not valid Unicode"),  # every save failed
        ("sampling", {"stop": ["\udc00"]}, "text that is not valid Unicode"),
    ],
)
def test_a_damaged_setting_falls_back_alone_and_the_file_is_kept_beside(path, field, value, reason):
    """One bad value (a hand edit: "Dark" for "dark") reset every other setting too."""
    path.parent.mkdir(parents=True)
    content = json.dumps({"version": 1, "models_folder": "/models", "hud_visible": False, field: value})
    path.write_text(content)
    store = SettingsStore(path)
    s, notices = store.load()
    assert getattr(s, field) == getattr(Settings(), field)
    assert s.models_folder == "/models" and (field == "hud_visible" or s.hud_visible is False)
    kept = asides(path, "corrupt")
    assert len(kept) == 1 and (path.parent / kept[0]).read_text() == content
    assert len(notices) == 1 and str(path) in notices[0] and reason in notices[0] and kept[0] in notices[0]
    assert path.exists()
    store.save(s)  # the next save writes the default
    assert SettingsStore(path).load() == (s, [])


def test_a_byte_order_mark_is_read(path):
    """As Windows' Notepad saves UTF-8: every setting was thrown away as 'Unexpected UTF-8 BOM'."""
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"version": 1, "theme": "dark"}).encode())
    s, notices = SettingsStore(path).load()
    assert s.theme == "dark" and notices == [] and asides(path, "corrupt") == []


def test_text_that_cannot_be_written_is_a_settings_error(path):
    store = SettingsStore(path)
    with pytest.raises(SettingsError, match="cannot save the settings to .*surrogates not allowed"):
        store.save(Settings(system_prompt="\ud83d"))


def test_a_model_path_whose_name_is_not_utf8_is_saved_and_read_back(path):
    """A model opened from a file named in another encoding (bytes not UTF-8, kept by Python as surrogates):
    every save of the settings failed ("surrogates not allowed"), theme, options and layout lost."""
    model = os.fsdecode(b"/models/caf\xe9.gguf")
    store = SettingsStore(path)
    store.save(Settings(last_model=model, models_folder=os.fsdecode(b"/mod\xe8les"), theme="dark"))
    s, notices = SettingsStore(path).load()
    assert notices == [] and s.last_model == model and os.fsencode(s.models_folder) == b"/mod\xe8les"
    assert s.theme == "dark" and asides(path, "corrupt") == []
    with pytest.raises(SettingsError, match="surrogates not allowed"):  # not a file name's byte: refused still
        store.save(Settings(last_model="/models/\ud83d.gguf"))


def test_binary_garbage_is_moved_aside(path):
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe\x00garbage")
    s, notices = SettingsStore(path).load()
    assert s == Settings() and "not UTF-8" in notices[0] and len(asides(path, "corrupt")) == 1


def test_newer_version_is_kept_aside(path):
    path.parent.mkdir(parents=True)
    future = json.dumps({"version": SETTINGS_VERSION + 1, "theme": "sepia"})
    path.write_text(future)
    store = SettingsStore(path)
    s, notices = store.load()
    assert s == Settings()
    kept = asides(path, "newer")
    assert len(kept) == 1 and (path.parent / kept[0]).read_text() == future
    assert "newer version of Gapless" in notices[0] and kept[0] in notices[0]
    store.save(s)  # saving ours does not overwrite the newer one
    assert (path.parent / kept[0]).read_text() == future


def test_unknown_keys_are_kept_with_a_warning(path, caplog):
    """A newer version's keys (the version number does not change when a field is added) are written back as
    they were: they were dropped at the next save."""
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "theme": "light", "frobnicate": {"level": 3}}))
    store = SettingsStore(path)
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        s, notices = store.load()
    assert s.theme == "light" and notices == []
    assert "keeping unknown key(s) frobnicate" in caplog.text
    s.theme = "dark"
    store.save(s)
    saved = json.loads(path.read_text())
    assert saved["frobnicate"] == {"level": 3} and saved["theme"] == "dark"


def test_an_invalid_option_falls_back_alone_and_the_file_is_kept_beside(path):
    """Temperature -5 in the saved sampling parameters (or a dtype that does not exist) reset every one of them,
    with no copy of the file kept: the next save wrote the defaults over the user's top-k and answer length."""
    path.parent.mkdir(parents=True)
    saved = {
        "theme": "dark",
        "engine_options": {"dtype": "fp7", "kv_cache": "none", "candidates": 3},
        "sampling": {"temperature": -5, "top_k": 20, "max_new_tokens": 2048, "seed": "7"},
        "sampling_saved": True,
    }
    path.write_text(json.dumps(saved))
    store = SettingsStore(path)
    s, notices = store.load()
    assert s.theme == "dark"
    assert s.options() == EngineOptions(kv_cache="none", candidates=3)
    assert s.sampling_params() == SamplingParams(top_k=20, max_new_tokens=2048)
    assert s.new_chat_sampling() == SamplingParams(top_k=20, max_new_tokens=2048)
    kept = asides(path, "corrupt")
    assert len(kept) == 1 and json.loads((path.parent / kept[0]).read_text()) == saved
    assert notices == [
        f"Some settings in {path} could not be used: in the optimization settings, dtype must be one of auto, "
        "fp32, fp16, bf16, got 'fp7'; in the sampling parameters, temperature must be >= 0, got -5; in the "
        "sampling parameters, seed must be an integer in [0, 2**63), got '7'. Their defaults are used. The file "
        f"as it was is kept as {kept[0]}."
    ]
    store.save(s)  # what closing the window does
    now = json.loads(path.read_text())
    assert now["engine_options"]["kv_cache"] == "none" and now["engine_options"]["candidates"] == 3
    assert (now["sampling"]["top_k"], now["sampling"]["max_new_tokens"]) == (20, 2048)
    assert SettingsStore(path).load()[1] == []  # written back valid: said once


def test_saved_options_that_are_all_invalid_fall_back_together(path):
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"engine_options": {"dtype": "fp8"}, "sampling": {"temperature": -1}}))
    s, notices = SettingsStore(path).load()
    assert s.engine_options == EngineOptions().to_dict() and s.sampling == SamplingParams().to_dict()
    assert len(notices) == 1 and "dtype must be one of" in notices[0] and "temperature must be >= 0" in notices[0]
    assert len(asides(path, "corrupt")) == 1


@pytest.mark.parametrize("bad", [{"compile": "false"}, {"cuda_graph": None}, {"profile_window": 1}])
def test_options_of_the_wrong_type_fall_back_with_a_notice(path, bad):
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"theme": "dark", "engine_options": bad}))
    s, notices = SettingsStore(path).load()
    name = next(iter(bad))
    assert s.theme == "dark" and s.engine_options == EngineOptions().to_dict()
    assert len(notices) == 1 and f"{name} must be true or false" in notices[0]


def test_partial_options_are_completed(path):
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"engine_options": {"kv_cache": "none"}}))
    s, _ = SettingsStore(path).load()
    assert s.options() == EngineOptions(kv_cache="none")
    assert s.engine_options == EngineOptions(kv_cache="none").to_dict()


def test_save_is_atomic_and_reports_failure(path):
    store = SettingsStore(path)
    store.save(Settings(theme="dark"))
    os.chmod(path.parent, 0o555)
    try:
        if os.geteuid() == 0:
            # root ignores folder permissions; a file where the folder should be fails for everyone
            bad = SettingsStore(path / "settings.json")
        else:
            bad = store
        with pytest.raises(SettingsError, match="cannot save the settings to"):
            bad.save(Settings(theme="light"))
    finally:
        os.chmod(path.parent, 0o755)
    assert SettingsStore(path).load()[0].theme == "dark"  # the old file is whole


def test_saved_sampling_defaults_equal_to_the_engine_s_are_kept(path):
    """Preferences saved top-p 1, top-k 0, penalty 1: the next start kept them, not the chat defaults (they were
    taken for 'never set' when they equalled SamplingParams()'s values)."""
    from app.settings import CHAT_DEFAULTS

    store = SettingsStore(path)
    assert Settings().new_chat_sampling() == CHAT_DEFAULTS  # nothing saved yet
    engine_defaults = SamplingParams()  # temperature 0.7, top-p 1, top-k 0, penalty 1, 256 tokens
    store.save(Settings(sampling=engine_defaults.to_dict(), sampling_saved=True))
    assert store.load()[0].new_chat_sampling() == engine_defaults
    chosen = SamplingParams(temperature=0.3, top_k=12)
    # a file of the version before the mark: its engine defaults meant "never set", other values were chosen
    legacy = {"version": 1, "sampling": engine_defaults.to_dict()}
    path.write_text(json.dumps(legacy))
    assert store.load()[0].new_chat_sampling() == CHAT_DEFAULTS
    path.write_text(json.dumps({**legacy, "sampling": chosen.to_dict()}))
    assert store.load()[0].new_chat_sampling() == chosen


def test_invalid_saved_sampling_falls_back_to_the_chat_defaults(path):
    from app.settings import CHAT_DEFAULTS

    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"sampling": {"temperature": -3}, "sampling_saved": True}))
    store = SettingsStore(path)
    s, notices = store.load()
    assert notices and "sampling parameters" in notices[0]
    assert s.new_chat_sampling() == CHAT_DEFAULTS  # "defaults are used": the chat's, as before anything was saved
    store.save(s)  # and stay so: the mark of a saved choice was kept on disk, the engine's defaults taken for one
    assert store.load()[0].new_chat_sampling() == CHAT_DEFAULTS


@pytest.mark.parametrize("sampling", ["hot", ["temperature", 0.2], None])
def test_saved_sampling_that_is_not_an_object_falls_back_to_the_chat_defaults(path, sampling):
    """New chats took the engine's defaults (256 tokens, no top-k, no repetition penalty), and the next save
    made them the user's choice."""
    from app.settings import CHAT_DEFAULTS

    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"sampling": sampling, "sampling_saved": True}))
    store = SettingsStore(path)
    s, notices = store.load()
    assert notices and "sampling is" in notices[0]
    assert s.new_chat_sampling() == CHAT_DEFAULTS
    store.save(s)
    assert store.load()[0].new_chat_sampling() == CHAT_DEFAULTS


def test_a_sampling_option_that_is_not_valid_unicode_falls_back_alone(path):
    """A lone surrogate in one stop string dropped every saved sampling option with it."""
    path.parent.mkdir(parents=True)
    path.write_text('{"sampling": {"temperature": 0.2, "stop": ["\\ud800"]}, "sampling_saved": true}')
    store = SettingsStore(path)
    s, notices = store.load()
    assert len(notices) == 1 and "stop is text that is not valid Unicode" in notices[0]
    assert s.new_chat_sampling() == SamplingParams(temperature=0.2)
    store.save(s)  # every save failed on the surrogate before
    assert store.load()[0].new_chat_sampling() == SamplingParams(temperature=0.2)


@pytest.mark.parametrize("option", ['"future_option": "\\ud83d"', '"\\ud83d": 1'])
def test_an_unknown_option_that_is_not_valid_unicode_falls_back_and_saves_go_on(path, option):
    """An option of a newer version holding a lone surrogate (its value or its name) was kept to be written back,
    and every save failed on it."""
    path.parent.mkdir(parents=True)
    path.write_text('{"sampling": {"temperature": 0.5, ' + option + '}, "sampling_saved": true}')
    store = SettingsStore(path)
    s, notices = store.load()
    assert (
        len(notices) == 1 and "an option this version does not know holds text that is not valid Unicode" in notices[0]
    )
    assert s.new_chat_sampling().temperature == 0.5
    store.save(s)
    assert store.load()[0].new_chat_sampling().temperature == 0.5


def test_a_remote_answer_s_device_is_not_a_setting(path):
    """ "remote" marks a remote server's answers' options; as a saved choice no local engine could run it."""
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"theme": "dark", "engine_options": {"device": "remote"}}))
    s, notices = SettingsStore(path).load()
    assert s.theme == "dark" and s.engine_options == EngineOptions().to_dict()
    assert len(notices) == 1 and "device must be one of auto, cpu, cuda, got 'remote'" in notices[0]


def test_a_newer_version_s_options_are_kept_beside_the_ones_in_use(path):
    """One option this version does not know (written by a newer Gapless) reset every saved optimization and
    sampling setting, and the next save wrote the defaults over them: going back a version lost the user's
    choices."""
    path.parent.mkdir(parents=True)
    saved = {
        "theme": "dark",
        "engine_options": {"kv_cache": "none", "dtype": "bf16", "future_option": "on"},
        "sampling": {"temperature": 0.3, "future_sampler": 2},
    }
    path.write_text(json.dumps(saved))
    store = SettingsStore(path)
    s, notices = store.load()
    assert notices == []
    assert s.options() == EngineOptions(kv_cache="none", dtype="bf16") and s.sampling["temperature"] == 0.3
    s.theme = "light"
    store.save(s)  # a change elsewhere leaves the options as they were written
    on_disk = json.loads(path.read_text())
    assert on_disk["engine_options"]["future_option"] == "on" and on_disk["engine_options"]["dtype"] == "bf16"
    assert on_disk["sampling"]["future_sampler"] == 2
    s.engine_options = EngineOptions(kv_cache="static", dtype="bf16").to_dict()
    store.save(s)  # a changed option is written with the newer version's kept beside it
    on_disk = json.loads(path.read_text())
    assert on_disk["engine_options"]["kv_cache"] == "static" and on_disk["engine_options"]["future_option"] == "on"
    again, _ = SettingsStore(path).load()
    assert again.options() == EngineOptions(kv_cache="static", dtype="bf16")


@pytest.mark.parametrize(
    "content, said",
    [
        ({"version": SETTINGS_VERSION + 1, "theme": "dark"}, "written by a newer version"),
        ({"version": 1, "theme": "Dark"}, 'theme is "Dark"'),
    ],
)
def test_a_command_that_only_reads_the_settings_leaves_a_file_it_cannot_use_as_it_is(path, content, said):
    """`gapless models list` moved a newer version's settings aside (that version then started on its defaults)
    and copied a file with one bad value aside at every run."""
    path.parent.mkdir(parents=True)
    text = json.dumps(content)
    path.write_text(text)
    for _ in range(2):
        store = SettingsStore(path, read_only=True)
        s, notices = store.load()
        assert len(notices) == 1 and said in notices[0] and "efault" in notices[0] and "kept as" not in notices[0]
    assert path.read_text() == text and list(path.parent.glob("settings.json.*")) == []
    with pytest.raises(SettingsError, match="read only to be looked at"):
        store.save(s)
