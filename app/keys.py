"""API keys of remote servers: in the OS keyring when the `keyring` package is installed and has a working
backend, else in the config folder in a file only its owner can read. Keys are never logged."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from app.store import move_aside
from engine.paths import locked_beside, write_whole

log = logging.getLogger(__name__)

SERVICE = "gapless-remote"
FILE_NAME = "remote_keys.json"


def _keyring() -> Optional[Any]:
    """The keyring module when it can store secrets here (no backend, e.g. a headless Linux: None)."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    try:
        if isinstance(keyring.get_keyring(), fail.Keyring):
            return None
    except Exception as exc:  # a broken backend configuration: fall back to the file
        log.info("keyring unusable: %s", type(exc).__name__)
        return None
    return keyring


class KeyStore:
    def __init__(self, config_dir: Path, use_keyring: bool = True):
        self.file = Path(config_dir) / FILE_NAME
        self.keyring = _keyring() if use_keyring else None

    @property
    def where(self) -> str:
        return "the OS keyring" if self.keyring is not None else f"{self.file} (readable by its owner only)"

    def get(self, base_url: str) -> Optional[str]:
        if self.keyring is not None:
            try:
                key = self.keyring.get_password(SERVICE, base_url)
                if key:
                    return key
            except Exception as exc:  # the keyring went away (locked, no daemon): the file may still have it
                log.warning("keyring read failed (%s); trying %s", type(exc).__name__, self.file)
        # also where the keyring has none: a write it refused kept the key in the file
        return self._read().get(base_url)

    def set(self, base_url: str, key: Optional[str]) -> None:
        """Store the key for `base_url` (None or "" forgets it)."""
        if self.keyring is not None:
            try:
                if key:
                    self.keyring.set_password(SERVICE, base_url, key)
                else:
                    self._keyring_delete(base_url)
                return
            except Exception as exc:  # fall back to the file rather than lose the key
                log.warning("keyring write failed (%s); keeping the key in %s", type(exc).__name__, self.file)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        # read, changed and written by one process at a time: two windows saving keys at once lost one of them
        with locked_beside(self.file, "the API keys"):
            keys, damage = self._read_file()
            if damage:  # written over, its other keys were gone for good: kept beside the new file
                aside = move_aside(self.file, "corrupt")
                log.warning(
                    "API key file %s could not be read (%s); kept as %s and a new one started",
                    self.file,
                    damage,
                    aside.name,
                )
            if key:
                keys[base_url] = key
            else:
                keys.pop(base_url, None)
            self._write(keys)

    def _keyring_delete(self, base_url: str) -> None:
        assert self.keyring is not None
        from keyring.errors import PasswordDeleteError

        try:
            self.keyring.delete_password(SERVICE, base_url)
        except PasswordDeleteError:
            return

    def _read(self) -> dict[str, str]:
        return self._read_file()[0]

    def _read_file(self) -> tuple[dict[str, str], str]:
        """The keys in the file, and why the file could not be read ("" where it could, or is not there)."""
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}, ""
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            log.warning("API key file %s unreadable: %s", self.file, type(exc).__name__)
            # a folder in its place is not moved: no key is lost there, and the write says it cannot be kept
            return {}, "" if isinstance(exc, IsADirectoryError) else type(exc).__name__
        if not isinstance(data, dict):
            return {}, f"a JSON {type(data).__name__}, not an object"
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}, ""

    def _write(self, keys: dict[str, str]) -> None:
        write_whole(self.file, json.dumps(keys), mode=0o600)  # owner-only from its first byte
