"""What the user typed and has not sent, one draft per chat: kept as they switch between chats (the one composer
carried the draft of one chat into the next, where Enter sent it) and across a restart (a long message typed,
then the app closed, was lost without a word).

The drafts are a small JSON file beside the settings ({"version": 1, "drafts": {"12": "text", "new": "text"}}),
written whole (engine.paths.write_whole) as a chat is left and as the window closes. Two windows on one data
folder each write only the drafts they changed: the file is read again first, under a lock, so one window never
undoes the other's; a chat's draft is read again as it is opened, and one a window still shows that another took
from the file (sent or cleared there) is written back when the first leaves it or closes. A file that cannot be
read or used is started over (a draft is not worth refusing to start for), the old one kept beside it as
drafts.json.unreadable-<time> at the first save; one that cannot be written is said once, and the drafts stay in
memory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from app.store import move_aside
from engine.paths import locked_beside, write_whole

log = logging.getLogger(__name__)

DRAFTS_FILE = "drafts.json"
DRAFTS_VERSION = 1
NEW_CHAT = "new"  # the key of the chat not made yet
MAX_DRAFTS = 200  # the most kept: the oldest written go first


def _key(chat_id: Optional[int]) -> str:
    return NEW_CHAT if chat_id is None else str(chat_id)


class Drafts:
    def __init__(self, path: Optional[Path] = None):
        """`path`: the file they are kept in; None keeps them in memory only."""
        self.path = path
        self._texts: dict[str, str] = self._read() or {}
        self._changed: set[str] = set()
        # drafts put again as they were: written back where another window took them from the file (it sent or
        # cleared the same draft, the new chat's most often) while this one still shows them
        self._kept: set[str] = set()
        self.problem = ""  # why the last write failed, "" where it did not

    def get(self, chat_id: Optional[int]) -> str:
        """The draft of `chat_id` as the file has it now, unless this window changed it since its last save or
        still shows it (put as it was: written back at the next save): a draft another window sent or cleared
        came back as this window's stale copy, and was written back. A file that cannot be read now (another
        window replacing it, on Windows) takes nothing away."""
        key = _key(chat_id)
        if self.path is not None and key not in self._changed and key not in self._kept:
            on_file = self._read()
            if on_file is not None and key not in on_file:
                self._texts.pop(key, None)
            elif on_file is not None:
                self._texts[key] = on_file[key]
        return self._texts.get(key, "")

    def put(self, chat_id: Optional[int], text: str) -> None:
        """Keep `text` as the draft of `chat_id` (None: the new chat); only white space forgets it."""
        key = _key(chat_id)
        if text.strip():
            if self._texts.get(key) == text:
                self._kept.add(key)
                return
            self._texts.pop(key, None)  # the newest last: the oldest go first past MAX_DRAFTS
            self._texts[key] = text
        elif key in self._texts:
            del self._texts[key]
        else:
            return
        self._changed.add(key)

    def keep_only(self, chat_ids: set[int]) -> None:
        """Forget the drafts of chats that are gone (deleted here, in another window or from the command line): a
        chat made later may get the same id."""
        for key in [k for k in self._texts if k != NEW_CHAT and (not k.isdigit() or int(k) not in chat_ids)]:
            del self._texts[key]
            self._changed.add(key)

    def save(self) -> str:
        """Write the drafts changed since the last save; "" when written (or nothing to write), else why not."""
        if self.path is None or not (self._changed or self._kept):
            return ""
        kept, self._kept = self._kept, set()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # read, merged and written by one window at a time: two windows closing at once (a logout) each read
            # the file before the other wrote it, and the second write lost the first's drafts
            with locked_beside(self.path, "the unsent messages"):
                merged = self._read()
                if merged is None:  # kept beside, not written over: a newer version's drafts, a hand edit
                    aside = move_aside(self.path, "unreadable")
                    log.warning("the unsent messages file %s was kept as %s and a new one started", self.path, aside)
                    merged = {}
                self._changed |= {key for key in kept if key in self._texts and key not in merged}
                if not self._changed:
                    return ""
                for key in self._changed:
                    merged.pop(key, None)
                for key, text in self._texts.items():  # in the order written, the newest last
                    if key in self._changed:
                        merged[key] = text
                while len(merged) > MAX_DRAFTS:
                    del merged[next(iter(merged))]
                text = json.dumps({"version": DRAFTS_VERSION, "drafts": merged})  # ASCII: any text, a lone surrogate
                write_whole(self.path, text, mode=0o600)
        except OSError as exc:
            self._kept |= kept  # written back at the next save that can
            problem = f"cannot keep the unsent messages in {self.path}: {exc.strerror or exc}"
            if problem != self.problem:
                log.warning("%s", problem)
            self.problem = problem
            return problem
        self.problem = ""
        self._changed.clear()
        return ""

    def _read(self) -> Optional[dict[str, str]]:
        """The drafts in the file ({} where there is none); None where it cannot be read or used."""
        if self.path is None:
            return {}
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("the unsent messages in %s cannot be read (%s); starting without them", self.path, exc)
            return None
        drafts = doc.get("drafts") if isinstance(doc, dict) and doc.get("version") == DRAFTS_VERSION else None
        if not isinstance(drafts, dict):
            log.warning("the unsent messages in %s are not in a form this version reads; starting without", self.path)
            return None
        return {k: v for k, v in drafts.items() if isinstance(k, str) and isinstance(v, str) and v.strip()}
