"""Sampling on the device against transformers' logits processors, and the exponential-race draw against the
distribution it should follow."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.sampling import SamplerKind, SamplerState, mark_seen, process, sample
from engine.types import SamplingParams

V = 64


def hf_processed(logits: torch.Tensor, seen: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' processors, in generate()'s order, row by row (each row's own tokens seen)."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.temperature > 0:
        procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
    rows = []
    for row, mask in zip(logits, seen):
        ids = mask.nonzero().flatten()[None, :]
        rows.append(procs(ids, row[None, :].clone())[0])
    return torch.stack(rows)


def ours(logits: torch.Tensor, seen: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    state = SamplerState(logits.shape[0], logits.shape[1], torch.device("cpu"))
    state.set_params(p)
    state.seen.copy_(seen)
    return process(logits.clone(), SamplerKind.of(p), state)


PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=tp, repetition_penalty=rp)
    for t, k, tp, rp in itertools.product((0.0, 0.7, 1.5), (0, 1, 5, 200), (1.0, 0.9, 0.3), (1.0, 1.3, 0.8))
]


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-r{p.repetition_penalty}")
def test_processors_equal_transformers(p):
    g = torch.Generator().manual_seed(hash((p.temperature, p.top_k, p.top_p, p.repetition_penalty)) % 2**31)
    logits = torch.randn(8, V, generator=g) * 3  # no ties: where tokens tie at the cut, see the test below
    logits[1, : V // 2] = -logits[1, : V // 2].abs()  # negative logits, which the penalty multiplies
    seen = torch.rand(8, V, generator=g) < 0.2
    seen[:, 0] = True  # every row has seen something
    want, got = hf_processed(logits, seen, p), ours(logits, seen, p)
    if p.temperature == 0:  # greedy: only the penalty changes the logits, and the choice is their argmax
        want = hf_processed(logits, seen, SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty))
    removed_w, removed_g = torch.isinf(want), torch.isinf(got)
    assert torch.equal(removed_w, removed_g), (removed_w != removed_g).nonzero().tolist()
    torch.testing.assert_close(got[~removed_g], want[~removed_w], rtol=1e-6, atol=1e-6)
    assert (~removed_g).any(dim=-1).all()  # at least one token always stays


@pytest.mark.parametrize("k", [V, 5_000_000, 2**63, 10**30])
def test_a_top_k_past_the_vocabulary_keeps_every_token(k):
    """Any k at or over the vocabulary's size is top-k off (a chat saved with k up to 2**31 - 1 by an earlier
    dialog keeps its settings); past an int64 (2**63) it was an internal error: "value cannot be converted to type
    int64_t without overflow"."""
    g = torch.Generator().manual_seed(3)
    logits, seen = torch.randn(4, V, generator=g), torch.zeros(4, V, dtype=torch.bool)
    off = ours(logits, seen, SamplingParams(temperature=0.7, top_p=0.9))
    assert torch.equal(ours(logits, seen, SamplingParams(temperature=0.7, top_k=k, top_p=0.9).validate()), off)


def test_tokens_tied_at_the_cut_stay_together():
    """transformers cuts a tie by the order its sort happens to leave; here every token whose logit equals the
    last one kept stays, whatever the order, so the result does not depend on the sort."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0, 1.0]])
    for p in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7)):
        got = ours(logits, torch.zeros(1, 6, dtype=torch.bool), p)
        assert torch.isinf(got).tolist() == [[False, False, False, False, True, False]], p
    flat = ours(torch.zeros(1, 6), torch.zeros(1, 6, dtype=torch.bool), SamplingParams(temperature=1.0, top_p=0.1))
    assert not torch.isinf(flat).any()


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=1e-300),  # 0 in float32
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-300),
        SamplingParams(temperature=0.7, top_k=5, top_p=1e-45),
    ],
    ids=lambda p: f"t{p.temperature}-p{p.top_p}",
)
def test_a_temperature_or_top_p_too_small_for_float32_picks_the_most_likely_token(p):
    """Both are valid settings whose float32 value is 0 or nearly: they mean "the most likely token", not a draw
    from numbers that are not numbers (which picked token 0, a special token, every time)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, V, generator=g) * 3
    state = SamplerState(16, V, torch.device("cpu"))
    state.set_params(p)
    kind = SamplerKind.of(p)
    assert torch.isfinite(process(logits.clone(), kind, state).max(dim=-1).values).all()
    for _ in range(5):
        assert torch.equal(sample(logits.clone(), kind, state), logits.argmax(dim=-1))


def test_greedy_picks_the_argmax_after_the_penalty():
    logits = torch.tensor([[4.0, 3.9, -1.0, 0.5]])
    state = SamplerState(1, 4, torch.device("cpu"))
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    state.set_params(p)
    assert sample(logits, SamplerKind.of(p), state).tolist() == [0]
    mark_seen(state, torch.tensor([0]))
    assert sample(logits, SamplerKind.of(p), state).tolist() == [1]  # 4.0 / 1.5 < 3.9


def test_the_draw_follows_the_processed_distribution():
    """Many rows of the same logits, one draw each: the frequencies match softmax of the processed logits, and a
    token the filters removed is never drawn."""
    n = 40_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.2, 0.0, -1.0, -3.0, -6.0])
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, seed=0)
    state = SamplerState(n, base.numel(), torch.device("cpu"))
    state.set_params(p)
    kind = SamplerKind.of(p)
    logits = base.expand(n, -1).clone()
    expected = torch.softmax(process(logits[:1].clone(), kind, state), dim=-1)[0]
    assert expected[-2:].tolist() == [0.0, 0.0] and expected[3] > 0  # top-k and top-p removed the tail
    torch.manual_seed(0)
    drawn = sample(logits, kind, state)
    freq = torch.bincount(drawn, minlength=base.numel()).double() / n
    assert freq[expected == 0].sum().item() == 0.0
    # binomial standard error is below 0.0025 here; 0.01 is four of them
    assert (freq - expected.double()).abs().max().item() < 0.01, (freq.tolist(), expected.tolist())
