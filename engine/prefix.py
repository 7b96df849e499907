"""Prefix reuse and chunked prefill: the prompt positions a runner's KV cache already holds are not computed again.

After a generation, a runner's cache holds, row by row, the keys and values of the prompt and of every token fed
back during decoding (all but the last token of each answer). `PrefixCache` remembers those token ids per runner;
the next prompt's longest common token prefix with one row (the longest match: with candidates, the row of the
one the conversation continued from) is taken from the cache, and only the rest is computed. Positions past the
common prefix are overwritten by the prefill and the decode steps before anything reads them (attention reads
at most the positions written for this generation), so nothing left there is trusted.

The prefill computes the positions past the reused prefix in chunks of at most `chunk` tokens, each attending
to everything before it, so a long prompt's attention scores and activations are bounded by the chunk; between
chunks it reports progress and honours a cancel. A cancel there raises PrefillCancelled, before any token exists.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from engine.decode import DynamicRunner, RunnerBase, StaticRunner
from engine.errors import GaplessError
from engine.model import DynamicKVCache
from engine.sampling import SamplerKind

PREFILL_CHUNK = 256  # prompt positions per prefill chunk: bounds a long prompt's activations, paces its progress
SOURCE = "longest common token prefix with the last generation's KV cache"


class PrefillCancelled(GaplessError):
    """The user stopped the answer while the prompt was being read (between two chunks)."""

    def __init__(self, done: int, total: int, message: Optional[str] = None):
        super().__init__(message or f"stopped while reading the conversation ({done:,} of {total:,} tokens read)")
        self.done, self.total = done, total
        self.reused = 0  # of the positions read, those that came from the cache (set by the engine)
        self.compile_seconds: Optional[float] = (
            None  # the warm-up before the prefill, where one ran (set by the engine)
        )


@dataclass(frozen=True)
class Plan:
    start: int  # prompt positions [0, start) come from the cache
    row: int  # the cache row they come from
    source: str  # where the figure comes from, or why nothing is reused
    # the prompt's last logits, where the whole prompt is the last generation's (a Regenerate): nothing is computed
    logits: Optional[torch.Tensor] = None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _hf_croppable(cache) -> bool:
    """Whether a transformers cache can be cut back: a sliding-window layer past its window keeps no past states
    to return to (unless it records them)."""
    for layer in getattr(cache, "layers", ()):
        window = getattr(layer, "sliding_window", None)
        if getattr(layer, "is_sliding", False) and window and not getattr(layer, "record_past", False):
            if layer.get_seq_length() >= window:
                return False
    return True


def _hf_runner(runner: RunnerBase) -> bool:
    return type(runner).__name__ == "HFRunner"  # engine.fallback imports transformers; not imported for a check


def supports(runner: RunnerBase) -> Optional[str]:
    """None if the runner's cache can be reused, else why not."""
    if isinstance(runner, (StaticRunner, DynamicRunner)):
        return None
    if _hf_runner(runner) and getattr(runner, "kv", None) == "dynamic":
        return None
    return "no KV cache to reuse (kv_cache none)"


