"""A real torch.compile of the decode step on a tiny model (CPU): compiled speculation gives the eager greedy
tokens, and one compile of the step serves every context bucket and runner length of a conversation."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.types import EngineOptions, Progress, SamplingParams

CPU = EngineOptions(device="cpu")
COMPILED = CPU.with_(kv_cache="static", compile=True)
REPEATS = [
    {
        "role": "user",
        "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
        "the quick brown fox jumps over the lazy dog.",
    }
]


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def engine(tiny_factory):
    eng = Engine.load(str(tiny_factory("llama", max_position_embeddings=2048)), CPU)
    yield eng
    eng.close()


@pytest.mark.slow
def test_compiled_speculation_gives_the_eager_greedy_tokens(engine):
    sampling = SamplingParams(temperature=0, max_new_tokens=300)  # crosses the 256-position bucket
    engine.reconfigure(CPU)
    want = engine.generate(REPEATS, sampling)
    engine.reconfigure(COMPILED.with_(speculation="ngram", draft_tokens=4))
    got = engine.generate(REPEATS, sampling)
    assert got.options.compile and got.options.speculation == "ngram", got.unavailable
    assert got.metrics.verify_steps > 0 and got.metrics.accepted_tokens > 0
    assert got.token_ids == want.token_ids


@pytest.mark.slow
def test_one_compile_serves_every_bucket_of_a_conversation(engine):
    engine.reconfigure(COMPILED)
    short = SamplingParams(temperature=0, max_new_tokens=20)
    first = engine.generate(REPEATS, short)
    assert first.options.compile, first.unavailable
    after_first = graphs_compiled()
    assert after_first > 0
    follow_up = [
        *REPEATS,
        {"role": "assistant", "content": first.texts[0]},
        {"role": "user", "content": "Again, twice."},
    ]
    longer = SamplingParams(temperature=0, max_new_tokens=400)  # a longer runner, buckets 256 to 1024
    events: list = []
    got = engine.generate(follow_up, longer, on_event=events.append)
    warmed = [e.message for e in events if isinstance(e, Progress) and e.stage == "compile"]
    assert any("context 512" in m for m in warmed) and any("context 1024" in m for m in warmed), warmed
    assert graphs_compiled() == after_first  # no second compile of the step, for any bucket or runner length
    engine.reconfigure(CPU)
    want = engine.generate(follow_up, longer)
    assert got.token_ids == want.token_ids


def test_the_warm_up_covers_the_bucket_a_padded_verify_step_reaches():
    from types import SimpleNamespace

    from engine.decode import StaticRunner

    runner = SimpleNamespace(length=1024)
    assert StaticRunner.buckets_for(runner, 200, 50) == [256]  # type: ignore[arg-type]
    # 15 drafts verified from the last wanted position attend past 256: that bucket is warmed before the answer
    assert StaticRunner.buckets_for(runner, 200, 50, slack=15) == [256, 512]  # type: ignore[arg-type]
    assert StaticRunner.buckets_for(runner, 1000, 20, slack=15) == [1024]  # type: ignore[arg-type]
