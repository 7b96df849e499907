"""The engine takes one request at a time: the others wait first come first served, past the bound they get
503 with Retry-After, and a client that goes away (queued, waiting, or mid-stream) cancels its generation."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from serving import HeldEngine, load_engine, request_body, serving, wait_until

import engine.observers as engine_observers
from app.server.engine_queue import EngineQueue, Failed, Finished, Job, ShuttingDown, model_key
from app.server.protocol import parse_request
from app.server.run import BackgroundServer


@pytest.fixture
def held(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_observers, "FLUSH_INTERVAL_S", 0.0)  # text from the first token: held while it runs
    engine = load_engine(tiny_llama)
    yield HeldEngine(engine)
    engine.close()


def test_past_the_queue_bound_is_503_with_retry_after(held):
    with serving(held, max_waiting=1) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(**request_body(server, max_tokens=6, seed=1), stream=True)
        assert held.reached.wait(60)  # the first request holds the engine
        second: dict = {}
        waiter = threading.Thread(
            target=lambda: second.update(
                r=client.chat.completions.create(
                    **request_body(server, "the quick brown fox", max_tokens=5, temperature=0)
                )
            )
        )
        waiter.start()
        assert wait_until(lambda: server.engines.stats.waiting == 1)
        r = httpx.post(f"{server.url}/chat/completions", json=request_body(server, max_tokens=2), timeout=60)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full" and "busy" in r.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=server.engines.model_id, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        held.release.set()
        text = "".join(c.choices[0].delta.content or "" for c in first if c.choices)
        waiter.join(120)
        assert text == held.results[0].texts[0]
        assert second["r"].choices[0].message.content == held.results[1].texts[0]
        stats = server.engines.stats
        assert (stats.served, stats.rejected, stats.waiting, stats.running) == (2, 2, 0, 0)


def test_a_client_hears_its_outcome_only_once_the_counts_have_it(tiny_llama):
    """What a client sees in the stats after its answer arrived: its request counted, none running."""
    engine = load_engine(tiny_llama)
    engines = EngineQueue(engine)
    seen: list = []
    done = threading.Event()

    def sink(event) -> None:
        if isinstance(event, (Finished, Failed)):
            st = engines.stats
            seen.append((type(event).__name__, st.served, st.failed, st.running, st.waiting))
            done.set()

    try:
        fits = {"model": engines.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        too_long = {**fits, "messages": [{"role": "user", "content": "hi " * engine.context_length}]}
        for body in (fits, too_long):  # answered; refused by the engine (the prompt does not fit its context)
            request = parse_request(body, chat=True, model_id=engines.model_id)
            done.clear()
            engines.submit(Job(request, sink))
            assert done.wait(60)
    finally:
        engines.close()
        engine.close()
    assert seen == [("Finished", 1, 0, 0, 0), ("Failed", 1, 1, 0, 0)]


def _ask_hi(engines: EngineQueue) -> tuple[list, threading.Event]:
    """Submit a short chat request; its outcome (Finished or Failed) lands in the list, and the event is set."""
    outcomes: list = []
    done = threading.Event()

    def sink(event) -> None:
        if isinstance(event, (Finished, Failed)):
            outcomes.append(event)
            done.set()

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    engines.submit(Job(parse_request(body, chat=True, model_id="m"), sink))
    return outcomes, done


def test_a_request_waiting_for_the_apps_own_answer_counts_as_waiting_not_running(tiny_llama):
    """In the app the engine's thread may be busy with the user's own answer when the queue hands it a request:
    until the engine takes it, the request waits (the Server panel said "1 running" for it), and the time it
    spent so does not count as a job's running time."""
    engine = load_engine(tiny_llama)
    free = threading.Event()  # until set, the user's own answer holds the engine's thread
    handed = threading.Event()

    def run_on_engine(fn) -> None:
        handed.set()
        assert free.wait(60)
        fn(engine)

    engines = EngineQueue(None, run_on_engine=run_on_engine, model_id="m", engine_key=model_key(engine.info))
    try:
        outcomes, done = _ask_hi(engines)
        assert handed.wait(60)
        st = engines.stats
        assert (st.running, st.waiting) == (0, 1)
        free.set()
        assert done.wait(60)
        assert [type(o) for o in outcomes] == [Finished] and (st.served, st.running, st.waiting) == (1, 0, 0)
    finally:
        engines.close()
        engine.close()


def test_a_request_ended_before_the_engine_took_it_frees_its_waiting_place():
    def run_on_engine(fn) -> None:  # the app's runner when its server stops before the engine took the request
        raise ShuttingDown("stopping")

    engines = EngineQueue(None, run_on_engine=run_on_engine, model_id="m", engine_key=None)
    try:
        outcomes, done = _ask_hi(engines)
        assert done.wait(60)
        st = engines.stats
        assert [o.error.code for o in outcomes] == ["shutting_down"]
        assert (st.cancelled, st.running, st.waiting) == (1, 0, 0)
    finally:
        engines.close()


def test_a_stream_closed_by_the_client_cancels_its_generation(held):
    # seed 5 runs past 220 tokens without an end-of-sequence, so the cancel lands mid-answer
    with serving(held) as server:
        with httpx.stream(
            "POST",
            f"{server.url}/chat/completions",
            timeout=60,
            json=request_body(server, max_tokens=220, seed=5, stream=True),
        ) as r:
            assert r.status_code == 200
            assert held.reached.wait(60)
        assert held.cancel is not None and held.cancel.wait(60)  # set by the server on the disconnect
        held.release.set()
        assert wait_until(lambda: server.engines.stats.cancelled == 1)
        result = held.results[0]
        assert result.finish_reasons == ["cancelled"] and len(result.token_ids[0]) < 220
        assert server.engines.stats.served == 0