class PrefixCache:
    """What each runner's cache holds, per row: the token ids of its positions, in order."""

    def __init__(self) -> None:
        self._rows: "weakref.WeakKeyDictionary[RunnerBase, list[list[int]]]" = weakref.WeakKeyDictionary()
        # the last generation's prompt length and the logits of its last position, per runner
        self._first: "weakref.WeakKeyDictionary[RunnerBase, tuple[int, torch.Tensor]]" = weakref.WeakKeyDictionary()

    def plan(self, runner: RunnerBase, prompt: list[int], enabled: bool) -> Plan:
        if not enabled:
            return Plan(0, 0, "prefix reuse is off")
        why = supports(runner)
        if why:
            return Plan(0, 0, why)
        rows = self._rows.get(runner)
        if not rows:
            return Plan(0, 0, f"{SOURCE}: none (no earlier generation in this cache)")
        best, row = max((common_prefix(prompt, r), i) for i, r in enumerate(rows))
        first = self._first.get(runner)
        if best >= len(prompt) and first is not None and first[0] == len(prompt) and not _hf_runner(runner):
            # The last generation's prompt again (a Regenerate): its positions and its last logits are reused, and
            # nothing is computed. Computed again, the last position came out otherwise than in the prompt's first
            # reading wherever a kernel's rounding depends on how many positions one call computes (int8 and int4
            # linears, bf16 attention): a greedy Regenerate then gave another answer.
            return Plan(len(prompt), row, f"{SOURCE} (the whole prompt, and its last logits)", first[1])
        best = min(best, len(prompt) - 1)  # else the last prompt token is run: its logits give the first token
        if best <= 0:
            return Plan(0, 0, f"{SOURCE}: none in common")
        if best < len(rows[row]) and _hf_runner(runner) and not _hf_croppable(getattr(runner, "cache", None)):
            # a regenerate or an edit past a sliding window (Gemma 2, Phi-3 on the fallback) failed with crop's error
            return Plan(0, 0, f"{SOURCE}: none (a sliding-window cache past its window cannot be cut back)")
        return Plan(best, row, f"{SOURCE} (row {row})" if len(rows) > 1 else SOURCE)

    def forget(self, runner: RunnerBase) -> None:
        self._rows.pop(runner, None)
        self._first.pop(runner, None)

    def clear(self) -> None:
        self._rows.clear()
        self._first.clear()

    def carry(self, old: RunnerBase, new: RunnerBase) -> None:
        """A runner replaced by a longer one of the same kind and batch takes over the old one's cache."""
        rows = self._rows.pop(old, None)
        first = self._first.pop(old, None)
        if rows is None or type(old) is not type(new) or old.batch != new.batch:
            return
        if isinstance(old, StaticRunner) and isinstance(new, StaticRunner):
            n = min(old.cache.length, new.cache.length)
            for ko, vo, kn, vn in zip(old.cache.k, old.cache.v, new.cache.k, new.cache.v):
                kn[:, :, :n].copy_(ko[:, :, :n])
                vn[:, :, :n].copy_(vo[:, :, :n])
            rows = [r[:n] for r in rows]
        elif isinstance(old, DynamicRunner) and isinstance(new, DynamicRunner):
            new.cache = old.cache
        else:  # the fallback's runners: a transformers cache that grows as it is used
            new.cache = old.cache  # type: ignore[attr-defined]
        self._rows[new] = rows
        if first is not None and all(len(r) >= first[0] for r in rows):
            self._first[new] = first

    def remember_read(self, runner: RunnerBase, read: list[int]) -> None:
        """A prefill stopped between chunks: row 0 holds the positions read so far."""
        if supports(runner) is None and read:
            self._rows[runner] = [read]

    def remember(self, runner: RunnerBase, prompt: list[int], fed: int) -> None:
        """After a generation: each row's cache holds the prompt and the first `fed` tokens of its answer (the
        tokens fed back, a step's each, the last one emitted not yet)."""
        if supports(runner) is not None:
            return
        fed_rows = runner.out[:, :fed].tolist() if fed > 0 else [[] for _ in range(runner.batch)]
        self._rows[runner] = [prompt + r for r in fed_rows]
        first = getattr(runner, "first_logits", None)
        if first is not None:
            self._first[runner] = (len(prompt), first)


@contextmanager
def preserved(runner: RunnerBase, verify_ks: tuple[int, ...] = ()) -> Iterator[None]:
    """Keep the first positions of a static cache through a compile warm-up or a graph capture, which write there:
    as many as the warm-up of the plain step and the verify steps of `verify_ks` writes (a cached prefix is read
    from them after it)."""
    if not isinstance(runner, StaticRunner):
        yield
        return
    n = min(runner.warm_up_span(verify_ks), runner.cache.length)
    saved = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(runner.cache.k, runner.cache.v)]
    try:
        yield
    finally:
        for (k, v), kc, vc in zip(saved, runner.cache.k, runner.cache.v):
            kc[:, :, :n].copy_(k)
            vc[:, :, :n].copy_(v)


Progress = Callable[[int, int], None]  # (prompt tokens read so far, prompt tokens)


def prefill_fn(
    runner: RunnerBase,
    plan: Plan,
    chunk: Optional[int] = None,
    progress: Optional[Progress] = None,
    cancel: Optional[threading.Event] = None,
) -> Callable[[torch.Tensor, SamplerKind], None]:
    """The prefill for this generation: the runner's own when nothing is reused or chunked, else ours."""
    if (plan.start == 0 and chunk is None) or supports(runner) is not None:
        return runner.prefill

    def run(prompt: torch.Tensor, kind: SamplerKind) -> None:
        spans = _spans(plan.start, int(prompt.numel()), chunk)
        if isinstance(runner, StaticRunner):
            _static(runner, prompt, kind, plan, spans, progress, cancel)
        elif isinstance(runner, DynamicRunner):
            _dynamic(runner, prompt, kind, plan, spans, progress, cancel)
        else:
            _hf(runner, prompt, kind, plan, spans, progress, cancel)

    return run


def _spans(start: int, total: int, chunk: Optional[int]) -> list[tuple[int, int]]:
    step = chunk or total
    return [(a, min(a + step, total)) for a in range(start, total, step)]


