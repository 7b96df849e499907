"""User settings in one JSON file in the config dir: written atomically, and never fatal when damaged.

A file that cannot be read as our settings is moved aside (`settings.json.corrupt-<timestamp>`), one that cannot be
read at all (no permission, a folder in its place) too (`settings.json.unreadable-<timestamp>`), and defaults are
used; a file written by a newer version is moved aside too (`settings.json.newer-<timestamp>`), so saving ours
never overwrites it. A file that becomes one of these after it was read (a hand edit cut short, a newer version
saving meanwhile) is moved aside by the next save. Each such case leaves a notice for the app to show.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import shutil
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from app.store import aside_name, move_aside
from engine import figures
from engine.errors import GaplessError, OptionsError
from engine.paths import locked_beside, write_whole
from engine.types import DEVICES, OVERFLOW_POLICIES, EngineOptions, SamplingParams, server_decides

log = logging.getLogger(__name__)

SETTINGS_VERSION = 1
THEMES = ("system", "light", "dark")
SEND_KEYS = ("enter", "ctrl+enter")


class SettingsError(GaplessError):
    """The settings file cannot be written; the message says why."""


def _default_options() -> dict[str, Any]:
    return EngineOptions().to_dict()


def _default_sampling() -> dict[str, Any]:
    return SamplingParams().to_dict()


# The sampling of a new chat until the user saves defaults of their own: a chat model's usual settings.
CHAT_DEFAULTS = SamplingParams(
    temperature=0.7, top_p=0.95, top_k=40, repetition_penalty=1.1, max_new_tokens=512, seed=None
)


@dataclass
class Settings:
    theme: str = "system"  # system | light | dark
    send_with: str = "enter"  # enter | ctrl+enter (the other inserts a newline)
    last_model: Optional[str] = None  # "default" or a path, reopened at start
    engine_options: dict[str, Any] = field(default_factory=_default_options)  # EngineOptions.to_dict()
    sampling: dict[str, Any] = field(default_factory=_default_sampling)  # defaults for new chats
    # Whether the user saved `sampling` (Preferences): until then new chats take CHAT_DEFAULTS. Without this
    # mark, defaults saved equal to SamplingParams()'s were taken for "never set" and reverted at the next start.
    sampling_saved: bool = False
    models_folder: Optional[str] = None  # scanned for models
    window_geometry: Optional[str] = None  # base64 of QWidget.saveGeometry()
    window_state: Optional[str] = None  # base64 of QMainWindow.saveState()
    hud_visible: bool = True
    splitter_sizes: dict[str, list[int]] = field(default_factory=dict)  # splitter name -> sizes
    last_folder: Optional[str] = None  # where the last file dialog was left: the next one starts there
    overflow_policy: str = "rolling"  # for chats without their own (engine.types.OVERFLOW_POLICIES)
    system_prompt: str = ""  # of new chats (Preferences); "" = none
    # The Server panel: where the API listens, and whether the panel is shown (its key is kept as remote models'
    # are: app.keys, under SERVER_KEY_NAME)
    server_host: str = "127.0.0.1"
    server_port: int = 8080
    server_visible: bool = False

    def options(self) -> EngineOptions:
        return EngineOptions.from_dict(self.engine_options)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling)

    def new_chat_sampling(self) -> SamplingParams:
        """The sampling of a new chat: what the user saved as the default, else CHAT_DEFAULTS (a file of a
        version without `sampling_saved` holds SamplingParams()'s values where nothing was saved)."""
        saved = self.sampling_params()
        return saved if self.sampling_saved or saved != SamplingParams() else CHAT_DEFAULTS

    def to_dict(self) -> dict[str, Any]:
        return {"version": SETTINGS_VERSION, **asdict(self)}


def _optional_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _base64(v: Any) -> bool:
    if v is None:
        return True
    if not isinstance(v, str):
        return False
    try:
        base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _unicode(value: Any) -> bool:
    """Whether `value`'s text can be written as UTF-8."""
    try:
        return figures.utf8_text(json.dumps(value, ensure_ascii=False))
    except RecursionError:
        return False


def _path_text(value: Any) -> bool:
    """Whether `value` is a path as Python gives it: a file name's bytes that are not UTF-8 are kept as the lone
    surrogates U+DC80..U+DCFF (os.fsdecode), written to the file as JSON escapes."""
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no file name's byte gives
        return False
    return True


PATH_FIELDS = ("last_model", "models_folder")  # paths: their names' bytes need not be UTF-8


def _names_bytes(doc: dict[str, Any]) -> bool:
    """Whether what in `doc` is not UTF-8 is only paths' bytes (PATH_FIELDS): a model opened from a file named
    in another encoding failed every save of the settings, all of them lost."""
    rest = {k: v for k, v in doc.items() if k not in PATH_FIELDS}
    return _unicode(rest) and all(_path_text(doc.get(k)) for k in PATH_FIELDS)


MAX_PANE_PX = 100_000  # a splitter pane's saved width or height; Qt takes 32-bit ints


def _sizes(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str)
        and isinstance(s, list)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_PANE_PX for n in s)
        for k, s in v.items()
    )


