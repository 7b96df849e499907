"""Speculative decoding: drafts proposed cheaply, verified by the target model in one forward over k+1 positions.

Drafts come from the conversation itself (n-gram prompt lookup) or from a smaller model with the same tokenizer.
The verify rule keeps the target's answer: under greedy decoding the tokens are the ones plain decoding would
make; under sampling they are distributed as plain sampling's (speculative sampling with a point-mass draft,
since both proposers draft deterministically: accept x with probability p(x), else sample p with x removed).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from engine.figures import SPECULATION_OFF
from engine.model import StaticKVCache, Transformer
from engine.observers import LoopState, StepObserver
from engine.sampling import SamplerKind, SamplerState, process
from engine.types import GenerationMetrics

NGRAM_MAX = 3  # the longest suffix matched; shorter ones are tried after it, down to one token
ADAPTIVE_KS = (1, 2, 4, 8, 15)  # draft lengths the adaptive schedule moves between (one graph each)
ADAPTIVE_START = 2  # index into ADAPTIVE_KS
# Adaptive back-off: when verify steps make fewer tokens per second than plain steps (measured), drafts pause for a
# number of steps that doubles at each further loss (up to PAUSE_MAX), so a chat with nothing to copy runs plain
# steps and only probes now and then.
PAUSE_MAX = 64
EMA = 0.3  # weight of the newest measurement in the running step times and speed ratio


class Proposer(Protocol):
    def reset(self, tokens: list[int]) -> None:
        """A new generation: `tokens` is the prompt followed by the first generated token."""

    def extend(self, tokens: list[int]) -> None:
        """Tokens accepted since the last call, in order."""

    def propose(self, k: int) -> list[int]:
        """Up to k drafts to follow the last token; [] when there is nothing worth verifying."""


class NgramProposer:
    """Prompt lookup on the host: the last n tokens (n = NGRAM_MAX down to 1) are looked up among the earlier
    n-grams of prompt + answer, and the k tokens that followed the latest match are proposed.

    An index from each n-gram to the position after its latest occurrence is kept up to date as tokens arrive,
    so a proposal costs a few dictionary look-ups whatever the length of the conversation.
    """

    def __init__(self, max_n: int = NGRAM_MAX):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.last_match = 0  # the length of the n-gram the last proposal matched

    def reset(self, tokens: list[int]) -> None:
        self.tokens = []
        self.index = [{} for _ in range(self.max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        h = self.tokens
        for t in tokens:
            # The n-grams ending at the current last token get the new token's position as their continuation.
            end = len(h)
            for n in range(1, self.max_n + 1):
                if end >= n:
                    self.index[n][tuple(h[end - n : end])] = end
            h.append(t)

    def propose(self, k: int) -> list[int]:
        h = self.tokens
        end = len(h)
        for n in range(min(self.max_n, end), 0, -1):
            start = self.index[n].get(tuple(h[end - n :]))
            if start is not None:
                self.last_match = n
                # A continuation that runs into the answer's end goes on copying its own drafts: the match says
                # the text repeats with period end - start, as in a run of one token or a repeated line.
                out: list[int] = []
                for j in range(start, start + k):
                    out.append(h[j] if j < end else out[j - end])
                return out
        return []


def ngram_propose_tensor(history: torch.Tensor, length: int, k: int, max_n: int = NGRAM_MAX) -> torch.Tensor:
    """The same look-up on the device, with no host state: history [L] long (prompt + answer, the first `length`
    valid), returns [k] drafts, -1 where there is no proposal. Kept to measure against the host look-up
    (docs/benchmarks.md, "where the look-up runs"); the engine uses NgramProposer."""
    out = torch.full((k,), -1, dtype=torch.long, device=history.device)
    h = history[:length]
    for n in range(min(max_n, length - 1), 0, -1):
        windows = h[: length - 1].unfold(0, n, 1)  # [length - n, n]: every n-gram that has a continuation
        hits = (windows == h[length - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            cont = h[start : start + k]
            out[: cont.numel()] = cont
            return out
    return out


@dataclass
class Verdict:
    """One verify step on the device: the tokens it emits, in order, and how many of them are valid."""

    tokens: torch.Tensor  # [k+1] long: positions past n_emit are not part of the answer
    n_emit: torch.Tensor  # [] long, 1..k+1
    n_accepted: torch.Tensor  # [] long, drafts accepted (0..k), before any EOS cut
    eos_hit: torch.Tensor  # [] bool: an EOS is among the emitted tokens


def verify(
    logits: torch.Tensor, drafts: torch.Tensor, kind: SamplerKind, state: SamplerState, eos: torch.Tensor
) -> Verdict:
    """logits [k+1, V] float32: the target's logits at the current token and at each of the k drafts [k].

    Greedy: accept the longest prefix of drafts equal to the target's choices; the next token is the target's
    choice after it (a correction, or the bonus token when every draft was accepted). Sampling: each draft x is
    accepted with probability p(x) under the processed distribution at its position; at the first rejection the
    token is drawn from p with x removed, after a full acceptance from the next position's p. The processors
    (repetition penalty, temperature, top-k, top-p) see at position i the drafts before i as generated tokens,
    exactly as plain decoding would have seen them. Tokens after an emitted EOS are not emitted.
    Everything stays on the device and has static shapes (one compiled or captured graph per k).
    """
    T, V = logits.shape
    k = T - 1
    seen = None
    if kind.repetition:
        drafted = F.one_hot(drafts, V).cumsum(0) > 0  # [k, V]: drafts up to and including i
        seen = state.seen[:1] | torch.cat([torch.zeros(1, V, dtype=torch.bool, device=logits.device), drafted])
    logits = process(logits, kind, state, seen=seen)
    steps = torch.arange(T, device=logits.device)
    if kind.greedy:
        choice = torch.argmax(logits, dim=-1)  # [T]
        match = drafts == choice[:k]
        n_acc = torch.cumprod(match.long(), 0).sum()
        tokens = choice
    else:
        probs = torch.softmax(logits, dim=-1)  # [T, V]
        p_draft = probs[:k].gather(1, drafts[:, None])[:, 0]
        match = torch.rand(k, device=logits.device) < p_draft
        n_acc = torch.cumprod(match.long(), 0).sum()
        residual = probs.clone()
        residual[:k].scatter_(1, drafts[:, None], 0.0)
        # The exponential race (as sampling.sample) over the unnormalised residual: the same draw as normalised.
        q = torch.empty_like(residual).exponential_()
        drawn = torch.argmax(residual / q, dim=-1)
        tokens = torch.where(steps < n_acc, torch.cat([drafts, drafts[-1:]]), drawn)
    is_eos = torch.isin(tokens, eos)
    eos_before = torch.cumsum(is_eos.long(), 0) - is_eos.long()
    valid = (steps <= n_acc) & (eos_before == 0)
    return Verdict(tokens=tokens, n_emit=valid.sum(), n_accepted=n_acc, eos_hit=(is_eos & valid).any())


@dataclass
class _Gate:
    """Whether drafts of one kind (an n-gram match of one length, or the draft model) are worth verifying."""

    pause: int = 0  # chances to draft left to skip
    backoff: int = 1  # the next pause
    speed: float = 1.0  # running tokens per second of verify steps, over plain steps'


# A verify step of k drafts against a plain step, where a seeded answer models it rather than measures it: on this
# CPU a verify step of 8-15 drafts cost 1.5-3x a plain one (docs/benchmarks.md); on a GPU less.
VERIFY_COST_PER_DRAFT = 0.1


class AdaptiveK:
    """The draft length and whether to draft at all.

    Length: one step of ADAPTIVE_KS longer after a verify step that accepted every draft, one shorter after one
    that accepted fewer than half. Whether: a verify step of k drafts costs more than a plain step (on a CPU 1.5-3x,
    measured in docs/benchmarks.md), so it pays only when it makes more tokens than its cost ratio. The host times
    both kinds of step (each ends with reading its tokens back, so the times are the device's); while the running
    ratio tokens x t_plain / t_verify stays below 1, drafts pause for a back-off that doubles at each loss. The
    ratio is kept per kind of draft (`key`: the n-gram match length), since a 3-token match is accepted far more
    often than a 1-token one. A fixed draft length (`fixed` > 0) drafts at every step that has a proposal.

    `modelled`: the step times are not measured but modelled (a plain step 1, a verify step of k drafts
    1 + VERIFY_COST_PER_DRAFT x k), so that whether a step verifies drafts, and so how a seeded answer draws its
    random numbers, does not depend on how busy the machine was: a seed gives the same text every time.
    """

    def __init__(self, fixed: int = 0, ks: tuple[int, ...] = ADAPTIVE_KS, modelled: bool = False):
        self.fixed = fixed
        self.modelled = modelled
        self.ks = ks
        self.level = min(ADAPTIVE_START, len(ks) - 1)
        self.gates: dict[int, _Gate] = {}
        self.t_plain: Optional[float] = None  # running seconds of a plain step
        self.t_verify: dict[int, float] = {}  # running seconds of a verify step, per length

    @property
    def k(self) -> int:
        return self.fixed or self.ks[self.level]

    def gate(self, key: int = 0) -> _Gate:
        return self.gates.setdefault(key, _Gate())

    def wants_drafts(self, key: int = 0) -> bool:
        if self.fixed:
            return True
        if self.t_plain is None:
            return False  # one plain step first, to know what a verify step must beat
        g = self.gate(key)
        if g.pause > 0:
            g.pause -= 1
            return False
        return True

    def plain_step(self, seconds: float) -> None:
        if self.modelled:
            seconds = 1.0
        self.t_plain = seconds if self.t_plain is None else (1 - EMA) * self.t_plain + EMA * seconds

    def verify_step(self, shape: int, drafted: int, accepted: int, emitted: int, seconds: float, key: int = 0) -> None:
        if self.modelled:
            seconds = 1.0 + VERIFY_COST_PER_DRAFT * shape
        t = self.t_verify.get(shape)
        self.t_verify[shape] = seconds if t is None else (1 - EMA) * t + EMA * seconds
        if self.fixed:
            return
        if accepted == drafted:
            self.level = min(self.level + 1, len(self.ks) - 1)
        elif 2 * accepted < drafted:
            self.level = max(self.level - 1, 0)
        if self.t_plain is None:
            return
        g = self.gate(key)
        g.speed = (1 - EMA) * g.speed + EMA * emitted * self.t_plain / self.t_verify[shape]
        if g.speed >= 1.0:
            g.backoff = 1
            return
        g.pause = g.backoff
        g.backoff = min(2 * g.backoff, PAUSE_MAX)
        g.speed = 1.0  # the next probe is judged on its own


@dataclass
class SpecCounts:
    """What speculation did in one generation: the figures of GenerationMetrics."""

    verify_steps: int = 0  # steps that verified drafts
    plain_steps: int = 0  # steps with no drafts (nothing matched, or a pause)
    # of those, the steps whose drafts the adaptive schedule held back to time a plain step first, the steps the
    # proposer had nothing for, and the steps with no room for a draft (the answer's or the cache's end)
    timing_steps: int = 0
    empty_steps: int = 0
    no_room_steps: int = 0
    paused_steps: int = 0  # steps whose drafts the adaptive schedule held back: verify steps were not paying
    drafted: int = 0  # drafts verified (real drafts, not the padding up to a graph's k)
    accepted: int = 0  # of those, accepted by the target


DRAFT_READ_CHUNK = 256  # prompt positions per forward of the draft model (engine.prefix.PREFILL_CHUNK's reason)


class DraftProposer:
    """A smaller model with the target's tokenizer drafts k tokens greedily, one forward each, on its own static
    cache. Tokens accepted since its last proposal are fed first, in one forward; drafts the target rejected stay
    in its cache past the accepted ones and are overwritten by that next forward, as in the target's cache."""

    def __init__(
        self, model: Transformer, length: int, dtype: torch.dtype, device: torch.device, vocab: Optional[int] = None
    ):
        self.model = model
        # Drafts are the target's ids: its rows where the draft's embedding is padded further (a padding row
        # drafted would only be rejected); an id the target made past the draft's rows ends drafting.
        self.vocab = min(vocab or model.args.vocab_size, model.args.vocab_size)
        self.unreadable = False  # the text holds an id the draft model has no row for
        self.length = self.length_for(model, length)
        model.cover_positions(self.length)
        self.cache = StaticKVCache.allocate(model.args, 1, self.length, dtype, device)
        self.device = device
        self.arange = torch.arange(self.length, device=device)
        self.tokens: list[int] = []
        self.filled = 0  # leading tokens whose keys and values are in the cache

    @staticmethod
    def length_for(model: Transformer, length: int) -> int:
        """The positions its cache holds for a target cache of `length`: as many, to the draft model's context."""
        return min(length, model.args.max_seq_len)

    def serves(self, model: Transformer, length: int) -> bool:
        """Whether it drafts with `model` for a target cache of `length` (and so can be kept for the next answer)."""
        return self.model is model and self.length == self.length_for(model, length)

    def reset(self, tokens: list[int]) -> None:
        """A new answer's prompt. The cache's keys and values of the prefix it shares with what was read before
        are kept (causal: a position's depend only on the tokens up to it), so a chat's next answer reads only
        what is new: it read the whole conversation again, in one forward, every answer."""
        same = 0
        for a, b in zip(self.tokens[: self.filled], tokens):
            if a != b:
                break
            same += 1
        self.tokens = list(tokens)
        self.filled = min(same, len(tokens) - 1)  # at least one token is read, for the first draft's logits
        self.unreadable = any(t >= self.model.args.vocab_size for t in tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.unreadable = self.unreadable or any(t >= self.model.args.vocab_size for t in tokens)

    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        positions = self.arange[start : start + len(ids)]
        self.cache.attn_len = start + len(ids)
        mask = self.arange[: start + len(ids)][None, :] <= positions[:, None]
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(x, positions, self.cache, mask)

    def _next(self, ids: list[int], start: int) -> int:
        # a long prompt is read in chunks, as the target reads it: one forward of it all held every position's
        # activations at once
        while len(ids) > DRAFT_READ_CHUNK:
            self._forward(ids[:DRAFT_READ_CHUNK], start)
            ids, start = ids[DRAFT_READ_CHUNK:], start + DRAFT_READ_CHUNK
        return int(self._forward(ids, start)[0, -1, : self.vocab].argmax())

    @property
    def why_none(self) -> Optional[str]:
        """Why it drafts nothing more in this answer, where the reason is its own; None where it still drafts."""
        if self.unreadable:
            return "the text holds a token the draft model has no row for"
        if len(self.tokens) >= self.length:
            return f"the conversation is longer than the draft model's context of {self.length:,} tokens"
        return None

    def propose(self, k: int) -> list[int]:
        n = len(self.tokens)
        k = min(k, self.length - n)
        if k < 1 or self.unreadable:
            return []
        drafts = [self._next(self.tokens[self.filled :], self.filled)]
        self.filled = n
        for i in range(1, k):
            drafts.append(self._next(drafts[-1:], n + i - 1))
        return drafts


SPECULATION_FIGURES = ("drafted_tokens", "accepted_tokens", "verify_steps", "paused_steps", "acceptance_rate")


def speculation_off(metrics: GenerationMetrics, why: str = "") -> None:
    """The speculation figures of an answer that ran without it: off in its options, or asked for and not run
    (`why`: the reason its options' `unavailable` entry gives, a refused draft model, several candidates)."""
    for name in SPECULATION_FIGURES:
        metrics.mark_na(name, f"{SPECULATION_OFF}: {why}" if why else SPECULATION_OFF)


class Speculator(StepObserver):
    """Speculation for one generation: asks the proposer for drafts, picks the verify step's length, runs it (or a
    plain step when there is nothing to verify) and keeps the counts. As the loop's observer it gives the proposer
    the prompt and every step's tokens, and fills the speculation figures."""

    def __init__(
        self,
        proposer: Proposer,
        draft_tokens: int,
        shapes: Optional[tuple[int, ...]] = None,
        source: str = "",
        reproducible: bool = False,
    ):
        self.proposer = proposer
        self.source = source  # for the figures: what drafted and how k was chosen
        self.schedule = AdaptiveK(draft_tokens, modelled=reproducible)
        self.shapes = shapes  # verify lengths with a compiled or captured step; None: eager, any length
        self.counts = SpecCounts()
        # The last step's (drafts, accepted, emitted) where it verified drafts, else None: an EOS or a stop string
        # inside its accepted drafts ends the answer there, and the drafts after that are no part of it.
        self.last: Optional[tuple[int, int, int]] = None

    def start(self, tokens: list[int]) -> None:
        self.proposer.reset(tokens)

    def accepted(self, tokens: list[int]) -> None:
        self.proposer.extend(tokens)

    def on_step(self, run: LoopState) -> None:
        if run.step == 0:  # the host reads every step's tokens: the next drafts follow from them
            self.start(run.prompt.tolist() + run.rows[0].tokens)
        elif run.fresh is not None:
            self.accepted(run.fresh)

    def kept_counts(self, run: LoopState) -> tuple[int, int]:
        """(drafted, accepted) over the answer as kept: where it ended inside the last step's accepted drafts (an
        EOS drafted, a stop string completed), the drafts past its end count neither as drafted nor accepted."""
        c = self.counts
        if self.last is None or not run.rows:
            return c.drafted, c.accepted
        drafts, accepted, emitted = self.last
        tokens = len(run.rows[0].tokens)
        kept = tokens - bisect.bisect_left(run.token_step, run.step, hi=tokens)  # the last step's tokens kept
        if kept >= emitted and accepted < emitted:
            return c.drafted, c.accepted  # it ended on the target's own choice: every draft was judged
        return c.drafted - drafts + min(drafts, kept), c.accepted - accepted + min(accepted, kept)

    def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
        c = self.counts
        drafted, accepted = self.kept_counts(run)
        for name, value in zip(SPECULATION_FIGURES, (drafted, accepted, c.verify_steps, c.paused_steps)):
            metrics.put(name, value, self.source)
        if drafted:
            metrics.put("acceptance_rate", accepted / drafted, self.source)
        else:
            why = getattr(self.proposer, "why_none", None) or self.why_undrafted()
            metrics.mark_na("acceptance_rate", f"nothing was drafted in this answer ({why})")

    def why_undrafted(self) -> str:
        """Why no step of the answer verified drafts, where the proposer gives no reason of its own."""
        c = self.counts
        if c.empty_steps:
            return "no proposal"
        if c.timing_steps:
            return (
                "the adaptive draft length runs a plain step first, to time what a verify step must beat, "
                "and the answer ended after it"
            )
        return "the answer ended before a step had room for a draft"

    def step(self, runner, remaining: int) -> list[int]:
        """One decode step of `runner` (a StaticRunner) with `remaining` tokens still wanted; returns the tokens it
        wrote to the runner's output (read back, so its time is the device's)."""
        room = runner.verify_room()
        k = min(self.schedule.k, remaining - 1, room)
        t0 = time.perf_counter()  # a verify step's time includes its drafting: a draft model's k forwards
        timing = self.schedule.t_plain is None and not self.schedule.fixed  # a plain step is timed first
        held = False  # drafts the schedule held back (timing, or a pause)
        if isinstance(self.proposer, NgramProposer):  # the schedule's gate is the match's length, known after it
            drafts = self.proposer.propose(k) if k >= 1 else []
            key = self.proposer.last_match
            if drafts and not self.schedule.wants_drafts(key):
                drafts, held = [], True
        else:  # a draft model: asked only for a step that will verify (a paused step ran its k forwards for nothing)
            key = 0
            held = k >= 1 and not self.schedule.wants_drafts(key)
            drafts = self.proposer.propose(k) if k >= 1 and not held else []
        start = runner.host_pos - runner.prompt_len + 1  # tokens written so far (the runner's counter, known here)
        if not drafts:
            runner.step(0)
            tokens = runner.out[0, start : start + 1].tolist()
            self.schedule.plain_step(time.perf_counter() - t0)
            self.counts.plain_steps += 1
            if k < 1:
                self.counts.no_room_steps += 1
            elif held and timing:
                self.counts.timing_steps += 1
            elif held:
                self.counts.paused_steps += 1
            else:
                self.counts.empty_steps += 1
            self.last = None
            return tokens
        shape = len(drafts)
        if self.shapes:  # the shortest step compiled for this many drafts, if the cache has room for it
            shape = next((s for s in self.shapes if s >= len(drafts) and s <= room), len(drafts))
        emitted, accepted = runner.speculate(drafts, shape)
        tokens = runner.out[0, start : start + emitted].tolist()
        self.schedule.verify_step(shape, len(drafts), accepted, emitted, time.perf_counter() - t0, key)
        self.counts.verify_steps += 1
        self.counts.drafted += len(drafts)
        self.counts.accepted += accepted
        self.last = (len(drafts), accepted, emitted)
        return tokens


def vocabulary_mismatch(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> Optional[str]:
    """Why a draft model cannot draft for the target (their token ids mean different things), or None. The
    tokenizers decide; the embeddings' rows may differ where both cover every id the target makes (a model's
    rows are padded past its tokenizer: Qwen2.5-0.5B has 151,936 for Qwen2.5-7B's 152,064, the same tokenizer)."""
    a, b = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(a) != len(b):
        return (
            f"the draft model's vocabulary has {len(b)} entries and the target's {len(a)}: "
            "drafts must use the target's token ids"
        )
    if a != b:
        differing = sum(1 for tok, i in a.items() if b.get(tok) != i) + sum(1 for tok in b if tok not in a)
        return f"the draft model's tokenizer differs from the target's ({differing} tokens map to other ids)"
    needed = min(target_vocab, max(a.values(), default=-1) + 1)  # the ids the target's tokens take
    if draft_vocab < needed:
        return f"the draft model has {draft_vocab} token rows; the target's tokens take {needed}"
    return None
