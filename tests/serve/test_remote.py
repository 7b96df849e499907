"""The remote engine against `gapless serve` on loopback: the same text as the engine called directly, figures
measured over HTTP with their sources, GPU figures n/a with the reason, options reported unavailable; bad
addresses, models and keys are one clear error."""

from __future__ import annotations

import json

import pytest
from cli_runner import gapless
from serving import load_engine, serving

from app.server.http import ServeConfig
from engine import figures
from engine.errors import ModelLoadError, OptionsError
from engine.remote import REMOTE_REASON, RemoteEngine, RemoteSource, is_remote
from engine.types import EngineOptions, MonitorSample, SamplingParams, TextDelta

HELLO = [{"role": "user", "content": "hello world"}]
KEY = "sk-remote-test"


@pytest.fixture(scope="module")
def local(tiny_llama):
    engine = load_engine(tiny_llama)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(local):
    with serving(local, config=ServeConfig(api_key=KEY)) as srv:
        yield srv


@pytest.fixture
def remote(server):
    engine = RemoteEngine.load(RemoteSource(server.url, server.engines.model_id), EngineOptions(), api_key=KEY)
    yield engine
    engine.close()


def test_sources_round_trip_and_bad_ones_are_refused():
    src = RemoteSource("http://10.0.0.5:8000/v1/", "llama3:8b", 12.5)
    assert is_remote(src.to_source()) and src.to_source() == "remote:http://10.0.0.5:8000/v1#llama3:8b|timeout=12.5"
    back = RemoteSource.parse(src.to_source())
    assert (back.base_url, back.model, back.timeout_s) == ("http://10.0.0.5:8000/v1", "llama3:8b", 12.5)
    assert RemoteSource.parse("remote:http://h/v1#m").timeout_s == 60.0
    for bad in (
        "remote:ftp://h/v1#m",
        "remote:http://h/v1",
        "remote:http://h/v1#",
        "remote:http://h/v1#m|timeout=x",
        "remote:http://h/v1#m|timeout=0",
        "remote:http://h/v1#m|speed=3",
        "remote:http://[::1/v1#m",  # not a URL: urlsplit raises
        "remote:http://h:port/v1#m",
    ):
        with pytest.raises(OptionsError):
            RemoteSource.parse(bad)
    # a password in the address would stay in plain text in the recent models and the settings
    with pytest.raises(OptionsError, match="may not hold a user name or password") as info:
        RemoteSource.parse("remote:http://me:hunter2@h/v1#m")
    assert "hunter2" not in str(info.value)


def test_a_host_name_that_is_not_a_valid_international_one_is_refused_with_why():
    """http://xn--a/v1 passed, and opening it ended in "internal error: InvalidCodepoint: Codepoint U+0080 ..."."""
    from engine.types import remote_address_problem

    for bad, why in (("http://xn--a/v1", "Codepoint U+0080"), ("http://b\u00fccher..de/v1", "Empty Label")):
        problem = remote_address_problem(bad)
        assert problem is not None and problem.startswith("a remote server's address has a host name that is not")
        assert why in problem
    for good in ("http://b\u00fccher.de/v1", "http://xn--bcher-kva.de/v1", "http://my_box:8000/v1", "http://[::1]/v1"):
        assert remote_address_problem(good) is None, good


@pytest.mark.parametrize("key", ["sk-é123", "sk a", "sk\x7f"])
def test_a_key_that_cannot_be_sent_is_refused_without_quoting_it(key):
    with pytest.raises(OptionsError, match="printable ASCII") as info:
        RemoteEngine(RemoteSource("http://127.0.0.1:9/v1", "m"), EngineOptions(), api_key=key)
    assert key not in str(info.value)


def test_a_key_pasted_with_a_newline_is_sent_without_it(server):
    engine = RemoteEngine.load(RemoteSource(server.url, server.engines.model_id), api_key=f" {KEY}\n")
    engine.close()


def test_a_missing_v1_is_suggested(server):
    root = server.url.removesuffix("/v1")
    with pytest.raises(ModelLoadError, match=f"answered HTTP 404 to GET /models: .*try {root}/v1"):
        RemoteEngine.load(RemoteSource(root, server.engines.model_id), api_key=KEY)


@pytest.mark.parametrize("tail", ["/chat/completions", "/models", "/completions"])
def test_an_endpoint_pasted_whole_is_answered_with_its_base_url(server, tail):
    """It was told to add /v1 at its end: try http://host/v1/chat/completions/v1."""
    with pytest.raises(ModelLoadError, match=f"answered HTTP 404 .*: try {server.url}\\)$"):
        RemoteEngine.load(RemoteSource(server.url + tail, server.engines.model_id), api_key=KEY)