# field -> (check, what it must be). The engine options and sampling dicts are validated by their own types.
_CHECKS = {
    "theme": (lambda v: v in THEMES, f"one of {', '.join(THEMES)}"),
    "send_with": (lambda v: v in SEND_KEYS, f"one of {', '.join(SEND_KEYS)}"),
    "last_model": (_optional_str, "a string or null"),
    "engine_options": (lambda v: isinstance(v, dict), "an object"),
    "sampling": (lambda v: isinstance(v, dict), "an object"),
    "models_folder": (_optional_str, "a string or null"),
    "window_geometry": (_base64, "base64 text or null"),
    "window_state": (_base64, "base64 text or null"),
    "hud_visible": (lambda v: isinstance(v, bool), "true or false"),
    "splitter_sizes": (_sizes, "an object of lists of sizes"),
    "last_folder": (_optional_str, "a string or null"),
    "overflow_policy": (lambda v: v in OVERFLOW_POLICIES, f"one of {', '.join(OVERFLOW_POLICIES)}"),
    "system_prompt": (lambda v: isinstance(v, str), "a string"),
    "sampling_saved": (lambda v: isinstance(v, bool), "true or false"),
    "server_host": (lambda v: isinstance(v, str) and 0 < len(v) <= 255, "a host name or address"),
    "server_port": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535, "a port, 1-65535"),
    "server_visible": (lambda v: isinstance(v, bool), "true or false"),
}
assert set(_CHECKS) == {f.name for f in fields(Settings)}


def _usable_options(kind: type[EngineOptions] | type[SamplingParams], saved: dict[str, Any]) -> tuple[dict, list[str]]:
    """The saved options of `kind` that are valid (each is checked alone: none depends on another), and what is
    wrong with each of the others."""
    usable: dict[str, Any] = {}
    bad: list[str] = []
    for name, value in saved.items():
        try:
            if not _unicode(value):  # a lone surrogate (\ud83d) reads, and then every save would fail
                raise OptionsError(f"{name} is text that is not valid Unicode")
            kind.from_dict({name: value})
            if kind is EngineOptions and name == "device" and server_decides({name: value}):
                # a remote answer's, not a choice this machine runs
                raise OptionsError(f"device must be one of {', '.join(DEVICES)}, got {value!r}")
        except (OptionsError, TypeError) as exc:
            bad.append(str(exc))
            continue
        usable[name] = value
    return usable, bad


class _Unreadable(Exception):
    """The file is not our settings (bad JSON or a wrong type). Never leaves the module."""


class _Unusable(Exception):
    """The settings file cannot be used: `tag` names the copy kept aside, `reason` says why. Never leaves the
    module."""

    def __init__(self, tag: str, reason: str):
        super().__init__(reason)
        self.tag, self.reason = tag, reason


