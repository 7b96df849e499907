"""The load script end to end on a tiny model with a short queue (slow: it starts a server process): every
request completes with its own prompt's answer or gets a 503, none is lost."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_every_request_completes_or_is_refused_and_none_is_mixed(tiny_llama):
    from serve_load import run

    report = run(str(tiny_llama), requests=24, concurrency=6, max_tokens=12, max_queue=1)
    assert report["lost"] == 0 and report["mixed"] == 0
    assert report["completed"] + report["rejected_503"] == 24 and report["completed"] >= 1
    assert report["ttft_ms_p50"] is not None and report["rss_after_bytes"] > 0
