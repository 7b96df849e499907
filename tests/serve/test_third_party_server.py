"""The remote engine against a real third-party OpenAI-compatible server: llama.cpp's, as llama-cpp-python[server]
ships it, on the default GGUF over loopback.

llama-cpp-python has no prebuilt wheel for Linux on PyPI; pip builds llama.cpp from source, which takes about an
hour on two cores, so CI does not install it and these tests skip there with that reason. To run them, point
GAPLESS_LLAMA_CPP_PYTHON at a Python that has `llama-cpp-python[server]` (or install it into this one).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.errors import ModelLoadError
from engine.remote import REMOTE_REASON, RemoteEngine, RemoteSource
from engine.types import EngineOptions, SamplingParams, TextDelta

pytestmark = pytest.mark.slow

ALIAS = "smollm2"
QUESTION = [{"role": "user", "content": "Name three colours of a rainbow, one per line."}]


def _llama_cpp_python() -> str:
    """A Python that can run `python -m llama_cpp.server`, or a skip that says how to get one."""
    given = os.environ.get("GAPLESS_LLAMA_CPP_PYTHON")
    candidates = [given] if given else [sys.executable]
    for python in candidates:
        probe = subprocess.run([python, "-c", "import llama_cpp.server.app"], capture_output=True, timeout=120)
        if probe.returncode == 0:
            return python
        if given:
            pytest.fail(f"GAPLESS_LLAMA_CPP_PYTHON={given} cannot import llama_cpp.server: {probe.stderr[-400:]!r}")
    pytest.skip(
        "llama-cpp-python[server] is not installed: it has no prebuilt Linux wheel and builds llama.cpp from "
        "source (about an hour on 2 cores); set GAPLESS_LLAMA_CPP_PYTHON to a Python that has it"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(default_model_path: Path, tmp_path_factory) -> Iterator[str]:
    python = _llama_cpp_python()
    port = _free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [python, "-m", "llama_cpp.server", "--model", str(default_model_path), "--model_alias", ALIAS]
            + ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300  # a model load on a loaded 2-core machine
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama.cpp's server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama.cpp's server did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def remote(llama_server: str) -> Iterator[RemoteEngine]:
    engine = RemoteEngine.load(RemoteSource(llama_server, ALIAS, 300.0), EngineOptions())
    yield engine
    engine.close()


def test_an_unknown_model_is_refused_with_what_the_server_serves(llama_server):
    with pytest.raises(ModelLoadError, match=f"has no model 'nope'; it serves: {ALIAS}"):
        RemoteEngine.load(RemoteSource(llama_server, "nope", 60.0))


def test_streamed_answer_with_client_side_figures_and_usage(remote, llama_server):
    deltas: list[TextDelta] = []
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    r = remote.generate(QUESTION, sampling, on_event=deltas.append)
    text = r.texts[0]
    assert text.strip() and "".join(d.text for d in deltas if isinstance(d, TextDelta)) == text
    assert r.finish_reasons[0] in ("eos", "length")
    # The same request without streaming, straight to the server: greedy, so the same text.
    plain = httpx.post(
        f"{llama_server}/chat/completions",
        json={"model": ALIAS, "messages": QUESTION, "max_tokens": 24, "temperature": 0.0, "seed": 0},
        timeout=300,
    ).json()
    assert plain["choices"][0]["message"]["content"] == text
    m = r.metrics
    usage = plain["usage"]
    if m.new_tokens_total is not None:  # counts come from the stream's usage where the server sends it
        assert m.new_tokens_total == usage["completion_tokens"] and m.prompt_tokens == usage["prompt_tokens"]
    else:
        assert "the server reported no token usage" in m.unavailable.values()
    ttft = m.figure("http_ttft_ms")
    assert ttft.value > 0 and ttft.source == "client-side timing over HTTP"
    for key in ("gpu_util_pct", "kernel_gap_pct", "ttft_ms", "peak_memory_bytes"):
        assert REMOTE_REASON in (m.figure(key).reason or ""), key
    assert m.figure("server_running_requests").reason == "the server has no vLLM /metrics endpoint"


def test_stop_strings_and_a_stop_mid_answer_keep_what_came(remote):
    full = remote.generate(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=24)).texts[0]
    cut = full.strip()[3:5]
    r = remote.generate(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=24, stop=(cut,)))
    assert r.texts == [full[: full.find(cut)]] and r.finish_reasons == ["stop"]

    cancel = threading.Event()
    seen: list[str] = []

    def on_event(e) -> None:
        if isinstance(e, TextDelta):
            seen.append(e.text)
            cancel.set()

    r = remote.generate(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=64), on_event=on_event, cancel=cancel)
    assert r.finish_reasons == ["cancelled"] and seen and r.texts[0].startswith(seen[0])
    assert full.startswith(r.texts[0])
