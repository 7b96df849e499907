"""Decode runners: one per kv_cache mode. Each owns the device state of a generation and advances it a step.

State every runner keeps on the device: `out` [B, L] (generated tokens), `done` [B] (row hit EOS), the token
fed next, and the sampler state. The host knows only how many steps it issued; it learns tokens by reading
`out` (every step with host sampling, a few steps behind with device sampling).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch

from engine import heap
from engine.errors import GenerationError
from engine.model import DynamicKVCache, StaticKVCache, Transformer
from engine.sampling import SamplerKind, SamplerState, mark_seen, sample
from engine.speculative import verify

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the type torch.cuda.graph_pool_handle() returns

log = logging.getLogger(__name__)

BUCKET_MIN = 256
MAX_VERIFY = 15  # the most drafts one verify step takes


def bucket_for(n: int, limit: int) -> int:
    """The smallest power-of-two context bucket (>= 256) holding n positions, capped at limit."""
    b = BUCKET_MIN
    while b < n:
        b *= 2
    return min(b, limit)


T = TypeVar("T")


def after_prefill(value: Optional[T]) -> T:
    """A runner's state that its prefill sets; a step before any prefill is a bug of the caller."""
    if value is None:
        raise RuntimeError("a decode step runs only after the prefill of its generation")
    return value


