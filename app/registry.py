"""Known models: the default model, the recently opened ones (a small JSON file in the config dir) and the ones
found in a models folder. Nothing here loads a model; it only looks at names and sizes on disk."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from app.store import move_aside
from engine.default_model import SMOLLM2_135M_Q4_1, DefaultModelSpec, cached_default_model
from engine.paths import locked_beside, user_path, write_whole
from engine.types import REMOTE_PREFIX, hub_name, safetensors_weights

log = logging.getLogger(__name__)

RECENT_FILE = "recent_models.json"
RECENT_VERSION = 1
RECENT_MAX = 10
SCAN_DEPTH = 2  # folders below the scanned one
DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class ModelEntry:
    source: str  # what load_checkpoint takes: "default" or an absolute path
    name: str
    kind: str  # "default" | "gguf" | "hf-folder" | "remote"
    path: Optional[str]  # the file or folder on disk; None for the default model before it is downloaded
    present: bool  # False: a recent model whose file is gone, or the default model not downloaded yet
    size_bytes: Optional[int] = None  # of the file, or of the folder's weights
    last_used: Optional[float] = None  # epoch seconds, recent models only
    note: str = ""  # "not downloaded", "missing", ...

    def to_dict(self) -> dict:
        return asdict(self)


def kind_of(path: Path) -> Optional[str]:
    """ "gguf", "hf-folder" or None: a GGUF by its name or, as the loader opens one, by its first bytes (Ollama
    keeps its models as blobs named by their hash)."""
    if path.is_file() and (path.suffix.lower() == ".gguf" or _gguf_head(path)):
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf-folder"
    return None


def _gguf_head(path: Path) -> bool:
    from engine.gguf_header import GGUF_MAGIC  # here: the header reader brings numpy, which listing models needs not

    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def _size(path: Path, kind: str) -> Optional[int]:
    try:
        if kind == "hf-folder":
            return sum(p.stat().st_size for p in safetensors_weights(path))
        return path.stat().st_size
    except OSError:
        return None


def entry_for(path: Path, last_used: Optional[float] = None) -> ModelEntry:
    path = Path(path)
    note = "missing"
    try:
        kind = kind_of(path)
    except OSError as exc:  # a folder on the way the user may not open, a name too long: that row, not the list
        kind, note = None, f"cannot read: {exc.strerror or exc}"
    if kind is None:
        return ModelEntry(
            str(path),
            path.name,
            "gguf" if path.suffix.lower() == ".gguf" else "hf-folder",
            str(path),
            False,
            None,
            last_used,
            note,
        )
    return ModelEntry(
        str(path), path.stem if kind == "gguf" else hub_name(path), kind, str(path), True, _size(path, kind), last_used
    )


def default_model_entry(spec: DefaultModelSpec = SMOLLM2_135M_Q4_1, cache_dir: Optional[Path] = None) -> ModelEntry:
    path = cached_default_model(spec, cache_dir)
    name = Path(spec.filename).stem
    if path is None:
        return ModelEntry(
            DEFAULT_SOURCE,
            name,
            "default",
            None,
            False,
            spec.size,
            None,
            f"not downloaded ({spec.wheel_size / 1e6:.0f} MB download)",
        )
    return ModelEntry(DEFAULT_SOURCE, name, "default", str(path), True, spec.size)


def scan_models_folder(folder: Path, max_depth: int = SCAN_DEPTH) -> list[ModelEntry]:
    """GGUF files and HF folders (with the GGUF files in them) in `folder` and up to `max_depth` levels below it,
    sorted by path.
    Hidden entries, unreadable folders and symlinked folders (which could loop) are skipped."""
    found: list[ModelEntry] = []

    def walk(d: Path, depth: int) -> None:
        try:
            children = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            log.info("cannot scan %s: %s", d, exc)
            return
        for e in children:
            if e.name.startswith("."):
                continue
            p = Path(e.path)
            try:
                if e.is_file() and e.name.lower().endswith(".gguf"):
                    found.append(entry_for(p))
                elif e.is_dir(follow_symlinks=False):
                    if kind_of(p) == "hf-folder":
                        found.extend(_hf_folder_entries(p))
                    elif depth < max_depth or _hub_snapshot(p):
                        walk(p, depth + 1)
            except OSError as exc:
                log.info("cannot inspect %s: %s", p, exc)

    root = user_path(folder)
    try:
        if kind_of(root) == "hf-folder":
            return _hf_folder_entries(Path(os.path.abspath(root)))
        if root.is_dir():
            walk(Path(os.path.abspath(root)), 0)  # links kept, as the recent list keeps them
    except OSError as exc:  # the folder itself cannot be read: nothing found in it, and why in the log
        log.info("cannot inspect %s: %s", root, exc)
    return found


def _hub_snapshot(p: Path) -> bool:
    """A revision of a repo in the Hugging Face hub's cache (models--org--name/snapshots/<hash>): a GGUF-only repo's
    files sit there, one level below what the scan reaches from the cache's top."""
    return p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--")


