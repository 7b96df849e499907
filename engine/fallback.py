"""The transformers fallback: any causal LM transformers can load, run eagerly with its own cache.

Only the forward pass is transformers'; sampling, streaming and metrics are the engine's, so the figures of a
fallback generation mean the same as those of the fast path. Options that need our own graph (static cache,
compile, CUDA graph) are reported unavailable by the engine.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Optional

import torch

from engine.decode import RunnerBase, after_prefill
from engine.sampling import SamplerKind, sample

if TYPE_CHECKING:
    from transformers import DynamicCache


def build_hf_model(cfg, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """transformers' model for `cfg` (never remote code) with the checkpoint's weights, in dtype on device."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4 keeps it in modeling_utils
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]

    from engine.errors import ModelLoadError

    to_transformers = getattr(cfg, "to_transformers", None)  # a config read back from the GGUF cache
    if to_transformers is not None:
        cfg = to_transformers()
    # Built on the real device, so the buffers (rotary tables, embedding scales) get their values here; every
    # parameter comes from the checkpoint, so random initialisation is skipped (it took 9.2 of a 270M model's
    # 22 s load) and the checkpoint's tensors are taken as they are instead of copied in (one copy of the
    # weights in memory, not two).
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg)
    missing, _ = model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    missing = [m for m in missing if m not in tied]
    if missing:
        raise ModelLoadError(f"weights missing for {', '.join(missing[:4])}")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class HFRunner(RunnerBase):
    """kv_cache "dynamic": transformers' DynamicCache; "none": the whole prefix again every token."""

    def __init__(self, model, batch: int, length: int, vocab: int, eos_ids: list[int], device: torch.device, kv: str):
        super().__init__(batch, length, vocab, eos_ids, device)
        self.model, self.kv = model, kv
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.keep_arg = "logits_to_keep" if "logits_to_keep" in params else None
        self.cache: Optional[DynamicCache] = None
        self.ids: Optional[torch.Tensor] = None
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def _forward(self, ids: torch.Tensor, use_cache: bool) -> torch.Tensor:
        kwargs = {"input_ids": ids, "use_cache": use_cache}
        if use_cache:
            kwargs[self.cache_arg] = self.cache
        if self.keep_arg:
            kwargs[self.keep_arg] = 1
        return self.model(**kwargs).logits[:, -1].float()

    def prefill(self, prompt: torch.Tensor, kind: SamplerKind) -> None:
        from transformers import DynamicCache

        self._start(prompt, kind)
        ids = prompt[None, :]
        if self.kv == "none":
            self.ids = ids.expand(self.batch, -1)
            logits = self._forward(ids, use_cache=False)
        else:
            self.cache = (
                DynamicCache(config=self.model.config) if _accepts(DynamicCache.__init__, "config") else DynamicCache()
            )
            logits = self._forward(ids, use_cache=True)
            if self.batch > 1:
                self.cache.batch_repeat_interleave(self.batch)
        self.accept_first(logits, kind)

    def step(self, step_index: int) -> None:
        if self.kv == "none":
            self.ids = torch.cat([after_prefill(self.ids), self.tok], dim=1)
            logits = self._forward(self.ids, use_cache=False)
        else:
            logits = self._forward(self.tok, use_cache=True)
        self._accept(sample(logits, self.step_kind, self.sampler), self.step_kind)

    def bytes_per_step(self, pos: int) -> int:
        return self.weight_bytes