class RunnerBase(abc.ABC):
    """Token bookkeeping shared by every mode."""

    def __init__(self, batch: int, length: int, vocab: int, eos_ids: list[int], device: torch.device):
        self.batch, self.length, self.device = batch, length, device
        self.out = torch.zeros(batch, length, dtype=torch.long, device=device)  # [B, L]
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1] next input
        self.counter = torch.zeros(1, dtype=torch.long, device=device)  # tokens written to `out`
        self.eos = torch.tensor(eos_ids or [-1], dtype=torch.long, device=device)
        self.sampler = SamplerState(batch, vocab, device)
        self.kind: Optional[SamplerKind] = None
        self.prompt_len = 0

    def _accept(self, nxt: torch.Tensor, kind: SamplerKind) -> None:
        """nxt: [B]. Rows already done keep emitting their EOS as padding; everything stays on the device."""
        nxt = torch.where(self.done, self.eos[0], nxt)
        if kind.repetition:
            mark_seen(self.sampler, nxt)
        self.done |= torch.isin(nxt, self.eos)
        self.out.index_copy_(1, self.counter, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.counter += 1

    def accept_first(self, logits: torch.Tensor, kind: SamplerKind) -> None:
        """Every prefill's end: the first token of each row sampled from the prompt's last logits ([1 or B, V]),
        which are checked once an answer (the first token is timed with a device sync anyway): NaN or +inf scores
        would be sampled as token 0 over and over, an answer of nothing without a word why."""
        if bool((logits.isnan() | logits.isposinf()).any()):
            raise GenerationError(
                "the model scored the first token with NaN or infinite values: its weights are damaged, or its "
                "numbers overflow in this dtype (try fp32 or bf16)"
            )
        # kept for a generation of the same prompt again (engine.prefix: a Regenerate reads the prompt's logits
        # from here, as its positions from the cache)
        self.first_logits = logits[:1].detach().clone()
        self._accept(sample(logits.expand(self.batch, -1), kind, self.sampler), kind)

    @property
    def step_kind(self) -> SamplerKind:
        """The sampler kind of the generation the prefill started (a step runs only after one)."""
        return after_prefill(self.kind)

    def _start(self, prompt: torch.Tensor, kind: SamplerKind) -> None:
        self.kind = kind
        self.prompt_len = int(prompt.numel())
        self.done.zero_()
        self.counter.zero_()
        if kind.repetition:
            self.sampler.reset_seen(prompt)

    @abc.abstractmethod
    def prefill(self, prompt: torch.Tensor, kind: SamplerKind) -> None:
        """prompt: [T] on the device. Runs the prompt and writes the first token of every row."""

    @abc.abstractmethod
    def step(self, step_index: int) -> None:
        """Decode step `step_index` (1-based): feeds token step_index-1, writes token step_index."""

    @abc.abstractmethod
    def bytes_per_step(self, pos: int) -> int:
        """Bytes one step at position `pos` must read from memory at least (weights + attended KV)."""


def _say(progress: Callable[[str, float], None], fraction: float, text: str) -> None:
    progress(text, fraction)


class StaticRunner(RunnerBase):
    """Preallocated KV cache, index writes, static shapes: the step is a function of buffers only, so it can be
    compiled and captured in a CUDA graph (one per context bucket and sampler kind)."""

    def __init__(
        self, model: Transformer, batch: int, length: int, eos_ids: list[int], device: torch.device, dtype: torch.dtype
    ):
        super().__init__(batch, length, model.args.vocab_size, eos_ids, device)
        self.model = model
        model.cover_positions(length + 1)
        # One spare position past the last bucket: the view a step attends over is then never the whole cache,
        # so a step compiled with the bucket length symbolic does not specialise on "bucket == cache length"
        # (that view alone would be contiguous: another guard, another compile).
        self.cache = StaticKVCache.allocate(model.args, batch, length + 1, dtype, device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # position of self.tok
        self.arange = torch.arange(length, device=device)
        self.compiled: Optional[Callable] = None
        self.compiled_verify: Optional[Callable] = None
        self.graphs: dict[tuple, "torch.cuda.CUDAGraph"] = {}  # (bucket, kind) or (bucket, kind, k) for verify
        self.compiled_warm: set[tuple] = set()  # the same keys, run once through the compiled step (no graphs)
        # Speculative verify: drafts copied in by the host, and what the step made of them (read back after it).
        self.drafts = torch.zeros(1, MAX_VERIFY, dtype=torch.long, device=device)
        self.n_emit = torch.zeros((), dtype=torch.long, device=device)
        self.n_accepted = torch.zeros((), dtype=torch.long, device=device)
        self.host_pos = 0  # position of self.tok, as the host knows it
        self.graph_pool: Optional[_POOL_HANDLE] = None  # torch.cuda.graph_pool_handle(), shared by the graphs
        self.use_graphs = False  # replay the captured graphs; kept when off, so switching back on is free

    # -- the step, as a function of buffers ------------------------------------------------------------
    def masked_step(self, bucket: int, kind: SamplerKind) -> None:
        """The step over a whole context bucket with a mask from `pos`: static shapes, what is compiled and
        captured."""
        self.span_step(self.arange[:bucket], kind)

    def span_step(self, span: torch.Tensor, kind: SamplerKind) -> None:
        """masked_step over the positions `span` ([bucket], 0..bucket-1): the bucket is a tensor's length, so a
        compile can keep it symbolic (see compile_step)."""
        mask = span[None, :] <= self.pos[:, None]  # [1, bucket]
        logits = self.model(self.tok, self.pos, self.cache.over(span.shape[0]), mask)[:, -1]
        self._accept(sample(logits, kind, self.sampler), kind)
        self.pos += 1

    def masked_verify(self, bucket: int, k: int, kind: SamplerKind) -> None:
        """Feed the current token and k drafts at positions pos..pos+k (causal among them, the cache before them),
        emit the verified tokens into `out`, advance pos and the counter by their number. The cache rows of
        rejected drafts stay, unread: the next step writes its own tokens there before anything attends to them."""
        self.span_verify(self.arange[:bucket], k, kind)

    def span_verify(self, span: torch.Tensor, k: int, kind: SamplerKind) -> None:
        """masked_verify over the positions `span`, as span_step is to masked_step."""
        T = k + 1
        steps = span[:T]
        positions = self.pos + steps  # [T]
        mask = span[None, :] <= positions[:, None]  # [T, bucket]
        ids = torch.cat([self.tok, self.drafts[:, :k]], dim=1)  # [1, T]
        logits = self.model(ids, positions, self.cache.over(span.shape[0]), mask, last_only=False)[0]  # [T, V]
        v = verify(logits, self.drafts[0, :k], kind, self.sampler, self.eos)
        self.out.index_copy_(1, self.counter + steps, v.tokens[None, :])
        last = v.tokens.gather(0, (v.n_emit - 1)[None])  # [1]
        if kind.repetition:
            emitted = (steps < v.n_emit).long()
            marks = torch.zeros(self.sampler.seen.shape[1], dtype=torch.long, device=self.device)
            self.sampler.seen[0] |= marks.scatter_reduce(0, v.tokens, emitted, "amax").bool()
        self.done |= v.eos_hit
        self.tok.copy_(last[None, :])
        self.n_emit.copy_(v.n_emit)
        self.n_accepted.copy_(v.n_accepted)
        self.pos += v.n_emit
        self.counter += v.n_emit

    def set_compiled(self, fn: Optional[Callable], verify_fn: Optional[Callable] = None) -> None:
        """The step function (bucket, kind) and the verify step (bucket, k, kind) change, so the graphs captured
        from the old ones go. Their memory pool goes with them: a pool whose graphs are all gone may still hold
        blocks (e.g. a library workspace allocated during capture), and capturing into it again is refused by
        the allocator. Without a verify_fn, a step set by hand verifies eagerly over the whole bucket."""
        self.compiled = fn
        self.compiled_verify = (verify_fn or self.masked_verify) if fn is not None else None
        self.compiled_warm.clear()
        self.graphs.clear()
        self.graph_pool = None

    def compile_step(self, symbolic_bucket: bool) -> None:
        """torch.compile the step and the verify step. With `symbolic_bucket`, the context bucket is a symbolic
        length: one compile serves every bucket (and each draft length k one more), in this conversation and the
        next. Without, each bucket is a compile of its own, with the bucket's length a constant in the kernels.

        Measured on the CPU (docs/benchmarks.md, "Compiling the bucket dimension once"): per bucket, every new
        bucket or runner length a conversation reaches is a compile of its own (~7 s on the tiny test model, ~50 s
        for the default model), at an answer's start or again after a restart; symbolic, the
        next buckets cost nothing (default model: 0.1 s against ~50 s a bucket), for a slower step on the tiny
        model (0.6-1.2 ms against 0.2-0.3 ms; the default model's step is not slower symbolic, within noise). Chosen for the CPU,
        where a compile is minutes. On CUDA the per-bucket compile stays (not measured there; each
        bucket is captured in a graph of its own either way)."""
        if not symbolic_bucket:
            self.set_compiled(
                torch.compile(self.masked_step, dynamic=False), torch.compile(self.masked_verify, dynamic=False)
            )
            return
        from torch._dynamo import mark_dynamic

        # The runner's length too: a longer conversation gets a longer runner, whose buffers then pass the same
        # compiled step's guards (every runner's step is one code object).
        for t, dim in [(self.out, 1), (self.arange, 0), *((c, 2) for c in self.cache.k + self.cache.v)]:
            mark_dynamic(t, dim)
        step = torch.compile(self.span_step, dynamic=False)
        verify = torch.compile(self.span_verify, dynamic=False)
        self.set_compiled(
            lambda bucket, kind: step(self._span(bucket), kind),
            lambda bucket, k, kind: verify(self._span(bucket), k, kind),
        )

    def _span(self, bucket: int) -> torch.Tensor:
        from torch._dynamo import mark_dynamic  # imported on first use: 3 s, and only a compiled step needs it

        span = self.arange[:bucket]
        mark_dynamic(span, 0)  # a compile that would specialise the bucket fails (eager fallback)
        return span

    def bucket_step(self, bucket: int, kind: SamplerKind, k: Optional[int] = None) -> None:
        """The masked step in a context bucket (the verify step of k drafts when k is given), compiled where a
        compiled one is set."""
        self.cache.attn_len = bucket
        if k is None:
            (self.compiled or self.masked_step)(bucket, kind)
        else:
            (self.compiled_verify or self.masked_verify)(bucket, k, kind)

    def exact_step(self, pos: int, kind: SamplerKind) -> None:
        """The eager step: attend over exactly the pos + 1 filled positions, no mask. Fixed shapes buy nothing
        without compile or a graph, and a masked attention over the whole bucket costs more on a CPU."""
        self.cache.attn_len = pos + 1
        logits = self.model(self.tok, self.pos, self.cache, None)[:, -1]
        self._accept(sample(logits, kind, self.sampler), kind)
        self.pos += 1

    # -- public ----------------------------------------------------------------------------------------
    def prefill(self, prompt: torch.Tensor, kind: SamplerKind) -> None:
        """prompt: [T] on the device. Fills row 0's cache, shares it with every row, samples the first tokens."""
        self._start(prompt, kind)
        T = prompt.numel()
        self.cache.attn_len = T  # the prompt attends causally over itself: no mask needed
        pos = self.arange[:T]
        mask = None
        saved_cache = self.cache
        if self.batch > 1:  # prefill once at batch 1 into row 0, then copy the rows
            row0 = self.cache.rows(1)
            logits = self.model(prompt[None, :], pos, row0, mask)[:, -1]
            self.cache.copy_row0_to_all(T)
        else:
            logits = self.model(prompt[None, :], pos, saved_cache, mask)[:, -1]
        self.accept_first(logits, kind)
        self.pos.fill_(T)
        self.host_pos = T

    def step(self, step_index: int) -> None:
        pos = self.host_pos  # position of the token being fed
        self.host_pos += 1
        kind = self.step_kind
        bucket = bucket_for(pos + 1, self.length)
        graph = self.graphs.get((bucket, kind)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        elif self.compiled is not None:
            self.bucket_step(bucket, kind)
        else:
            self.exact_step(pos, kind)

    def speculate(self, drafts: list[int], k: int) -> tuple[int, int]:
        """One verify step over `drafts` (padded to k, the length of a compiled or captured verify step; eager
        runs exactly len(drafts)). Returns (tokens emitted, drafts accepted), read back from the device."""
        kind = self.step_kind
        n = len(drafts)
        if self.compiled is None and not self.use_graphs:
            k = n
        self.drafts[0, :n].copy_(torch.tensor(drafts, dtype=torch.long), non_blocking=True)
        if k > n:
            self.drafts[0, n:k].fill_(drafts[-1])
        pos = self.host_pos
        bucket = bucket_for(pos + k + 1, self.length)
        graph = self.graphs.get((bucket, kind, k)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        elif self.compiled_verify is not None:
            self.bucket_step(bucket, kind, k)
        else:  # eager: attend over exactly the filled positions and the new ones
            self.cache.attn_len = pos + k + 1
            self.masked_verify(pos + k + 1, k, kind)
        emitted, accepted = torch.stack([self.n_emit, self.n_accepted]).tolist()
        self.host_pos += emitted
        return emitted, min(accepted, n)

    def verify_room(self) -> int:
        """The longest draft the cache can verify from the current position."""
        return min(MAX_VERIFY, self.length - 1 - self.host_pos)

    def buckets_for(self, prompt_len: int, max_new: int, slack: int = 0) -> list[int]:
        """Every bucket a generation of max_new tokens after prompt_len may attend over; `slack`: the longest
        verify step, whose drafts may run past the last token wanted (padded to a compiled length)."""
        first = bucket_for(prompt_len + 1, self.length)
        last = bucket_for(min(prompt_len + max_new + slack, self.length), self.length)
        out, b = [], first
        while True:
            out.append(b)
            if b >= last:
                return out
            b = min(b * 2, self.length)

    def warm_up(
        self,
        buckets: list[int],
        kind: SamplerKind,
        use_graphs: bool,
        progress: Callable[[str, float], None],
        verify_ks: tuple[int, ...] = (),
    ) -> None:
        """Compile (first calls) and capture every bucket a generation may cross, before its prefill, for the
        plain step and for the verify step of each draft length in `verify_ks`.

        Every step it runs starts at position 0, so it writes cache positions 0..max(verify_ks) and no others
        (warm_up_span): where a cached prefix is kept there, the caller saves and restores them (prefix.preserved).
        The token state is reset by the prefill, so a warm-up never changes a generation's result.
        """
        todo = self._warm_up_plan(buckets, kind, use_graphs, verify_ks)
        with heap.building() if todo else contextlib.nullcontext():  # what a compile builds, kept out of gc's way
            for i, (bucket, k) in enumerate(todo):
                say = functools.partial(_say, progress, i / max(len(todo), 1))
                self._warm_up_one(bucket, kind, k, use_graphs, say)
        self.pos.zero_()
        self.counter.zero_()
        self.done.zero_()

    def _warm_up_plan(
        self, buckets: list[int], kind: SamplerKind, use_graphs: bool, verify_ks: tuple[int, ...]
    ) -> list[tuple[int, Optional[int]]]:
        """(bucket, draft length or None) of every step shape a warm-up still has to compile or capture."""
        shapes: list[tuple[int, Optional[int]]] = [(b, None) for b in buckets]
        shapes += [(b, k) for k in verify_ks for b in buckets]
        if not use_graphs and self.compiled is None:
            return []  # eager: nothing to compile or capture
        done = self.graphs if use_graphs else self.compiled_warm
        return [(b, k) for b, k in shapes if self._graph_key(b, kind, k) not in done]

    def _warm_up_one(
        self, bucket: int, kind: SamplerKind, k: Optional[int], use_graphs: bool, say: Callable[[str], None]
    ) -> None:
        what = "decode step" if k is None else f"verify step ({k} drafts)"
        if use_graphs:
            say(f"capturing the {what} (context {bucket})")
            self._capture(bucket, kind, k)
        elif self.compiled is not None:
            say(f"compiling the {what} (context {bucket})")
            self._warm_step(bucket, kind, k)
            self.compiled_warm.add(self._graph_key(bucket, kind, k))

    def _warm_step(self, bucket: int, kind: SamplerKind, k: Optional[int]) -> None:
        """One step of a warm-up, from position 0: a step advances the position, and several in a row (a
        capture's) would write past the span a caller keeps (warm_up_span)."""
        self._rewind()
        self.bucket_step(bucket, kind, k)

    def _rewind(self) -> None:
        self.pos.fill_(0)
        self.counter.zero_()

    @staticmethod
    def warm_up_span(verify_ks: tuple[int, ...] = ()) -> int:
        """The cache positions a warm-up writes: the step's one, or a verify step's k + 1."""
        return 1 + max(verify_ks, default=0)

    @staticmethod
    def _graph_key(bucket: int, kind: SamplerKind, k: Optional[int]) -> tuple:
        return (bucket, kind) if k is None else (bucket, kind, k)

    def _capture(self, bucket: int, kind: SamplerKind, k: Optional[int] = None) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # allocator and lazy initialisation happen outside the graph
                self._warm_step(bucket, kind, k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        self._rewind()  # the graph's one step from position 0, as the runs before it (_warm_step)
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self.bucket_step(bucket, kind, k)
        torch.cuda.synchronize()
        self.graphs[self._graph_key(bucket, kind, k)] = graph

    def bytes_per_step(self, pos: int) -> int:
        per_pos = self.cache.nbytes() // max(self.cache.length, 1)
        return self.model.weight_bytes() + per_pos * bucket_for(pos + 1, self.length)


class DynamicRunner(RunnerBase):
    """KV cache grown with torch.cat every step; positions built from host ints (the naive loop)."""

    def __init__(self, model: Transformer, batch: int, length: int, eos_ids: list[int], device: torch.device):
        super().__init__(batch, length, model.args.vocab_size, eos_ids, device)
        self.model = model
        model.cover_positions(length + 1)
        self.cache: Optional[DynamicKVCache] = None

    def prefill(self, prompt: torch.Tensor, kind: SamplerKind) -> None:
        self._start(prompt, kind)
        T = prompt.numel()
        self.cache = DynamicKVCache(self.model.args.n_layers)
        logits = self.model(prompt[None, :], torch.arange(T, device=self.device), self.cache, None)[:, -1]
        if self.batch > 1:
            self.cache.expand_rows(self.batch)
        self.accept_first(logits, kind)

    def step(self, step_index: int) -> None:
        pos = self.prompt_len + step_index - 1
        input_pos = torch.tensor([pos], device=self.device)
        logits = self.model(self.tok, input_pos, self.cache, None)[:, -1]
        self._accept(sample(logits, self.step_kind, self.sampler), self.step_kind)

    def bytes_per_step(self, pos: int) -> int:
        """The weights and the KV of the `pos + 1` positions a step at `pos` attends over (the cache as it stands
        holds the whole answer so far: asked at the answer's end for its middle, it counted the end's)."""
        held = [t for t in (self.cache.k + self.cache.v) if t is not None] if self.cache else []
        if not held:
            return self.model.weight_bytes()
        per_pos = sum(t.numel() * t.element_size() for t in held) // max(held[0].shape[2], 1)
        return self.model.weight_bytes() + per_pos * (pos + 1)


class NoCacheRunner(RunnerBase):
    """No KV cache: the whole prefix is run again for every token."""

    def __init__(self, model: Transformer, batch: int, length: int, eos_ids: list[int], device: torch.device):
        super().__init__(batch, length, model.args.vocab_size, eos_ids, device)
        self.model = model
        model.cover_positions(length + 1)
        self.ids: Optional[torch.Tensor] = None

    def prefill(self, prompt: torch.Tensor, kind: SamplerKind) -> None:
        self._start(prompt, kind)
        T = prompt.numel()
        self.ids = prompt[None, :].expand(self.batch, -1)
        logits = self.model(prompt[None, :], torch.arange(T, device=self.device), None, None)[:, -1]
        self.accept_first(logits, kind)

    def step(self, step_index: int) -> None:
        self.ids = torch.cat([after_prefill(self.ids), self.tok], dim=1)
        n = self.ids.shape[1]
        logits = self.model(self.ids, torch.arange(n, device=self.device), None, None)[:, -1]
        self._accept(sample(logits, self.step_kind, self.sampler), self.step_kind)

    def bytes_per_step(self, pos: int) -> int:
        return self.model.weight_bytes()
