"""Options that each change the decode path, together: greedy answers stay those of the plain path."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.types import EngineOptions, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, seed=0)
REPEATING = [{"role": "user", "content": "hello world hello world hello world"}]


def _answers(path, options, turns):
    eng = Engine.load(str(path), options)
    try:
        out, messages = [], []
        for text in turns:
            messages = messages + [{"role": "user", "content": text}]
            result = eng.generate(messages, GREEDY)
            out.append(result.token_ids[0])
            messages = messages + [{"role": "assistant", "content": result.texts[0]}]
        return out, result
    finally:
        eng.close()


@pytest.mark.parametrize("speculation", ["ngram"])
def test_speculation_on_a_reused_prefix_gives_the_plain_answers(tiny_llama, speculation):
    turns = ["hello world hello world hello world", "hello world hello world hello world", "and again: hello world"]
    plain, _ = _answers(tiny_llama, EngineOptions(device="cpu", prefix_reuse=False), turns)
    both, last = _answers(tiny_llama, EngineOptions(device="cpu", prefix_reuse=True, speculation=speculation), turns)
    assert both == plain
    assert last.metrics.prompt_reused_tokens and last.metrics.prompt_reused_tokens > 0  # the prefix was reused
    assert last.options.speculation == speculation
    # as much is reused as without speculation: every token a verify step accepted is in the cache (it remembered
    # one a step, and the next turn read again what it held)
    _, reused = _answers(tiny_llama, EngineOptions(device="cpu", prefix_reuse=True), turns)
    assert last.metrics.prompt_reused_tokens == reused.metrics.prompt_reused_tokens
    assert last.metrics.tokens_per_step and last.metrics.tokens_per_step > 1  # drafts were accepted