def test_remote_text_is_the_local_engine_s(remote, local, server):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    events: list = []
    got = remote.generate(HELLO, sampling, on_event=events.append)
    want = local.generate(HELLO, sampling)
    assert got.texts == want.texts
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas) == want.texts[0]
    assert got.finish_reasons == [{"eos": "eos", "length": "length"}[want.finish_reasons[0]]]
    m = got.metrics
    assert m.prompt_tokens == want.metrics.prompt_tokens
    assert m.new_tokens_total == len(want.token_ids[0])
    raw = remote.generate(
        [{"role": "user", "content": "the quick"}], SamplingParams(temperature=0.0, max_new_tokens=6), raw=True
    )
    assert (
        raw.texts
        == local.generate(
            [{"role": "user", "content": "the quick"}], SamplingParams(temperature=0.0, max_new_tokens=6), raw=True
        ).texts
    )


def test_figures_over_http_with_their_sources_and_gpu_figures_na(remote):
    r = remote.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=24))
    m = r.metrics
    ttft = m.figure("http_ttft_ms")
    assert ttft.value > 0 and ttft.source == "client-side timing over HTTP"
    for key in ("inter_token_ms_p50", "inter_token_ms_p99", "http_decode_tok_s"):  # text comes in ~30 Hz batches
        f = m.figure(key)
        assert (
            f.value is not None and f.source == "client-side timing over HTTP"
        ) or f.reason == "too few text chunks arrived to time", key
    for key in ("gpu_util_pct", "kernel_gap_pct", "sm_activity_pct", "ttft_ms", "decode_tok_s", "peak_memory_bytes"):
        f = m.figure(key)
        assert f.value is None and REMOTE_REASON in f.reason, key
    server_ttft = m.figure("server_ttft_ms")  # gapless serve's own figure, from x_gapless
    assert server_ttft.value > 0 and server_ttft.source.startswith("gapless serve: engine timing")
    for key in ("server_running_requests", "server_kv_cache_pct"):
        assert m.figure(key).reason == "the server has no vLLM /metrics endpoint"
    assert all(getattr(m, s.key) is not None or s.key in m.unavailable for s in figures.GENERATION_FIGURES)


def test_a_remote_answer_tells_the_hud_why_its_monitor_series_are_empty(remote):
    """The HUD's CPU and memory plots said "no monitor samples yet" after a remote answer, as if one were coming."""
    from ui.hud.series import SAMPLE_SERIES, LiveSeries

    events: list = []
    r = remote.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=4), on_event=events.append)
    samples = [e for e in events if isinstance(e, MonitorSample)]
    assert len(samples) == 1 and events.index(samples[0]) == 0
    assert set(samples[0].unavailable) == {f.key for f in figures.SAMPLE_FIGURES}
    series = LiveSeries()
    series.begin_generation("remote", r.options, samples[0].t)
    series.add_samples(samples)
    series.end_generation(samples[0].t + 1.0, r.metrics)
    for key in SAMPLE_SERIES:
        assert not series.measured(key) and series.reasons[key].startswith(REMOTE_REASON), key


def test_a_remote_answer_says_its_options_are_the_server_s(remote):
    """Its options were the app's defaults, shown in the HUD, the compare table and the stats line as if the
    server ran "static KV · device sampling · eager"."""
    from engine.diagnosis import diagnose
    from engine.types import describe_options, server_decides
    from ui.stats import options_label

    remote.reconfigure(EngineOptions(candidates=2))
    r = remote.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert server_decides(r.options) and r.options.candidates == 2
    assert describe_options(r.options, device=True) == "remote · set by the server · 2 candidates"
    assert options_label(r.options.to_dict()) == "remote server"
    assert EngineOptions.from_dict(r.options.to_dict()) == r.options  # stored and read back as it is
    d = diagnose(r.metrics.to_dict(), r.options.to_dict())
    assert d.line == "a remote server's answer: what limits it is measured there, not here" and d.next_step is None


