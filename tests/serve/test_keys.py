"""API keys of remote servers: in a file only its owner can read when no keyring is usable; never logged."""

from __future__ import annotations

import stat
import sys
import types

import pytest
from saves_at_once import saves_at_once

from app.keys import SERVICE, KeyStore


def test_the_file_store_is_owner_only_and_round_trips(tmp_path, caplog):
    caplog.set_level("DEBUG")
    store = KeyStore(tmp_path / "config", use_keyring=False)
    assert store.get("http://h:8000/v1") is None
    store.set("http://h:8000/v1", "sk-secret-1")
    store.set("http://other/v1", "sk-secret-2")
    assert stat.S_IMODE(store.file.stat().st_mode) == 0o600
    again = KeyStore(tmp_path / "config", use_keyring=False)
    assert again.get("http://h:8000/v1") == "sk-secret-1" and again.get("http://other/v1") == "sk-secret-2"
    again.set("http://h:8000/v1", None)
    assert KeyStore(tmp_path / "config", use_keyring=False).get("http://h:8000/v1") is None
    assert stat.S_IMODE(store.file.stat().st_mode) == 0o600
    assert not any("sk-secret" in r.getMessage() for r in caplog.records)
    assert "readable by its owner only" in store.where


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000 + "]" * 100_000], ids=["not json", "nested"])
def test_a_corrupt_key_file_reads_as_empty(tmp_path, text):
    """A file nested past Python's recursion limit ended the remote model's opening in an internal error."""
    store = KeyStore(tmp_path, use_keyring=False)
    store.file.write_text(text)
    assert store.get("http://h/v1") is None
    store.set("http://h/v1", "k")
    assert store.get("http://h/v1") == "k"


def test_a_damaged_key_file_is_kept_aside_when_a_key_is_saved(tmp_path):
    """A key file cut short (or hand-edited into bad JSON) read as empty, and saving the next key wrote a file of
    that key alone over it: every other server's key was gone, with no copy left."""
    store = KeyStore(tmp_path, use_keyring=False)
    damaged = '{"http://a/v1": "sk-a", "http://b/v1": "sk-'
    store.file.write_text(damaged)
    store.set("http://h/v1", "k")
    assert store.get("http://h/v1") == "k" and store.get("http://a/v1") is None
    kept = sorted(tmp_path.glob("remote_keys.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text() == damaged
    store.set("http://i/v1", "k2")  # a file that reads is written over, as always
    assert len(sorted(tmp_path.glob("remote_keys.json.corrupt-*"))) == 1


def fake_keyring(monkeypatch, get, set_) -> types.ModuleType:
    """A keyring module with a working backend whose reads and writes are `get` and `set_`."""

    class Backend:
        pass

    keyring = types.ModuleType("keyring")
    keyring.get_keyring = lambda: Backend()
    keyring.get_password = get
    keyring.set_password = set_
    backends = types.ModuleType("keyring.backends")
    fail = types.ModuleType("keyring.backends.fail")
    fail.Keyring = type("Keyring", (), {})
    backends.fail = fail
    monkeypatch.setitem(sys.modules, "keyring", keyring)
    monkeypatch.setitem(sys.modules, "keyring.backends", backends)
    monkeypatch.setitem(sys.modules, "keyring.backends.fail", fail)
    return keyring


def test_a_working_keyring_is_preferred(tmp_path, monkeypatch):
    saved: dict = {}
    keyring = fake_keyring(
        monkeypatch,
        lambda service, user: saved.get((service, user)),
        lambda service, user, key: saved.__setitem__((service, user), key),
    )
    store = KeyStore(tmp_path)
    assert store.where == "the OS keyring"
    store.set("http://h/v1", "sk-k")
    assert saved == {(SERVICE, "http://h/v1"): "sk-k"} and not store.file.exists()
    assert store.get("http://h/v1") == "sk-k"
    fail = sys.modules["keyring.backends.fail"]
    keyring.get_keyring = lambda: fail.Keyring()  # no backend (a headless Linux): the file
    assert KeyStore(tmp_path).keyring is None


def test_a_key_the_keyring_refused_is_read_back_from_the_file(tmp_path, monkeypatch):
    """A keyring that cannot store (locked, read-only) but reads: the key kept in the file is still found."""

    def refuse(*_a):
        raise RuntimeError("the keyring is locked")

    fake_keyring(monkeypatch, lambda service, user: None, refuse)
    store = KeyStore(tmp_path)
    store.set("http://h/v1", "sk-k")
    assert store.file.exists() and KeyStore(tmp_path).get("http://h/v1") == "sk-k"


def test_two_windows_saving_keys_at_the_same_moment_both_keep_theirs(tmp_path, monkeypatch):
    """Each read the file before the other wrote it, and the second write lost the first's key."""
    import app.keys

    one, two = KeyStore(tmp_path, use_keyring=False), KeyStore(tmp_path, use_keyring=False)
    saves_at_once(
        monkeypatch,
        app.keys,
        lambda: one.set("http://a:8000/v1", "key-a"),
        lambda: two.set("http://b:8000/v1", "key-b"),
    )
    again = KeyStore(tmp_path, use_keyring=False)
    assert (again.get("http://a:8000/v1"), again.get("http://b:8000/v1")) == ("key-a", "key-b")
