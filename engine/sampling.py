"""Choosing the next token on the device, with no host sync.

The same function serves both sampling modes: "host" then calls .item() on its result every token, "device"
leaves it in a device buffer. So the two modes differ only in the sync, which is what the HUD should show.
Order of the logits processors follows transformers' generate(): repetition penalty, temperature, top-k, top-p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.types import GREEDY_BELOW, TOP_K_LIMIT, SamplingParams


@dataclass(frozen=True)
class SamplerKind:
    """Which processors run. Python flags (not device values) so a compiled or captured step has no branches."""

    greedy: bool
    top_k: bool
    top_p: bool
    repetition: bool

    @classmethod
    def of(cls, p: SamplingParams) -> "SamplerKind":
        greedy = p.temperature < GREEDY_BELOW
        return cls(
            greedy=greedy,
            top_k=not greedy and p.top_k > 0,
            top_p=not greedy and p.top_p < 1.0,
            repetition=p.repetition_penalty != 1.0,
        )


class SamplerState:
    """Sampling parameters as device tensors, plus per-row state (tokens seen, for the repetition penalty)."""

    def __init__(self, batch: int, vocab: int, device: torch.device):
        self.temperature = torch.ones(1, device=device)
        self.top_k = torch.zeros(1, dtype=torch.long, device=device)
        self.top_p = torch.ones(1, device=device)
        self.penalty = torch.ones(1, device=device)
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # [B, V]

    def set_params(self, p: SamplingParams) -> None:
        self.temperature.fill_(p.temperature if p.temperature >= GREEDY_BELOW else 1.0)
        self.top_k.fill_(min(max(p.top_k, 1), TOP_K_LIMIT))  # past every vocabulary; 2**63 overflowed the int64
        self.top_p.fill_(p.top_p)
        self.penalty.fill_(p.repetition_penalty)

    def reset_seen(self, prompt_ids: torch.Tensor) -> None:
        """prompt_ids: [T] long on the device. Every row starts having seen the prompt."""
        self.seen.zero_()
        self.seen[:, prompt_ids] = True


def mark_seen(state: SamplerState, tokens: torch.Tensor) -> None:
    """tokens: [B] long."""
    state.seen.scatter_(1, tokens[:, None], True)


def process(
    logits: torch.Tensor, kind: SamplerKind, state: SamplerState, seen: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The logits processors, in transformers' order: [B, V] -> [B, V], removed tokens at -inf. Greedy stops after
    the repetition penalty (temperature and filters do not change the argmax). `seen` [B, V] replaces the
    state's tokens seen (speculative verify: each position has seen the drafts before it)."""
    if kind.repetition:
        penalised = torch.where(logits > 0, logits / state.penalty, logits * state.penalty)
        logits = torch.where(state.seen if seen is None else seen, penalised, logits)
    if kind.greedy:
        return logits
    logits = logits / state.temperature
    if kind.top_k or kind.top_p:
        sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
        if kind.top_k:
            k = state.top_k.clamp(max=logits.shape[-1])
            kth = sorted_logits.gather(-1, (k - 1).expand(logits.shape[0], 1))  # [B, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if kind.top_p:
            probs = torch.softmax(sorted_logits, dim=-1)
            cum = probs.cumsum(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = (cum - probs) < state.top_p
            cutoff = torch.where(keep, sorted_logits, torch.full_like(sorted_logits, float("inf"))).amin(
                -1, keepdim=True
            )
            # a top_p that float32 holds as 0 keeps nothing above: the most likely token stays all the same
            cutoff = torch.minimum(cutoff, sorted_logits[:, :1])
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return logits


def sample(logits: torch.Tensor, kind: SamplerKind, state: SamplerState) -> torch.Tensor:
    """logits: [B, V] float32 -> next tokens [B] long, on the device."""
    logits = process(logits, kind, state)
    if kind.greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # A categorical draw with no host sync: argmax(p / q), q ~ Exponential(1) (the exponential race).
    # The default generator, seeded per generation: it is what CUDA graphs capture safely and compile traces.
    q = torch.empty_like(probs).exponential_()
    return torch.argmax(probs / q, dim=-1)