def test_options_other_than_candidates_are_unavailable_with_the_reason(remote):
    assert remote.unavailable() == {}  # the defaults stand for the server's own settings
    asked = EngineOptions(
        device="cuda",
        dtype="fp16",
        kv_cache="dynamic",
        compile=True,
        cuda_graph=True,
        candidates=3,
        profile_window=False,
    )
    na = remote.unavailable(asked)
    assert set(na) == {"device", "dtype", "kv_cache", "compile", "cuda_graph", "profile_window"}
    assert all(why.startswith(REMOTE_REASON) for why in na.values())
    remote.reconfigure(asked)
    assert remote.effective(asked)[1] == na and remote.unavailable() == na
    info = remote.info
    assert (
        info.backend == "remote" and info.source_kind == "remote" and info.source.startswith("remote:http://127.0.0.1")
    )


def test_candidates_go_as_n(remote, local):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=9)
    remote.reconfigure(EngineOptions(candidates=2))
    got = remote.generate(HELLO, sampling)
    local.reconfigure(EngineOptions(device="cpu", candidates=2))
    try:
        want = local.generate(HELLO, sampling)
    finally:
        local.reconfigure(EngineOptions(device="cpu"))
    assert got.texts == want.texts and len(got.texts) == 2
    assert got.metrics.new_tokens_total == sum(len(t) for t in want.token_ids)


def test_stop_and_seed_pass_through(remote, local):
    greedy = local.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=24)).texts[0]
    stop = greedy[5:7]
    r = remote.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=24, stop=(stop,)))
    assert r.texts == [greedy[: greedy.find(stop)]] and r.finish_reasons == ["stop"]
    a, b = (remote.generate(HELLO, SamplingParams(temperature=1.0, max_new_tokens=12, seed=21)).texts for _ in "ab")
    assert a == b


def test_top_k_and_repetition_penalty_reach_a_gapless_server(remote, local):
    """OpenAI's API has no top-k or repetition penalty; Gapless's server takes them as vLLM's does, so the app's
    settings apply and the answer is the local engine's with them."""
    without = local.generate(HELLO, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)).texts
    for top_k, penalty in ((40, 1.1), (2, 5.0)):
        sampling = SamplingParams(temperature=1.0, top_k=top_k, repetition_penalty=penalty, max_new_tokens=8, seed=3)
        got = remote.generate(HELLO, sampling)
        assert not [n for n in got.notices if "not applied" in n]
        assert got.texts == local.generate(HELLO, sampling).texts
    assert got.texts != without  # the settings changed the answer, so it is they that reached the server


def test_a_wrong_key_unknown_model_or_dead_server_is_one_clear_error(server):
    with pytest.raises(ModelLoadError, match="refused the API key"):
        RemoteEngine.load(RemoteSource(server.url, server.engines.model_id), api_key="sk-wrong")
    with pytest.raises(ModelLoadError, match=r"has no model 'nope'; it serves: "):
        RemoteEngine.load(RemoteSource(server.url, "nope"), api_key=KEY)
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ModelLoadError, match=f"cannot reach the remote server at http://127.0.0.1:{port}/v1"):
        RemoteEngine.load(RemoteSource(f"http://127.0.0.1:{port}/v1", "m", 5.0))


def test_the_key_is_never_logged(server, caplog):
    caplog.set_level("DEBUG")
    for name in ("httpx", "httpcore"):  # the app quiets them (app.logs); here they say all they would
        caplog.set_level("DEBUG", logger=name)
    engine = RemoteEngine.load(RemoteSource(server.url, server.engines.model_id), api_key=KEY)
    try:
        engine.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=4))
    finally:
        engine.close()
    assert any(r.name.startswith("httpx") for r in caplog.records)  # the requests were logged, the key not
    assert not any(KEY in r.getMessage() for r in caplog.records)


def test_the_app_opens_a_remote_source_with_the_stored_key(server, local, use_file_keys):
    from app.engines import load_engine as open_source
    from app.keys import KeyStore
    from app.paths import AppPaths

    KeyStore(AppPaths.resolve().config).set(server.url, KEY)
    source = RemoteSource(server.url, server.engines.model_id, 30.0).to_source()
    engine = open_source(source, EngineOptions())
    try:
        assert isinstance(engine, RemoteEngine) and engine.source.timeout_s == 30.0
        got = engine.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=8)).texts
    finally:
        engine.close()
        KeyStore(AppPaths.resolve().config).set(server.url, None)
    assert got == local.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=8)).texts


@pytest.fixture
def use_file_keys(monkeypatch):
    import app.engines
    import app.keys

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    monkeypatch.setattr(app.engines, "keys_dir", None)


