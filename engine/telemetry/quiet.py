"""Keep the profiler library's own chatter off the user's terminal.

Kineto writes lines such as "USDT:... profiler_start" and "STAGE:... Completed Stage: Warm Up" straight to file
descriptor 2 every time a profiler starts or stops, with no setting to turn them off. Around those two calls the
descriptor is pointed at a temporary file; afterwards every line that is not such chatter is written back to the
real stderr, so nothing another thread printed in those milliseconds is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

log = logging.getLogger(__name__)

CHATTER = re.compile(
    rb"^(USDT|STAGE|INFO|WARNING):\d{4}-\d\d-\d\d [^\]]*(ActivityProfiler|ProfilerHandler|Kineto|CuptiActivity|"
    rb"kineto|libkineto)[^\]]*\]|External init callback must run in same thread"
)
_LOCK = threading.Lock()


def filter_chatter(data: bytes) -> bytes:
    """The lines of `data` that are not profiler chatter."""
    keep = [line for line in data.splitlines(keepends=True) if not CHATTER.search(line)]
    return b"".join(keep)


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    with _LOCK:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # no usable fd 2 (a windowed app): nothing to filter
            yield
            return
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                rest = filter_chatter(tmp.read())
                if rest:
                    try:
                        os.write(2, rest)
                    except OSError as exc:
                        log.warning("could not pass on %d bytes of stderr: %s", len(rest), exc)
