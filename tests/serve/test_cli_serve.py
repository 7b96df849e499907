"""`gapless serve` as a process: it refuses to listen beyond loopback without a key, says a taken port in one
line, serves a tiny model on a free port, and stops on SIGINT; and on the default model (slow) the served greedy
text is Engine.generate's, also through the remote engine."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from engine.remote import RemoteEngine, RemoteSource
from engine.types import EngineOptions, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def gapless_process(*args: str, **env_extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.Popen(
        [sys.executable, "-m", "app", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def test_other_than_loopback_needs_an_api_key(tiny_llama):
    p = gapless_process("serve", "--model", str(tiny_llama), "--host", "0.0.0.0", "--port", "0")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2
    assert err.strip().splitlines()[-1].startswith("gapless: error: refusing to listen on 0.0.0.0 without an API key")


@pytest.mark.parametrize(
    "origin, words",
    [
        ("*", "--cors-origin '*' lets every web page use the model: it needs an API key (--api-key KEY or"),
        ("http://localhost:3000/", "is not an origin as a browser sends it"),
        ("localhost:3000", "is not an origin as a browser sends it"),
    ],
)
def test_an_origin_no_browser_sends_or_every_page_without_a_key_is_refused(tiny_llama, origin, words):
    p = gapless_process("serve", "--model", str(tiny_llama), "--port", "0", "--cors-origin", origin)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and words in err.strip().splitlines()[-1]


def test_check_origins_takes_what_browsers_send():
    from app.server.run import ServeError, check_origins

    check_origins(("http://localhost:3000", "https://app.example", "http://[::1]:8080"), None)
    # a browser extension's and a desktop app's pages send their own schemes (refused, they could not be allowed)
    check_origins(("chrome-extension://abcdefghijklmnop", "moz-extension://1f0e-42", "app://obsidian.md"), None)
    check_origins(("*",), "sk-key")  # any page, where pages cannot know the key
    with pytest.raises(ServeError, match="no path or trailing slash"):
        check_origins(("https://app.example/chat",), "sk-key")


def test_a_taken_port_is_one_line(tiny_llama):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        p = gapless_process("serve", "--model", str(tiny_llama), "--port", str(taken.getsockname()[1]))
        _, err = p.communicate(timeout=120)
    finally:
        taken.close()
    assert p.returncode == 2
    assert "cannot listen on 127.0.0.1:" in err and "Traceback" not in err


@pytest.mark.parametrize("key_in", ["flag", "environment"])
def test_serve_answers_and_stops_on_sigint(tiny_llama, key_in):
    """The key on the command line, or in GAPLESS_SERVE_API_KEY (out of the process list)."""
    flag = ["--api-key", "k1"] if key_in == "flag" else []
    env = {} if key_in == "flag" else {"GAPLESS_SERVE_API_KEY": "k1"}
    p = gapless_process(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        "0",
        "--device",
        "cpu",
        "--kv",
        "dynamic",
        *flag,
        "--served-model-name",
        "tiny",
        **env,
    )
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"serving tiny at (http://127\.0\.0\.1:\d+/v1) \(API key required\)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said where it listens"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key="k1", max_retries=0)
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
        )
        assert r.usage.completion_tokens >= 1 and r.model == "tiny"
        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert p.returncode in (0, 130)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        p.stderr.close()
        p.stdout.close()


@pytest.mark.slow
def test_default_model_served_greedy_text_is_the_engine_s(default_model_path):
    from serving import load_engine, serving

    engine = load_engine(default_model_path)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    try:
        want = engine.generate(messages, SamplingParams(temperature=0.0, max_new_tokens=32))
        with serving(engine) as server:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            r = client.chat.completions.create(
                model=server.engines.model_id, messages=messages, max_tokens=32, temperature=0
            )
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=server.engines.model_id, messages=messages, max_tokens=32, temperature=0, stream=True
                )
                if c.choices
            )
            remote = RemoteEngine.load(RemoteSource(server.url, server.engines.model_id))
            try:
                via_remote = remote.generate(messages, SamplingParams(temperature=0.0, max_new_tokens=32))
            finally:
                remote.close()
        assert via_remote.texts == want.texts and via_remote.metrics.new_tokens_total == len(want.token_ids[0])
        assert r.choices[0].message.content == want.texts[0] == streamed
        assert "Paris" in want.texts[0]
        assert r.usage.completion_tokens == len(want.token_ids[0])
        assert engine.options == EngineOptions(device="cpu")
    finally:
        engine.close()
