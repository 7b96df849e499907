"""The fused runner: the static runner's state and prefill, with the decode step as the fused Triton kernels.

Per step: five kernels per layer (engine/kernels/step_kernels.py), the final norm + output head, and for greedy
sampling one more kernel that picks every row's token and does the runner's bookkeeping. Sampling with a
temperature, filters or a repetition penalty runs the torch sampler (engine/sampling.py) on the head's logits. The
prompt is prefilled by the eager model into the same static cache. The kernels read the position from the device
and attend over [0, pos], so one CUDA graph per sampler kind serves every context length.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, cast

import torch

from engine.decode import StaticRunner
from engine.kernels import launch, pdl_status
from engine.model import Block, Transformer
from engine.sampling import SamplerKind, sample

log = logging.getLogger(__name__)


class FusedRunner(StaticRunner):
    def __init__(
        self,
        model: Transformer,
        batch: int,
        length: int,
        eos_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        pdl_failed: Optional[str] = None,  # why an earlier runner's step failed here with PDL: launched without it
    ):
        if batch > launch.MAX_ROWS:
            raise ValueError(f"the fused kernels serve at most {launch.MAX_ROWS} rows, got {batch}")
        super().__init__(model, batch, length, eos_ids, device, dtype)
        a = model.args
        self.use_pdl, self.pdl_reason = (False, pdl_failed) if pdl_failed is not None else pdl_status(device)
        self.x = torch.zeros(batch, a.dim, dtype=dtype, device=device)  # the residual stream
        self.q = torch.zeros(batch, a.n_heads, a.head_dim, dtype=dtype, device=device)
        self.y = torch.zeros(batch, a.n_heads * a.head_dim, dtype=dtype, device=device)
        self.act = torch.zeros(batch, a.intermediate_size, dtype=dtype, device=device)
        self.logits = torch.zeros(batch, a.vocab_size, dtype=torch.float32, device=device)
        blocks = launch.head_blocks(a.vocab_size, a.dim)
        self.pmax = torch.zeros(batch, blocks, dtype=torch.float32, device=device)
        self.pidx = torch.zeros(batch, blocks, dtype=torch.int32, device=device)
        self.cos = model.rope_cos.to(dtype)  # the eager model casts the tables at use
        self.sin = model.rope_sin.to(dtype)

    def fused_step(self, kind: SamplerKind) -> None:
        """One decode step: feeds self.tok at self.pos, writes the next token, advances pos and the counter."""
        m, pdl, eps = self.model, self.use_pdl, self.model.args.norm_eps
        for i, block in enumerate(cast("list[Block]", list(m.layers))):
            at, ff = block.attention, block.feed_forward
            kc, vc = self.cache.k[i], self.cache.v[i]
            launch.qkv_rope(
                self.x,
                self.tok,
                m.tok_embeddings.weight if i == 0 else None,
                block.attention_norm.weight,
                at.wqkv.weight,
                at.wqkv.bias,
                at.q_norm.weight if at.q_norm is not None else None,
                at.k_norm.weight if at.k_norm is not None else None,
                self.cos,
                self.sin,
                self.pos,
                self.q,
                kc,
                vc,
                eps,
                pdl,
            )
            launch.decode_attention(self.q, kc, vc, self.pos, self.y, pdl)
            launch.gemv_residual(self.y, at.wo.weight, at.wo.bias, self.x, pdl)
            launch.norm_gate_up(self.x, block.ffn_norm.weight, ff.w13.weight, ff.w13.bias, self.act, eps, pdl)
            launch.gemv_residual(self.act, ff.w2.weight, ff.w2.bias, self.x, pdl)
        launch.norm_head(self.x, m.norm.weight, m.output.weight, self.logits, self.pmax, self.pidx, eps, pdl)
        if kind.greedy and not kind.repetition:
            launch.greedy_accept(
                self.pmax, self.pidx, self.eos, self.done, self.out, self.tok, self.counter, self.pos, pdl
            )
        else:
            self._accept(sample(self.logits, kind, self.sampler), kind)
            self.pos += 1

    def bucket_step(self, bucket: int, kind: SamplerKind, k: Optional[int] = None) -> None:
        """What StaticRunner's warm-up and capture run: the fused step, whatever the bucket. The fused kernels
        have no verify step for k drafts (the engine reports speculation unavailable with them)."""
        if k is not None:
            raise ValueError("the fused step has no verify step for drafts")
        self.fused_step(kind)

    def buckets_for(self, prompt_len: int, max_new: int, slack: int = 0) -> list[int]:
        return [self.length]

    def step(self, step_index: int) -> None:
        kind = self.kind
        if kind is None:
            raise RuntimeError("a decode step before the prefill")
        graph = self.graphs.get((self.length, kind)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self.fused_step(kind)

    def _warm_up_plan(
        self, buckets: list[int], kind: SamplerKind, use_graphs: bool, verify_ks: tuple[int, ...]
    ) -> list[tuple[int, Optional[int]]]:
        """One shape whatever the buckets: the fused step reads the cache to `pos`, not to a bucket. Its writes
        land where the prefill and later steps write before they read, as StaticRunner.warm_up explains."""
        if verify_ks:
            raise ValueError("the fused step has no verify step for drafts")
        done = self.graphs if use_graphs else self.compiled_warm
        return [] if self._graph_key(self.length, kind, None) in done else [(self.length, None)]

    def _warm_up_one(
        self, bucket: int, kind: SamplerKind, k: Optional[int], use_graphs: bool, say: Callable[[str], None]
    ) -> None:
        """Compile the kernels (their first launch) and, with use_graphs, capture the step."""
        if use_graphs:
            say("compiling the fused kernels and capturing the decode step")
            self._capture(self.length, kind)
        else:
            say("compiling the fused kernels")
            self._warm_step(self.length, kind, None)
        self.compiled_warm.add(self._graph_key(self.length, kind, None))

    def bytes_per_step(self, pos: int) -> int:
        per_pos = self.cache.nbytes() // max(self.cache.length, 1)
        return self.model.weight_bytes() + per_pos * (pos + 1)