def _hf_folder_entries(folder: Path) -> list[ModelEntry]:
    """A Hugging Face folder, and the GGUF files in it (convert_hf_to_gguf.py writes them there)."""
    ggufs = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith(".") and p.is_file())
    return [entry_for(folder), *(entry_for(p) for p in ggufs)]


class RecentModels:
    """The last models opened, newest first, one entry per absolute path (links kept), at most `limit`.

    A file that cannot be read as this list is moved aside (`<name>.corrupt-<timestamp>`), one that cannot be read
    at all (no permission, a folder in its place) too (`<name>.unreadable-<timestamp>`), and an empty list is used;
    one that cannot be moved aside is left as it is and never written over. A write that fails (read-only or full
    disk) is logged and noted, never fatal."""

    def __init__(
        self, config_dir: Path, limit: int = RECENT_MAX, default_entry: Callable[[], ModelEntry] = default_model_entry
    ):
        self.path = Path(config_dir) / RECENT_FILE
        self.limit = limit
        self.default_entry = default_entry
        self.notices: list[str] = []
        self._stuck = False  # a file that could not be read nor moved aside: never written over

    def entries(self) -> list[ModelEntry]:
        out = []
        for item in self._read():
            source, when = item["source"], item.get("last_used")
            if source == DEFAULT_SOURCE:
                entry = self.default_entry()
                out.append(ModelEntry(**{**entry.to_dict(), "last_used": when}))
            elif source.startswith(REMOTE_PREFIX):  # a server's model: whether it is up is known on opening it
                label = source[len(REMOTE_PREFIX) :].split("|")[0]
                out.append(ModelEntry(source, label.rpartition("#")[2], "remote", None, True, None, when, "remote"))
            else:
                out.append(entry_for(Path(source), when))
        return out

    def add(self, source: str, now: Optional[float] = None) -> list[ModelEntry]:
        key = source_key(source)

        def added(items: list[dict]) -> list[dict]:
            kept = [i for i in items if not _same(source_key(i["source"]), key)]
            return [{"source": key, "last_used": time.time() if now is None else now}, *kept][: self.limit]

        self._update(added)
        return self.entries()

    def remove(self, source: str) -> list[ModelEntry]:
        key = source_key(source)
        self._update(lambda items: [i for i in items if not _same(source_key(i["source"]), key)])
        return self.entries()

    def clear(self) -> list[ModelEntry]:
        self._update(lambda items: [])
        return self.entries()

    def _update(self, change: Callable[[list[dict]], list[dict]]) -> None:
        """The list read, changed and written by one process at a time: two windows opening models at once each
        read it before the other wrote it, and the second write lost the first's model."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with locked_beside(self.path, "the recent models list"):
                self._write(change(self._read()))
        except OSError as exc:  # a read-only or full disk: not saved
            self._note(f"the recent models list could not be saved ({exc.strerror or exc})")

    def _read(self) -> list[dict]:
        self._stuck = False
        try:
            raw = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # none yet (a file in the config folder's place: none ever)
            return []
        except OSError as exc:  # no read permission, a folder in its place, a disk error
            # Moved aside, as a damaged file is: left in place, the next model opened wrote the list over it.
            return self._move_aside("unreadable", f"could not be read ({exc.strerror or exc})")
        try:
            data = json.loads(raw.decode("utf-8"))
            items = data["models"]
            if not isinstance(items, list) or not all(
                isinstance(i, dict)
                and isinstance(i.get("source"), str)
                and i["source"]
                and (i.get("last_used") is None or isinstance(i["last_used"], (int, float)))
                for i in items
            ):
                raise ValueError("unexpected entries")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nested too deeply
            return self._move_aside("corrupt", f"was unreadable ({exc})")
        return items[: self.limit]

    def _move_aside(self, tag: str, problem: str) -> list[dict]:
        try:
            aside = move_aside(self.path, tag)
        except OSError as err:  # left where it is, and not written over: the models in it are not lost
            self._stuck = True
            self._note(
                f"the recent models list {self.path} {problem} and could not be moved aside "
                f"({err.strerror or err}); it is left as it is and the list is not saved"
            )
            return []
        self._note(f"the recent models list {self.path} {problem}; it was kept as {aside.name} and a new one started")
        return []

    def _write(self, items: list[dict]) -> None:
        if self._stuck:
            return
        write_whole(self.path, json.dumps({"version": RECENT_VERSION, "models": items}, indent=1), mode=0o600)

    def _note(self, text: str) -> None:
        log.warning("%s", text)
        if text not in self.notices:
            self.notices.append(text)


def source_key(source: str) -> str:
    """The source as kept across runs: a local path made absolute (a relative one named a file in the folder the
    app was started from, and nothing the next time it starts elsewhere)."""
    if source == DEFAULT_SOURCE or source.startswith(REMOTE_PREFIX):
        return source
    path = user_path(source)
    if path.suffix.lower() == ".safetensors" or path.name == "config.json":
        path = path.parent  # a file of a model folder opens the folder (engine.loader): kept as the folder
    return os.path.abspath(path)  # links kept: a link's name is the model's (see loader)


def _same(a: str, b: str) -> bool:
    """Two recent-list keys name one model (on Windows whatever their letters' case)."""
    return os.path.normcase(a) == os.path.normcase(b)