def _generate_through(server, *before: str, extra_env: dict[str, str]):
    """`gapless [BEFORE] generate --json` of "hello world" (8 tokens) on the server's model, as a remote."""
    source = RemoteSource(server.url, server.engines.model_id).to_source()
    return gapless(
        *before,
        "generate",
        "--model",
        source,
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "8",
        "--json",
        extra_env=extra_env,
    )


def test_generate_on_the_command_line_through_a_remote(server, local):
    r = _generate_through(server, extra_env={"GAPLESS_REMOTE_API_KEY": KEY})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["texts"] == local.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=8)).texts
    assert out["model"]["backend"] == "remote" and KEY not in r.stdout + r.stderr
    assert out["metrics"]["http_ttft_ms"] > 0
    # what the server does not say is null with the reason, never a made-up 0
    model = out["model"]
    assert model["parameters"] is None and model["weight_bytes"] is None
    assert "does not say" in model["unavailable"]["parameters"]
    assert "does not say" in model["unavailable"]["weight_bytes"]
    assert model["context_length"] == local.context_length and "context_length" not in model["unavailable"]


def test_the_command_line_sends_the_key_saved_in_its_data_folder(server, local, tmp_path):
    """`--data-dir D` read the saved keys of the default data folder (none sent: "refused the API key")."""
    from app.keys import KeyStore
    from app.paths import AppPaths

    data = tmp_path / "data"
    KeyStore(AppPaths.resolve(str(data)).config, use_keyring=False).set(server.url, KEY)
    r = _generate_through(
        server,
        "--data-dir",
        str(data),
        extra_env={"GAPLESS_REMOTE_API_KEY": "", "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"},
    )
    assert r.returncode == 0, r.stderr
    assert (
        json.loads(r.stdout)["texts"] == local.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=8)).texts
    )


@pytest.mark.parametrize("saved_first", [True, False])
def test_the_app_sends_the_key_saved_for_the_server_before_the_variable(
    server, tmp_path, monkeypatch, use_file_keys, saved_first
):
    """In the app the key typed in the Remote dialog for that server wins over $GAPLESS_REMOTE_API_KEY (it was
    overridden by it: HTTP 401 with the right key saved); on the command line the variable, given for the run,
    comes first."""
    import app.engines
    from app.keys import KeyStore

    monkeypatch.setattr(app.engines, "keys_dir", tmp_path)
    monkeypatch.setattr(app.engines, "saved_key_first", saved_first)
    monkeypatch.setenv("GAPLESS_REMOTE_API_KEY", "a-key-for-another-server")
    KeyStore(tmp_path).set(server.url, KEY)
    source = RemoteSource(server.url, server.engines.model_id).to_source()
    if saved_first:
        app.engines.load_engine(source, EngineOptions()).close()
    else:
        with pytest.raises(ModelLoadError, match="refused the API key"):
            app.engines.load_engine(source, EngineOptions())


def test_gapless_serve_can_front_a_remote_model(server, local):
    """A Gapless server whose model is itself remote (e.g. the app serving the remote model it chats with)."""
    import openai

    remote = RemoteEngine.load(RemoteSource(server.url, server.engines.model_id), api_key=KEY)
    try:
        with serving(remote) as front:
            client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)
            r = client.chat.completions.create(
                model=front.engines.model_id, messages=HELLO, max_tokens=8, temperature=0
            )
            with pytest.raises(openai.BadRequestError, match="give max_tokens"):
                client.chat.completions.create(model=front.engines.model_id, messages=HELLO)
            sampled = client.chat.completions.create(
                model=front.engines.model_id,
                messages=HELLO,
                max_tokens=8,
                seed=3,
                extra_body={"top_k": 2, "repetition_penalty": 5.0},  # passed on: the server behind is Gapless
            )
            # the server behind refuses a request as the client's mistake: passed on as that, not as a 500 that
            # the openai client retries (by default twice: three refusals for one question)
            failed = server.engines.stats.failed
            with pytest.raises(openai.BadRequestError) as info:
                openai.OpenAI(base_url=front.url, api_key="unused").chat.completions.create(
                    model=front.engines.model_id, messages=HELLO, max_tokens=1_000_000
                )
            assert server.engines.stats.failed == failed + 1
            err = info.value.body
            assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
            assert "the remote server refused the request (HTTP 400)" in err["message"]
    finally:
        remote.close()
    assert (
        r.choices[0].message.content
        == local.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=8)).texts[0]
    )
    want = SamplingParams(temperature=1.0, top_k=2, repetition_penalty=5.0, max_new_tokens=8, seed=3)
    assert sampled.choices[0].message.content == local.generate(HELLO, want).texts[0]
