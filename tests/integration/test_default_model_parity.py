"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF), CPU, fp32, greedy, 32 tokens: every kv_cache x
sampling combination, and the compiled static + device path, give exactly transformers generate()'s tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import greedy_continuation

from engine.engine import Engine
from engine.fallback import build_hf_model
from engine.prompt import build_prompt
from engine.types import EngineOptions, SamplingParams

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
N = 32


@pytest.fixture(scope="module")
def engine(default_model_path):
    eng = Engine.load(str(default_model_path), EngineOptions(device="cpu"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine):
    """transformers generate() on the same checkpoint and prompt (min_new_tokens keeps the count equal)."""
    ids = build_prompt(engine.tokenizer, MESSAGES, engine.context_length, N).ids
    weights = engine.checkpoint.weights(
        torch.float32, torch.device("cpu")
    )  # re-read from the GGUF: the engine holds none
    model = build_hf_model(engine.config, weights, torch.float32, torch.device("cpu"))
    return greedy_continuation(model, ids, N, engine.eos_ids[0])


def test_default_model_identity(engine):
    info = engine.info
    assert info.family == "llama" and info.backend == "fast"
    assert 130_000_000 < info.parameters < 140_000_000
    assert info.context_length == 8192


@pytest.mark.parametrize("kv", ["static", "dynamic", "none"])
@pytest.mark.parametrize("sampling", ["device", "host"])
def test_every_cache_and_sampling_mode_matches_transformers(engine, reference, kv, sampling):
    engine.reconfigure(EngineOptions(device="cpu", kv_cache=kv, sampling=sampling))
    got = engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=N)).token_ids[0]
    assert got == reference[: len(got)]
    assert len(got) == N or got[-1] in engine.eos_ids


def test_compiled_static_device_path_matches_transformers(engine, reference):
    engine.reconfigure(EngineOptions(device="cpu", kv_cache="static", sampling="device", compile=True))
    result = engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=N))
    assert result.options.compile is True
    got = result.token_ids[0]
    assert got == reference[: len(got)]
    engine.reconfigure(EngineOptions(device="cpu"))