def _merged(on_disk: dict[str, Any], seen: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """The file as another window left it, with what this window changed since it read it. An object's entries
    count one by one (the optimizations, the sampling defaults): one window's dtype and another's KV cache both
    stay, where the whole object of the window saving last undid the other's choice."""
    out = dict(on_disk)
    for k, v in mine.items():
        before = seen.get(k)
        if k in seen and before == v:
            continue
        there = on_disk.get(k)
        if isinstance(v, dict) and isinstance(before, dict) and isinstance(there, dict):
            merged = {**there, **{sk: sv for sk, sv in v.items() if sk not in before or before[sk] != sv}}
            out[k] = {sk: sv for sk, sv in merged.items() if sk in v or sk not in before}  # removed here: gone
        else:
            out[k] = v
    return out


class SettingsStore:
    """The settings file. Two windows may share it (two instances on one data folder): a save writes the
    settings this window changed since it read or last wrote them, over what the file holds now, so closing
    one window does not undo what the other saved."""

    def __init__(self, path: Path, read_only: bool = False):
        """`read_only`: for a command that only reads them (`gapless models list`): a file it cannot use is left
        as it is, not moved or copied aside (a newer version's file was moved, and that version started on its
        defaults), and saving is refused."""
        self.path = Path(path)
        self.read_only = read_only
        self.unknown: dict[str, Any] = {}  # keys of the file this version does not know (a newer one's)
        self.unknown_options: dict[str, dict[str, Any]] = {}  # the same inside engine_options and sampling
        self._seen: Optional[dict[str, Any]] = None  # the settings as this window last read or wrote them
        self._fell_back: set[str] = set()  # fields the last load could not use (written at the next save)

    def load(self) -> tuple[Settings, list[str]]:
        """The saved settings (defaults where missing or invalid) and notices for the user."""
        self._fell_back = set()
        settings, notices = self._load()
        seen = self._with_unknown_options(settings.to_dict())
        for name in self._fell_back:  # their defaults count as changes: the next save writes them
            seen.pop(name, None)
        self._seen = seen
        return settings, notices

    def _load(self) -> tuple[Settings, list[str]]:
        notices: list[str] = []
        try:
            data = self._read(absent=(FileNotFoundError,))
        except _Unusable as exc:
            return Settings(), self._aside(exc.tag, exc.reason, notices)
        if data is None:
            return Settings(), notices
        bad = self._bad_fields(data)
        for name in bad:
            del data[name]
        self._fell_back |= set(bad)
        if "sampling" in bad:  # none of the saved ones is left: new chats take the chat defaults
            data.pop("sampling_saved", None)
            self._fell_back.add("sampling_saved")
        settings, bad_options = self._settings(data)
        reasons = [*bad.values(), *bad_options]
        if reasons:  # each falls back alone; the file as it was is kept beside it
            self._copy_aside("; ".join(reasons), notices)
        return settings, notices

    def _read(self, absent: tuple[type[OSError], ...]) -> Optional[dict[str, Any]]:
        """The file as a settings object of this version; None where reading it raised one of `absent` (there is
        none). _Unusable where it cannot be used: not UTF-8, unreadable, not our settings, a newer version's."""
        try:
            text = self.path.read_text(encoding="utf-8-sig")  # a byte order mark, as Windows' Notepad writes
        except absent:
            return None
        except UnicodeDecodeError as exc:
            raise _Unusable("corrupt", f"it is not UTF-8 text ({exc.reason})") from exc
        except OSError as exc:  # no read permission, a folder in its place, a disk error
            # Moved aside, as a damaged file is: left in place, the first save would write the defaults over it.
            raise _Unusable("unreadable", f"it cannot be read ({exc.strerror or exc})") from exc
        try:
            data = self._parse(text)
        except _Unreadable as exc:
            raise _Unusable("corrupt", str(exc)) from exc
        version = data.get("version", SETTINGS_VERSION)
        if version > SETTINGS_VERSION:  # checked before the fields: a newer file may use values we do not know
            raise _Unusable("newer", _newer(version))
        return data

    def _parse(self, text: str) -> dict[str, Any]:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _Unreadable(f"it is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from exc
        except RecursionError as exc:
            raise _Unreadable("it is nested too deeply to read") from exc
        except ValueError as exc:  # a number of more digits than Python converts (sys.get_int_max_str_digits)
            raise _Unreadable(f"it holds a number of more than {sys.get_int_max_str_digits()} digits") from exc
        if not isinstance(data, dict):
            raise _Unreadable(f"it holds a JSON {type(data).__name__}, not an object")
        version = data.get("version", SETTINGS_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise _Unreadable(f"its version is {version!r}, not a positive integer")
        return data

    @staticmethod
    def _bad_fields(data: dict[str, Any]) -> dict[str, str]:
        """{field: what is wrong with it} for the known fields that cannot be used as they are."""
        bad = {}
        for name, value in data.items():
            if name not in _CHECKS:
                continue
            ok, expected = _CHECKS[name]
            shown = json.dumps(value)[:60]
            if not ok(value):
                bad[name] = f"{name} is {shown}, not {expected}"
            elif name in PATH_FIELDS and _path_text(value):
                continue
            elif not _unicode(value) and name not in ("engine_options", "sampling"):  # options: one by one
                bad[name] = f"{name} is {shown}, text that is not valid Unicode"
        return bad

    def _settings(self, data: dict[str, Any]) -> tuple[Settings, list[str]]:
        """The settings of `data`'s known fields, and what is wrong with each option inside the optimization and
        sampling settings that falls back to its default."""
        unknown = sorted(set(data) - set(_CHECKS) - {"version"})
        if unknown:  # a newer version's, written back as they are
            log.warning("settings file %s: keeping unknown key(s) %s", self.path, ", ".join(unknown))
        self.unknown = {k: data[k] for k in unknown}
        s = Settings(**{k: v for k, v in data.items() if k in _CHECKS})
        # Saved options that no longer validate (a renamed value, a hand edit) fall back to their defaults one by
        # one: one bad value reset every option beside it, and the next save wrote the defaults over them.
        nested = (
            ("engine_options", EngineOptions, "optimization settings"),
            ("sampling", SamplingParams, "sampling parameters"),
        )
        self.unknown_options = {}
        reasons: list[str] = []
        for name, kind, what in nested:
            saved = getattr(s, name)
            known = {f.name for f in fields(kind)}
            extra = {k: v for k, v in saved.items() if k not in known}
            for k in [k for k, v in extra.items() if not (_unicode(k) and _unicode(v))]:
                del extra[k]  # kept, it would have every save fail
                reasons.append(
                    f"in the {what}, an option this version does not know holds text that is not valid Unicode"
                )
                self._fell_back.add(name)
            if extra:  # a newer version's options: the rest are used, and these written back as they are
                log.warning("settings file %s: keeping unknown %s %s", self.path, what, ", ".join(sorted(extra)))
                self.unknown_options[name] = extra
            usable, bad = _usable_options(kind, {k: v for k, v in saved.items() if k in known})
            setattr(s, name, kind.from_dict(usable).to_dict())  # the defaults where an option is missing or bad
            if not bad:
                continue
            reasons += [f"in the {what}, {why}" for why in bad]
            self._fell_back.add(name)
            if name == "sampling" and not usable:
                s.sampling_saved = False  # nothing of the saved ones is left: new chats take the chat defaults
                self._fell_back.add("sampling_saved")
        return s, reasons

    def _copy_aside(self, reason: str, notices: list[str]) -> None:
        if self.read_only:
            notices.append(f"Some settings in {self.path} could not be used: {reason}. Their defaults are used.")
            return
        try:
            aside = aside_name(self.path, "corrupt")
            shutil.copy2(self.path, aside)
            kept = f" The file as it was is kept as {aside.name}."
        except OSError as exc:
            kept = f" (A copy of the file could not be kept: {exc.strerror or exc}.)"
        log.error("settings file %s: unusable settings fall back to their defaults: %s", self.path, reason)
        notices.append(f"Some settings in {self.path} could not be used: {reason}. Their defaults are used.{kept}")

    def _aside(self, tag: str, reason: str, notices: list[str]) -> list[str]:
        if self.read_only:
            notices.append(f"The settings file {self.path} could not be used: {reason}. Default settings are used.")
            return notices
        try:
            aside = move_aside(self.path, tag)
        except OSError as exc:
            log.error("settings file %s is unusable (%s) and cannot be moved aside: %s", self.path, reason, exc)
            notices.append(
                f"The settings file {self.path} could not be used: {reason}. Default settings are used "
                f"(it could not be moved aside: {exc.strerror or exc})."
            )
            return notices
        log.error("settings file %s is unusable (%s); moved to %s", self.path, reason, aside)
        notices.append(
            f"The settings file {self.path} could not be used: {reason}. It was kept as {aside.name} "
            "and default settings are used."
        )
        return notices

    def save(self, settings: Settings) -> list[str]:
        """Write atomically: a crash or a full disk leaves either the old file or the new one, never half.
        Notices for the user: a file that could not be used since it was read (damaged by a hand edit, a newer
        version's) was moved aside before this one was written."""
        if self.read_only:
            raise SettingsError(f"the settings in {self.path} were read only to be looked at, not to be saved")
        mine = self._with_unknown_options(settings.to_dict())
        notices: list[str] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Read, merged and written by one window at a time: two saving at once (a logout closes both) each
            # read the file before the other wrote it, and the second write undid the first's changes.
            with locked_beside(self.path, "settings"):
                doc = {**self.unknown, **mine}
                on_disk = self._current(notices)
                if on_disk is not None and self._seen is not None:  # what another window saved meanwhile stays
                    doc = {**_merged(on_disk, self._seen, mine), "version": SETTINGS_VERSION}
                text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False)
                if not figures.utf8_text(text) and _names_bytes(doc):  # written with its bytes escaped (the rest too)
                    text = json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False)
                # a link (a settings file kept with the user's dotfiles) is written through and kept
                target = self.path.resolve() if self.path.is_symlink() else self.path
                write_whole(target, text + "\n", mode=0o600, durable=True)
        except OSError as exc:
            raise SettingsError(f"cannot save the settings to {self.path}: {exc.strerror or exc}") from exc
        except ValueError as exc:  # NaN, or text that is not valid Unicode
            raise SettingsError(f"cannot save the settings to {self.path}: {exc}") from exc
        self._seen = mine
        return notices

    def _with_unknown_options(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The settings as written: a newer version's options kept beside this version's (which win)."""
        for name, extra in self.unknown_options.items():
            if isinstance(doc.get(name), dict):
                doc[name] = {**extra, **doc[name]}
        return doc

    def _current(self, notices: list[str]) -> Optional[dict[str, Any]]:
        """The file as it is now, where it reads as a settings object of this version (else None: this window's
        settings are written whole, as they would be without another window). One that cannot be used, damaged or
        written by a newer version since this window read it, is moved aside first, with a notice: written over,
        it was gone with no copy. One that cannot be moved aside is a SettingsError: it is not written over."""
        try:  # none yet, or a file in the folder's place (the write says so)
            return self._read(absent=(FileNotFoundError, NotADirectoryError))
        except _Unusable as exc:
            tag, reason = exc.tag, exc.reason
        try:
            aside = move_aside(self.path, tag)
        except OSError as exc:
            raise SettingsError(
                f"cannot save the settings to {self.path}: the file there could not be used ({reason}) and could "
                f"not be moved aside ({exc.strerror or exc}); it is left as it is"
            ) from exc
        log.error("settings file %s is unusable (%s); moved to %s before saving", self.path, reason, aside)
        notices.append(
            f"The settings file {self.path} could not be used: {reason}. It was kept as {aside.name} and the "
            "settings of this window were saved in its place."
        )
        return None


def _newer(version: int) -> str:
    return (
        f"it was written by a newer version of Gapless (settings version {version}, "
        f"this version reads up to {SETTINGS_VERSION})"
    )