def _raw_post(url: str, payload: dict) -> socket.socket:
    parts = urlsplit(url)
    data = json.dumps(payload).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        f"POST {parts.path}/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_a_client_gone_before_the_whole_answer_cancels_it(held):
    with serving(held) as server:
        sock = _raw_post(server.url, request_body(server, max_tokens=220, seed=5))
        assert held.reached.wait(60)
        sock.close()
        assert held.cancel is not None and held.cancel.wait(60)
        held.release.set()
        assert wait_until(lambda: server.engines.stats.cancelled == 1)
        assert held.results[0].finish_reasons == ["cancelled"]


def test_a_client_gone_while_queued_never_reaches_the_engine(held):
    with serving(held) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(**request_body(server, max_tokens=4, seed=1), stream=True)
        assert held.reached.wait(60)
        sock = _raw_post(server.url, request_body(server, max_tokens=50))
        assert wait_until(lambda: server.engines.stats.waiting == 1)
        queued = list(server.engines._jobs.queue)[0]
        sock.close()
        assert queued.cancel.wait(60)  # seen while the request waits
        # its place is free at once, counted as cancelled, before the engine is free
        assert wait_until(lambda: server.engines.stats.waiting == 0)
        assert server.engines.stats.cancelled == 1 and queued.state == "withdrawn"
        third: dict = {}
        t = threading.Thread(
            target=lambda: third.update(
                r=client.chat.completions.create(**request_body(server, max_tokens=3, temperature=0))
            )
        )
        t.start()
        assert wait_until(lambda: server.engines.stats.waiting == 1)
        held.release.set()
        list(first)
        t.join(120)
        assert third["r"].usage.completion_tokens >= 1
        assert len(held.results) == 2  # the first and the third: the second was skipped
        assert server.engines.stats.cancelled == 1 and server.engines.stats.served == 2


def test_a_client_gone_while_queued_frees_its_place_in_a_full_queue(held):
    """With room for one waiting request, a client that gave up waiting leaves the room to the next one."""
    with serving(held, max_waiting=1) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(**request_body(server, max_tokens=4, seed=1), stream=True)
        assert held.reached.wait(60)
        with pytest.raises(httpx.TimeoutException):  # a client that gives up after 1 s
            httpx.post(f"{server.url}/chat/completions", json=request_body(server, max_tokens=3), timeout=1.0)
        assert wait_until(lambda: server.engines.stats.waiting == 0)
        later: dict = {}
        t = threading.Thread(
            target=lambda: later.update(
                r=httpx.post(
                    f"{server.url}/chat/completions", json=request_body(server, max_tokens=3, seed=2), timeout=120
                )
            )
        )
        t.start()
        assert wait_until(lambda: server.engines.stats.waiting == 1)
        held.release.set()
        list(first)
        t.join(120)
        assert later["r"].status_code == 200, later["r"].text
        stats = server.engines.stats
        assert (stats.served, stats.cancelled, stats.rejected, stats.waiting) == (2, 1, 0, 0)
        assert len(held.results) == 2


def test_stopping_the_server_answers_the_requests_in_flight_at_once(held):
    """Stopping (the app's Stop, or Ctrl-C on `gapless serve`) ends the running generation and the queued ones with
    a 503 saying so, instead of letting them run on until the HTTP server's graceful shutdown cuts them."""
    engines = EngineQueue(held)
    server = BackgroundServer(engines)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    outcomes: dict = {}

    def stream() -> None:
        body = request_body(server, max_tokens=220, seed=5, stream=True)
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120) as r:
            outcomes["stream"] = [line for line in r.iter_lines() if line]

    def queued() -> None:
        try:
            client.chat.completions.create(**request_body(server, max_tokens=3))
        except openai.APIStatusError as exc:
            outcomes["queued"] = exc

    threads = [threading.Thread(target=stream), threading.Thread(target=queued)]
    threads[0].start()
    try:
        assert held.reached.wait(60)
        threads[1].start()
        assert wait_until(lambda: engines.stats.waiting == 1)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        assert held.cancel is not None and held.cancel.wait(60)  # the running generation was told to stop
        held.release.set()
        for t in threads:
            t.join(60)
        stopper.join(60)
    finally:
        held.release.set()
        engines.close()
    last = json.loads(outcomes["stream"][-2][6:])
    assert outcomes["stream"][-1] == "data: [DONE]" and last["error"]["code"] == "shutting_down"
    assert held.results[0].finish_reasons == ["cancelled"] and len(held.results) == 1
    exc = outcomes["queued"]
    assert exc.status_code == 503 and exc.code == "shutting_down"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/models", timeout=5)


def test_requests_for_many_n_keep_the_kv_caches_of_the_last_two_only(tiny_llama):
    """Each n is a batch of its own, with a KV cache of its own: one was kept for every n a client ever asked for,
    so clients asking for n = 1, 2, 3, ... filled the server's memory (the default model at its full context:
    360 MB more per candidate, never given back)."""
    import gc
    import weakref

    engine = load_engine(tiny_llama)
    runners: list = []
    try:
        with serving(engine) as server:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            for n in (1, 2, 3, 4, 5, 1):
                r = client.chat.completions.create(**request_body(server, max_tokens=3, n=n, seed=1))
                assert len(r.choices) == n
                runners += [weakref.ref(runner) for runner in engine._runners.values()]
            gc.collect()
            alive = {id(runner()) for runner in runners if runner() is not None}
            assert len(alive) == 2  # n=5's and n=1's: those of n=2, 3 and 4 were given back
            again = client.chat.completions.create(**request_body(server, max_tokens=3, n=3, seed=1))
            assert len(again.choices) == 3  # a batch whose cache went is made again
    finally:
        engine.close()