def _between(
    done: int, total: int, last: bool, progress: Optional[Progress], cancel: Optional[threading.Event]
) -> None:
    if progress is not None:
        progress(done, total)
    if not last and cancel is not None and cancel.is_set():
        raise PrefillCancelled(done, total)


def _read(
    spans: list[tuple[int, int]],
    total: int,
    forward: Callable[[int, int], torch.Tensor],
    progress: Optional[Progress],
    cancel: Optional[threading.Event],
    ready: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run forward(a, b) over each span of prompt positions; the last span's logits. No span: the whole prompt
    comes from the cache, with its logits (`ready`)."""
    if not spans:
        assert ready is not None, "a prompt read whole from the cache comes with its last logits"
        return ready
    logits = torch.empty(0)
    if cancel is not None and cancel.is_set():  # stopped while it waited its turn: not one token is read
        raise PrefillCancelled(spans[0][0], total)
    for i, (a, b) in enumerate(spans):
        logits = forward(a, b)
        _between(b, total, i == len(spans) - 1, progress, cancel)
    return logits


def _causal(arange: torch.Tensor, pos: torch.Tensor, upto: int) -> torch.Tensor:
    return arange[:upto][None, :] <= pos[:, None]  # [T, S]: a chunk's queries attend to all before them


def _static(runner: StaticRunner, prompt: torch.Tensor, kind: SamplerKind, plan: Plan, spans, progress, cancel) -> None:
    runner._start(prompt, kind)
    T = int(prompt.numel())
    cache = runner.cache
    if plan.start and plan.row:
        for kc, vc in zip(cache.k, cache.v):
            kc[0, :, : plan.start].copy_(kc[plan.row, :, : plan.start])
            vc[0, :, : plan.start].copy_(vc[plan.row, :, : plan.start])
    target = cache.rows(1) if runner.batch > 1 else cache  # candidates: read once into row 0, then copied

    def forward(a: int, b: int) -> torch.Tensor:
        cache.attn_len = target.attn_len = b
        pos = runner.arange[a:b]
        mask = None if a == 0 else _causal(runner.arange, pos, b)  # from 0: causal over itself, as the runner does
        return runner.model(prompt[None, a:b], pos, target, mask)[:, -1]

    cache.attn_len = target.attn_len = T  # as the chunks leave it (none run where the whole prompt is cached)
    logits = _read(spans, T, forward, progress, cancel, plan.logits)
    if runner.batch > 1:
        cache.copy_row0_to_all(T)
    runner.accept_first(logits, kind)
    runner.pos.fill_(T)
    runner.host_pos = T  # as StaticRunner.prefill leaves it: the steps and the verify step count from here


def _dynamic(
    runner: DynamicRunner, prompt: torch.Tensor, kind: SamplerKind, plan: Plan, spans, progress, cancel
) -> None:
    runner._start(prompt, kind)
    T = int(prompt.numel())
    old = runner.cache
    cache = DynamicKVCache(runner.model.args.n_layers)
    if plan.start and old is not None:
        r, n = plan.row, plan.start
        cache.k = [None if k is None else k[r : r + 1, :, :n] for k in old.k]
        cache.v = [None if v is None else v[r : r + 1, :, :n] for v in old.v]
    runner.cache = cache  # a prefill stopped between chunks leaves what it read here
    arange = torch.arange(T, device=runner.device)

    def forward(a: int, b: int) -> torch.Tensor:
        pos = arange[a:b]
        mask = None if a == 0 else _causal(arange, pos, b)
        return runner.model(prompt[None, a:b], pos, cache, mask)[:, -1]

    logits = _read(spans, T, forward, progress, cancel, plan.logits)
    if runner.batch > 1:
        cache.expand_rows(runner.batch)
    runner.accept_first(logits, kind)


def _hf(runner, prompt: torch.Tensor, kind: SamplerKind, plan: Plan, spans, progress, cancel) -> None:
    from transformers import DynamicCache

    from engine.fallback import _accepts

    runner._start(prompt, kind)
    T = int(prompt.numel())
    if plan.start:
        cache = runner.cache
        cache.batch_select_indices(torch.tensor([plan.row], device=runner.device))  # its batch_size can be stale
        extra = cache.get_seq_length() - plan.start
        if extra > 0:
            cache.crop(-extra)  # transformers 5: the number of positions to remove, as a negative count
    else:
        cfg = runner.model.config
        cache = DynamicCache(config=cfg) if _accepts(DynamicCache.__init__, "config") else DynamicCache()
    runner.cache = cache
    logits = _read(spans, T, lambda a, b: runner._forward(prompt[None, a:b], use_cache=True), progress, cancel)
    if runner.batch > 1:
        cache.batch_repeat_interleave(runner.batch)
    runner.accept_first(logits, kind)
