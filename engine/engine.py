"""The engine facade: load a model once, switch options between generations, generate with live events."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from engine import cpu_kernels, figures, heap
from engine.decode import DynamicRunner, NoCacheRunner, RunnerBase, StaticRunner, bucket_for
from engine.errors import GaplessError, GenerationError, ModelLoadError, ReadStopped, one_line
from engine.generate import NOT_REMOTE, LoopResult, run_loop
from engine.model import FAST_FAMILIES, ModelArgs, Transformer, build_transformer
from engine.observers import MonitorDrain, PeakMemory, TextFlush, WindowObserver, reader_for
from engine.paths import user_path
from engine.prefix import PREFILL_CHUNK, PrefillCancelled, PrefixCache, prefill_fn, preserved
from engine.prompt_stop import PromptStopped, stopped_by
from engine.protocol import option_limits
from engine.sampling import SamplerKind
from engine.speculative import ADAPTIVE_KS, NGRAM_MAX, DraftProposer, NgramProposer, Speculator, speculation_off
from engine.stream import RowText
from engine.types import (
    DRAFT_READ_STOPPED,
    EngineOptions,
    GenerationMetrics,
    GenerationResult,
    ModelInfo,
    Progress,
    SamplingParams,
    TextDelta,
    model_file_name,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RECOMPILE_LIMIT = 64  # compiled variants of the decode step (see _prepare_compile)
# Runners (each with its KV cache, and on a GPU its CUDA graphs) kept between generations: the last ones used. One
# per (KV mode, candidates, kernels) ever used was kept, so a server's clients asking for n = 1, 2, 3, ... held a
# cache of the whole context for each n until the process ran out of memory.
MAX_RUNNERS = 2
# A plain completion's answer is decoded after this many of the prompt's last tokens (stream.RowText's lead)
LEAD_TOKENS = 4
BYTES_PER_TOKEN_SOURCE = "weights the decode step reads: every linear (quantised as held) and norm, one embedding row"
LOAD_SECONDS_SOURCE = "perf_counter around Engine.load (read, convert or cache, de-quantise, place)"


def _target_device(requested: str) -> torch.device:
    """Where options would run: auto means CUDA when present; a missing GPU means the CPU (reported in unavailable())."""
    return torch.device("cuda" if requested in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def resolve_dtype(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "fp16" if device.type == "cuda" else "fp32"
    return requested


def _noop(_event: object) -> None:
    return None


@dataclass
class _Attempt:
    """One try at a generation: the options it ran with, its loop (or, when stopped while the prompt was read, that
    stop), and what it found: the options it gave up with why, and notices for the user."""

    opts: EngineOptions
    loop: Optional[LoopResult] = None
    stopped: Optional[PrefillCancelled] = None
    reasons: dict[str, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)


class Engine:
    """One loaded model. Methods are meant to be called from one worker thread; a lock makes a concurrent
    reconfigure wait for the running generation instead of changing it underneath."""

    def __init__(self, checkpoint, options: EngineOptions, progress: Callable[[Progress], None]):
        self._lock = threading.RLock()
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.args = self._fast_args()
        self.fast = self.args is not None
        self._fused_failed: Optional[str] = None  # why the fused kernels failed here once; not tried again
        # read by effective() (what a draft model refused), so set before the options are first resolved
        self._draft_models: dict[tuple[str, str, str], Transformer] = {}  # (path, device, dtype) -> the draft model
        self._draft_proposer: Optional[DraftProposer] = None  # the draft model's, with its cache of the chat
        # draft model path -> (what was on disk there, why it cannot draft for this model): tried again once the
        # file changes (a draft model copied in later, or replaced)
        self._draft_refused: dict[str, tuple[tuple, str]] = {}
        self.options = options.validate()
        eff, _ = self.effective(self.options)
        self.device = torch.device(eff.device)
        self.dtype = eff.dtype
        self.weights = eff.weights
        self.model: Optional[Union[Transformer, PreTrainedModel]] = None  # the fast path's or the fallback's
        self._runners: dict[tuple, RunnerBase] = {}
        self.load_seconds: Optional[float] = None  # set by Engine.load: file to model ready
        self._prefix = PrefixCache()  # what each runner's KV cache holds, for the next prompt to reuse
        self.eos_ids = self._eos_ids()
        self._unfrozen = False  # the heap given back to the collector (a model replaced) and not frozen again yet
        self._build_model(progress)
        self._load_draft(self.options, progress)
        self.monitor = self._start_monitor()

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        source: str,
        options: EngineOptions = EngineOptions(),
        progress: Optional[Callable[[Progress], None]] = None,
    ) -> "Engine":
        from engine.loader import load_checkpoint

        started = time.perf_counter()
        progress = progress or _noop
        compiled = _compile_cache()
        if os.access(compiled, os.W_OK | os.X_OK):  # else inductor's own temporary folder
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled))
        device = _target_device(options.validate().device)
        dtype = TORCH_DTYPES[resolve_dtype(options.dtype, device)]
        checkpoint = load_checkpoint(source, progress, dtype=dtype, device=device)  # GGUF: straight into these
        engine = cls(checkpoint, options, progress)
        heap.settle()  # what torch, the tokenizer and the model built stays: out of the collector's full passes
        heap.trim()  # what the read and a quantisation freed, back to the system
        engine.load_seconds = time.perf_counter() - started
        return engine

    def _fast_args(self) -> Optional[ModelArgs]:
        self.fast_reason = ""
        if self.config.model_type not in FAST_FAMILIES:
            return None
        try:
            return ModelArgs.from_hf_config(self.config)
        except ValueError as exc:
            log.info("fast path unavailable for this model: %s", exc)
            self.fast_reason = str(exc)
            return None

    def _eos_ids(self) -> list[int]:
        """End-of-sequence ids from the config, generation_config.json and the tokenizer (via the loader)."""
        return sorted(set(self.checkpoint.eos_token_ids))

    def _build_model(self, progress: Callable[[Progress], None]) -> None:
        progress(Progress("load", None, f"placing weights on {self.device} in {self.dtype}"))
        self._runners.clear()
        self._fused_failed = None
        self._fused_pdl: Optional[dict[str, object]] = None  # fused_status() of the last fused runner warmed up
        self._pdl_failed: Optional[str] = None  # why the fused step failed here with PDL: later runners go without
        self._forget_drafts()
        replacing = self.model is not None
        self.model = None
        if replacing:
            self._unfrozen = True  # until a model is placed again (a failed switch places the previous one)
            # the model given up was frozen with the load (heap.settle), and so were the cycles through it (a CPU
            # layer's binding holds its block's attributes, a compiled step its module): nothing freed them until
            # the engine closed, 405 MiB of fp32 linears kept beside the int8 ones for the default model
            heap.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        dtype = TORCH_DTYPES[self.dtype]
        try:
            state = self.checkpoint.weights(dtype, self.device)
            if self.fast:
                # a checkpoint that can read its weights again gives them up as they are fused
                reloadable = self.checkpoint.materialise is not None
                model = build_transformer(self.config, state, dtype, self.device, consume=reloadable)
                if self.device.type == "cpu" and not cpu_kernels.tried():
                    # built here, not inside the first answer (about a second on the first launch, then cached)
                    progress(Progress("load", None, "preparing the CPU kernels"))
                    cpu_kernels.kernel()
                if self.weights != "native":
                    from engine.quant import INT4_GRID_TYPES, quantize_linears

                    progress(Progress("load", None, f"quantising the linears to {self.weights}"))
                    grid = bool(self.checkpoint.tensor_types & INT4_GRID_TYPES)  # 4-bit blocks: held as they are
                    try:
                        quantize_linears(model, self.weights, dtype, grid)
                    except ValueError as exc:
                        raise ModelLoadError(f"cannot keep this model's weights in {self.weights}: {exc}") from None
                self.model = model
            else:
                from engine.fallback import build_hf_model

                if getattr(self.config, "rope_freq_factors", None) is not None:
                    raise ModelLoadError(
                        "this GGUF's rope frequency factors (rope_freqs) are applied only on the fast "
                        "path, which this model cannot use (details in the log)"
                    )

                self.model = build_hf_model(self.config, state, dtype, self.device)
        except RuntimeError as exc:  # e.g. out of memory, or a shape mismatch caught by load_state_dict
            raise ModelLoadError(f"cannot place the model on {self.device} in {self.dtype}: {exc}") from exc
        del state
        self.checkpoint.release()  # the files give the weights again at the next re-placing
        if self._unfrozen:
            heap.settle()  # the new model out of the collector's full passes, as a load's is
            heap.trim()
            self._unfrozen = False
        progress(Progress("load", 1.0, "model ready"))

    def _load_draft(
        self,
        options: EngineOptions,
        progress: Callable[[Progress], None],
        cancelled: Optional[Callable[[], bool]] = None,
    ) -> Optional[Transformer]:
        """The draft model of `options` on this model's device and dtype, loaded once; None when the options
        name none or it cannot draft for this model (the reason is kept for unavailable()), or when `cancelled()`
        says at a progress point of its read that it is no longer wanted (nothing of it is kept, nothing refused:
        it is read again when next asked for)."""
        path = options.draft_model
        if options.speculation != "draft" or not path or not self.fast or self._draft_refusal(path):
            return None
        key = (path, str(self.device), self.dtype)
        if key in self._draft_models:
            return self._draft_models[key]
        from engine.loader import load_checkpoint
        from engine.speculative import vocabulary_mismatch

        def report(p: Progress) -> None:
            if cancelled is not None and cancelled():
                raise ReadStopped(f"the read of the draft model {path} was stopped")
            progress(p)

        dtype = TORCH_DTYPES[self.dtype]
        try:
            report(Progress("load", None, f"loading the draft model {path}"))
            draft = load_checkpoint(path, report, dtype=dtype, device=self.device)  # in the model's, as its own
        except ReadStopped as exc:  # before the handlers below: a read no longer wanted is no refusal of the draft
            log.info("%s", exc)
            return None
        except GaplessError as exc:
            self._refuse_draft(path, f"the draft model could not be loaded: {exc}")
            return None
        except Exception as exc:  # whatever else a damaged draft does, the model it drafts for still loads
            log.exception("draft model %s", path)
            self._refuse_draft(path, f"the draft model could not be loaded: {type(exc).__name__}: {one_line(exc)}")
            return None
        why = vocabulary_mismatch(self.tokenizer, draft.tokenizer, self.config.vocab_size, draft.config.vocab_size)
        if why is None:
            try:
                ModelArgs.from_hf_config(draft.config)
            except ValueError as exc:
                why = f"the draft model runs only on the fast path, and cannot: {exc}"
        if why is not None:
            self._refuse_draft(path, why)
            return None
        try:
            model = build_transformer(
                draft.config,
                draft.weights(dtype, self.device),
                dtype,
                self.device,
                consume=draft.materialise is not None,
            )
        except (ModelLoadError, RuntimeError) as exc:
            self._refuse_draft(path, f"the draft model could not be placed on {self.device}: {exc}")
            return None
        draft.release()
        self._draft_models = {key: model}  # one draft model at a time
        self._draft_proposer = None
        progress(Progress("load", 1.0, "draft model ready"))
        return model

    def _drop_other_drafts(self, options: EngineOptions) -> None:
        """Let go of a draft model (and its proposer's cache) other than the one `options` draft with, before that
        is read: one replaced by another was held with it while the other was read (or for good, where the other
        was refused). One that `options` do not draft with at all is kept: a bench or the ladder turns drafting off
        and on between runs, and a draft model read again each time brought its first-use costs into the timed
        runs; the app lets it go (release_unused_drafts)."""
        wanted = options.speculation == "draft" and options.draft_model
        if wanted and (options.draft_model, str(self.device), self.dtype) not in self._draft_models:
            self._forget_drafts()

    def release_unused_drafts(self) -> None:
        """Let go of the draft model (and its proposer's cache of the chat) when the options in force do not draft
        with it: turned off in the app, it stayed in memory until the model was loaded again."""
        with self._lock:
            if self.options.speculation != "draft" or not self.options.draft_model:
                self._forget_drafts()

    def _forget_drafts(self) -> None:
        """Let go of every draft model and the proposer with its cache of the chat."""
        self._draft_models.clear()
        self._draft_proposer = None

    def _refuse_draft(self, path: str, why: str) -> None:
        self._draft_refused[path] = (_on_disk(path), why)

    def _draft_refusal(self, path: str) -> Optional[str]:
        """Why the draft model at `path` cannot draft, while what is there is what was refused."""
        refused = self._draft_refused.get(path)
        if refused is None:
            return None
        if refused[0] != _on_disk(path):
            del self._draft_refused[path]
            return None
        return refused[1]

    def _start_monitor(self):
        from engine.telemetry.monitor import Monitor

        monitor = Monitor(self.device)
        monitor.start()
        return monitor

    @property
    def info(self) -> ModelInfo:
        from engine.quant import kernel_name, weight_bytes

        model = self._placed()
        params = (
            model.num_parameters() if isinstance(model, Transformer) else sum(p.numel() for p in model.parameters())
        )
        wbytes = weight_bytes(model)
        per_token, floor_ms, floor_source = self._memory_floor()
        return ModelInfo(
            name=self.checkpoint.name,
            family=self.config.model_type,
            architecture=(
                getattr(self.config, "architectures", None) or [f"{self.config.model_type} (from GGUF metadata)"]
            )[0],
            backend="fast" if self.fast else "transformers",
            backend_reason=self.fast_reason,
            parameters=int(params),
            dtype=self.dtype,
            device=str(self.device),
            context_length=self.context_length,
            weight_bytes=int(wbytes),
            source=self.checkpoint.source,
            source_kind=self.checkpoint.source_kind,
            weights=self.weights,
            weights_kernel=kernel_name(self.weights, self.device) if self.fast else "",
            bytes_per_token=per_token,
            bytes_per_token_source=BYTES_PER_TOKEN_SOURCE,
            memory_floor_ms=floor_ms,
            memory_floor_source=floor_source,
            load_seconds=self.load_seconds,
            load_seconds_source=LOAD_SECONDS_SOURCE if self.load_seconds is not None else "",
        )

    def _memory_floor(self) -> tuple[int, Optional[float], str]:
        """(weight bytes per decode token, the time reading them takes at the device's peak bandwidth or None,
        that time's source or why it is n/a)."""
        from engine.quant import bytes_per_token

        model = self._placed()
        if isinstance(model, Transformer):
            per_token = bytes_per_token(model, model.tok_embeddings, model.output)
        else:
            per_token = bytes_per_token(model, model.get_input_embeddings(), model.get_output_embeddings())
        if self.device.type == "cpu":
            from engine.telemetry.bandwidth import this_cpu

            bw, why = this_cpu()
            if bw is None:
                return per_token, None, f"n/a: the CPU's memory bandwidth could not be measured ({why})"
            source = (
                f"bytes per token / this CPU's measured read bandwidth, {bw.bytes_s / 1e9:.1f} GB/s ({bw.source}; "
                "a lower bound of its peak, so the floor is at or above the true one)"
            )
            return per_token, per_token / bw.bytes_s * 1e3, source
        peak = getattr(self.monitor, "peak_dram_bw_bytes_s", None) if hasattr(self, "monitor") else None
        if not peak:
            return per_token, None, "n/a: this GPU's peak bandwidth is unknown (needs NVML memory clock and bus width)"
        return per_token, per_token / peak * 1e3, "bytes per token / NVML peak bandwidth (memory clock x bus width x 2)"

    @property
    def context_length(self) -> int:
        if self.args is not None:  # from the config, so it is known while the weights are being placed again
            return self.args.max_seq_len
        return int(
            getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None) or 2048
        )

    def _placed(self) -> Union[Transformer, PreTrainedModel]:
        if self.model is None:
            raise GenerationError("the model is not on the device (the engine was closed, or placing it failed)")
        return self.model

    def _fast_model(self) -> Transformer:
        model = self._placed()
        if not isinstance(model, Transformer):
            raise TypeError(f"{self.config.model_type} runs on the transformers fallback, not the fast path")
        return model

    # ---- options ------------------------------------------------------------------------------------------
    def unavailable(self, options: Optional[EngineOptions] = None) -> dict[str, str]:
        """Option -> why it cannot be honoured on this model and machine."""
        o = options or self.options
        out: dict[str, str] = {}
        if o.device == "cuda" and not torch.cuda.is_available():
            out["device"] = "CUDA is not available on this machine"
        on_cuda = _target_device(o.device).type == "cuda"
        fused = False
        if o.kernels == "fused":
            why = self._fused_unavailable(o)
            if why:
                out["kernels"] = why
            else:
                fused = True
                if o.kv_cache != "static":
                    out["kv_cache"] = "the fused kernels run on the static KV cache (switch them off for another cache)"
        kv_cache = "static" if fused else o.kv_cache
        if o.cuda_graph:
            if not on_cuda:
                out["cuda_graph"] = "CUDA graphs need a CUDA device; this machine runs on the CPU"
            elif not self.fast:
                out["cuda_graph"] = f"{self._on_fallback()}, which has no captured step"
            elif kv_cache != "static":
                out["cuda_graph"] = "CUDA graphs need the static KV cache (fixed shapes and addresses)"
        if o.compile:
            if not self.fast:
                out["compile"] = f"{self._on_fallback()}, which is not compiled"
            elif fused:
                out["compile"] = "the fused kernels replace the compiled decode step"
            elif o.kv_cache != "static":
                out["compile"] = "compile needs the static KV cache (shapes change every step otherwise)"
        if o.kv_cache == "static" and not self.fast:
            out["kv_cache"] = f"{self._on_fallback()}, which uses its own dynamic cache"
        if o.dtype == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
            out["dtype"] = "this GPU has no bf16 support"
        if o.weights != "native":
            why = self._weights_unavailable(o.weights, _target_device(o.device))
            if why:
                out["weights"] = why
        why = self._speculation_unavailable(o, fused)
        if why:
            out["speculation"] = why
        return out

    def _fused_unavailable(self, o: EngineOptions) -> Optional[str]:
        if self.args is None:  # not self.fast
            return f"{self._on_fallback()}, which has no fused kernels"
        if self._fused_failed:
            return self._fused_failed
        if o.weights != "native" and not self._weights_unavailable(o.weights, _target_device(o.device)):
            # (a format refused here leaves the model's own dtype running: the fused kernels serve it)
            return (
                f"the fused kernels read the weights in the model's dtype; {o.weights} weights run on the torch kernels"
            )
        from engine.kernels import unavailable_reason

        return unavailable_reason(self.args, _target_device(o.device))

    def fused_status(self) -> Optional[dict[str, object]]:
        """Whether the fused runners launch with Programmatic Dependent Launch, and why (None before any ran on
        the weights placed now). Kept once its runner is evicted from the runner cache: it said None then, as if
        the fused kernels had never run."""
        runner = next((r for k, r in self._runners.items() if k[2] == "fused"), None)
        if runner is None:
            return self._fused_pdl
        from engine.kernels.runner import FusedRunner

        assert isinstance(runner, FusedRunner)  # the runners keyed "fused" are made so in _runner
        return {"pdl": runner.use_pdl, "pdl_reason": runner.pdl_reason}

    def _speculation_unavailable(self, o: EngineOptions, fused: Optional[bool] = None) -> Optional[str]:
        """Why drafting cannot run with `o`; `fused`: whether the fused kernels run (worked out from `o` where not
        given: asked for and not refused; refused, the torch kernels run and verify drafts)."""
        if fused is None:
            fused = o.kernels == "fused" and self._fused_unavailable(o) is None
        if o.speculation == "off":
            return None
        if not self.fast:
            return f"{self._on_fallback()}, which has no verify step"
        if o.kv_cache != "static":
            return "speculation needs the static KV cache (drafts are verified in place, rejected ones dropped by moving its position)"
        if o.candidates > 1:
            return (
                "speculation verifies the drafts of one answer; several candidates would accept different numbers "
                "of tokens per step"
            )
        if fused:
            return (
                "the fused kernels have no verify step for drafts: speculation needs the torch kernels (Kernels: "
                "torch, or --kernels torch)"
            )
        if o.speculation == "draft":
            if not o.draft_model:
                return "no draft model chosen (the Draft model control, or --draft-model PATH)"
            return self._draft_refusal(o.draft_model)
        return None

    def _weights_unavailable(self, fmt: str, device: torch.device) -> Optional[str]:
        from engine.quant import why_not

        args = self._fast_args() if self.fast else None
        if args is None:
            return f"{self._on_fallback()}, whose linears are transformers' own"
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        shapes = {
            "wqkv": (q + 2 * kv, args.dim),
            "wo": (args.dim, q),
            "w13": (2 * args.intermediate_size, args.dim),
            "w2": (args.dim, args.intermediate_size),
            "output": (args.vocab_size, args.dim),
        }
        return why_not(fmt, shapes, device)

    def _on_fallback(self) -> str:
        why = f" ({self.fast_reason})" if self.fast_reason else ""
        return f"{self.config.model_type} runs on the transformers fallback{why}"

    def effective(self, options: EngineOptions) -> tuple[EngineOptions, dict[str, str]]:
        """The options a generation actually runs with (device and dtype resolved), and why any changed."""
        reasons = self.unavailable(options)
        eff = options
        if "cuda_graph" in reasons:
            eff = replace(eff, cuda_graph=False)
        if "compile" in reasons:
            eff = replace(eff, compile=False)
        if "kernels" in reasons:
            eff = replace(eff, kernels="torch")
        if "kv_cache" in reasons:
            eff = replace(eff, kv_cache="static" if eff.kernels == "fused" else "dynamic")
        if "dtype" in reasons:
            eff = replace(eff, dtype="fp16")
        if "speculation" in reasons:
            eff = replace(eff, speculation="off")
        if "weights" in reasons:
            eff = replace(eff, weights="native")
        device = _target_device(eff.device)
        return replace(eff, device=device.type, dtype=resolve_dtype(eff.dtype, device)), reasons

    def reconfigure(
        self,
        options: EngineOptions,
        progress: Optional[Callable[[Progress], None]] = None,
        cancelled: Optional[Callable[[], bool]] = None,
    ) -> None:
        """Switch options for the next generation. Waits for a running generation; weights are re-placed only
        when device, dtype or weight format change (from the loaded checkpoint, so precision is never lost).
        A draft model's read stops at its next progress point once `cancelled()` is true: the options are in
        force without it, and it is read when next needed."""
        progress = progress or _noop
        options = options.validate()
        with self._lock:
            eff, _ = self.effective(options)
            device = torch.device(eff.device)
            # no model (placing the previous weights again after a failed switch failed too): any switch builds one
            moved = device != self.device or eff.dtype != self.dtype or eff.weights != self.weights
            if moved or self.model is None:
                self.checkpoint.can_read_again()  # a file that changed: said before the model in use is given up
                placed = (self.device, self.dtype, self.weights)
                self.device, self.dtype, self.weights = device, eff.dtype, eff.weights
                failed: Optional[Exception] = None
                try:
                    self._build_model(progress)
                except Exception as exc:
                    failed = exc
                if failed is not None:
                    # the switch failed (out of memory, weights a format cannot hold): the previous placement
                    # again, so the engine keeps answering as it did, and the caller hears why
                    self._place_again(placed, failed, progress)
                    raise failed
                self.monitor.close()
                self.monitor = self._start_monitor()
            self._drop_other_drafts(options)
            self._load_draft(options, progress, cancelled)
            self.options = options

    def _place_again(
        self, placed: tuple[torch.device, str, str], failed: Exception, progress: Callable[[Progress], None]
    ) -> None:
        """Place the weights as `placed` (device, dtype, weights) after a switch failed with `failed`. What the failed
        attempt held (its partial model, the weights it read) is referenced from the exception's frames until they
        are cleared; cleared first, so both are never held at once (on a GPU the first may be why it failed)."""
        self.device, self.dtype, self.weights = placed
        err: Optional[BaseException] = failed
        while err is not None:
            traceback.clear_frames(err.__traceback__)
            err = err.__cause__ or err.__context__
        heap.collect()  # on the thread that owns the passes (the GUI's, in the app)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        progress(Progress("load", None, "the switch failed; placing the previous weights again"))
        try:
            self._build_model(progress)
        except Exception:
            log.exception("the previous weights could not be placed again after a failed switch")

    # ---- generation ---------------------------------------------------------------------------------------
    def _runner(self, opts: EngineOptions, batch: int, needed: int) -> RunnerBase:
        length = bucket_for(needed, self.context_length)
        key = (opts.kv_cache, batch, opts.kernels)
        runner = self._runners.get(key)
        if runner is not None and runner.length >= length:
            self._runners[key] = self._runners.pop(key)  # the most recently used last
            return runner
        if runner is not None:
            length = max(length, runner.length)
        old = self._runners.pop(key, None)
        while len(self._runners) >= MAX_RUNNERS:  # the least recently used go before the new cache is made
            self._runners.pop(next(iter(self._runners)))
        if not self.fast:
            from engine.fallback import HFRunner

            runner = HFRunner(
                self.model, batch, length, self.config.vocab_size, self.eos_ids, self.device, opts.kv_cache
            )
        elif opts.kernels == "fused":
            from engine.kernels.runner import FusedRunner

            runner = FusedRunner(
                self._fast_model(), batch, length, self.eos_ids, self.device, TORCH_DTYPES[self.dtype], self._pdl_failed
            )
        elif opts.kv_cache == "static":
            runner = StaticRunner(
                self._fast_model(), batch, length, self.eos_ids, self.device, TORCH_DTYPES[self.dtype]
            )
        elif opts.kv_cache == "dynamic":
            runner = DynamicRunner(self._fast_model(), batch, length, self.eos_ids, self.device)
        else:
            runner = NoCacheRunner(self._fast_model(), batch, length, self.eos_ids, self.device)
        if old is not None:
            self._prefix.carry(old, runner)
        self._runners[key] = runner
        return runner

    def _prepare_compile(self, runner: StaticRunner, opts: EngineOptions) -> None:
        want = opts.compile
        if want:
            # Every runner's step is the same code object, so each dtype x candidates x context bucket x sampler
            # kind is one more recompile of it; past dynamo's limit (8 by default) it would run eagerly while
            # saying "compiled". Room for what a long session of option switches reaches.
            import torch._dynamo

            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        if want and runner.compiled is None:
            runner.compile_step(symbolic_bucket=self.device.type != "cuda")
        elif not want and runner.compiled is not None:
            runner.set_compiled(None)

    def generate(
        self,
        messages: list[dict],
        sampling: SamplingParams,
        on_event: Optional[Callable] = None,
        cancel: Optional[threading.Event] = None,
        raw: bool = False,
        overflow: str = "rolling",
    ) -> GenerationResult:
        """Generate with the current options. A compile failure falls back to eager; running out of device
        memory before any text left falls back to no CUDA graph, then to fewer candidates; each with a notice."""
        from engine.prompt import build_prompt, format_stops

        sampling = sampling.validate()
        on_event = on_event or _noop
        cancel = cancel or threading.Event()
        with self._lock, torch.inference_mode():
            opts, reasons = self.effective(self.options)
            try:
                with stopped_by(cancel):
                    prompt = build_prompt(
                        self.tokenizer,
                        messages,
                        self.context_length,
                        sampling.max_new_tokens,
                        raw=raw,
                        overflow=overflow,
                    )
            except PromptStopped as exc:  # the user's Stop while the prompt was made: no token exists yet
                stop = PrefillCancelled(0, 0, str(exc))
                return self._stopped_reading(stop, None, opts, reasons, sampling.seed, [], overflow, "")
            notices = list(prompt.notices)
            if not prompt.ids:
                raise GenerationError("the prompt is empty after tokenization")
            added = [s for s in format_stops(self.tokenizer, raw) if s not in sampling.stop]
            if added:
                sampling = replace(sampling, stop=(*sampling.stop, *added))
            room = self.context_length - len(prompt.ids)
            max_new = min(sampling.max_new_tokens, room)
            if max_new < 1:
                raise GenerationError(f"the prompt fills the whole {self.context_length}-token context")
            if max_new < sampling.max_new_tokens:
                notices.append(f"answer limited to {max_new} tokens by the {self.context_length}-token context")
            seed = sampling.seed if sampling.seed is not None else random.randrange(2**63)
            streamed = []

            def watch(event) -> None:
                if isinstance(event, TextDelta):
                    streamed.append(True)
                on_event(event)

            while True:
                try:
                    attempt = self._run(prompt.ids, max_new, sampling, opts, seed, watch, cancel, raw)
                    break
                except torch.OutOfMemoryError as exc:
                    self._free_device_memory()
                    if streamed:
                        raise GenerationError(f"out of device memory while generating: {exc}") from exc
                    opts, option, reason, notice = self._smaller(opts)
                    reasons[option] = reason
                    notices.append(notice)
        opts, reasons, notices = attempt.opts, {**reasons, **attempt.reasons}, notices + attempt.notices
        if attempt.stopped is not None:
            return self._stopped_reading(
                attempt.stopped, len(prompt.ids), opts, reasons, seed, notices, overflow, prompt.cut
            )
        loop = attempt.loop
        assert loop is not None
        kind = SamplerKind.of(sampling)
        if opts.candidates > 1 and (kind.greedy or sampling.top_k == 1):  # as many as ran (out of memory: fewer)
            why, fix = (
                (f"greedy decoding (temperature {sampling.temperature:g})", "raise the temperature")
                if kind.greedy
                else ("top-k 1 keeps only the likeliest token, so sampling", "raise top-k (0: off)")
            )
            notices.append(
                f"the {opts.candidates} candidates are one answer {opts.candidates} times: {why} picks the same "
                f"tokens in every row; {fix} for different ones"
            )
        if "speculation" in reasons:  # asked for and not run: the figures say why, as the options' entry does
            speculation_off(loop.metrics, reasons["speculation"])
        loop.metrics.overflow_policy = overflow
        loop.metrics.prompt_cut = prompt.cut or None
        return GenerationResult(
            texts=[r.text for r in loop.rows],
            token_ids=[list(r.tokens) for r in loop.rows],
            finish_reasons=[r.reason for r in loop.rows],
            metrics=loop.metrics,
            options=opts,
            unavailable=reasons,
            seed=seed,
            notices=notices,
            limits=option_limits(self),
        )

    def forget_prefix(self) -> None:
        """The next generation starts from an empty cache (benchmarks)."""
        with self._lock:
            self._prefix.clear()

    def measure_prompt(self, messages: list[dict], max_new_tokens: int, overflow: str = "rolling"):
        """engine.types.ContextUse of `messages`: the prompt rendering of generate(), without the engine lock, so
        it answers while a generation runs (the tokenizer is only read)."""
        from engine.prompt import measure_prompt

        return measure_prompt(self.tokenizer, messages, self.context_length, max_new_tokens, overflow)

    def _run(
        self,
        prompt_ids: list[int],
        max_new: int,
        sampling: SamplingParams,
        opts: EngineOptions,
        seed: int,
        on_event: Callable[[object], None],
        cancel: threading.Event,
        raw: bool = False,
    ) -> _Attempt:
        """One try at the generation with `opts`; what it finds (options it had to give up, notices) comes back
        in the attempt; `raw`: the answer continues the prompt's text (stream.RowText's lead). Out of device memory propagates: the caller tries smaller options from scratch."""
        from engine.telemetry.window import ProfileWindow

        reasons: dict[str, str] = {}
        notices: list[str] = []
        runner = self._runner(opts, opts.candidates, len(prompt_ids) + max_new)
        kind = SamplerKind.of(sampling)
        compile_s: Optional[float] = None  # the compile / capture warm-up of this generation
        runner.sampler.set_params(sampling)
        if opts.kernels == "fused":
            t_compile = time.perf_counter()
            with preserved(runner):  # its warm-up writes the first positions too
                runner, failed = self._warm_fused(runner, opts, sampling, len(prompt_ids), max_new, on_event)
            if failed is None:  # the kernels' first launches compile them; with graphs on, the step is captured
                compile_s = time.perf_counter() - t_compile
            else:
                reasons["kernels"] = failed
                notices.append(
                    "the fused kernels failed to compile or run, so this generation ran on the torch kernels "
                    "(details in the log)"
                )
                opts = replace(opts, kernels="torch")
        static = runner if isinstance(runner, StaticRunner) and opts.kernels == "torch" else None  # the torch step
        # a seeded sampled answer is the same every time: the adaptive schedule then models step times
        seeded = sampling.seed is not None and not SamplerKind.of(sampling).greedy
        spec = self._speculator(opts, static, on_event, seeded, cancel.is_set) if static is not None else None
        if opts.speculation != "off" and spec is None:
            # not refused, so its read was given up: only Stop ends a read an answer started
            stopped = DRAFT_READ_STOPPED if cancel.is_set() else "the draft model is not loaded"
            reasons["speculation"] = self._speculation_unavailable(opts) or stopped
            notices.append(f"speculation off for this answer: {reasons['speculation']}")
            opts = replace(opts, speculation="off")
        verify_ks = (spec.shapes or ()) if spec is not None else ()
        if static is not None:
            self._prepare_compile(static, opts)
            static.use_graphs = opts.cuda_graph
            if opts.compile or opts.cuda_graph:
                t_compile = time.perf_counter()
                stage = "capture" if opts.cuda_graph else "compile"
                buckets = static.buckets_for(len(prompt_ids), max_new, max(verify_ks, default=0))
                try:
                    with preserved(static, verify_ks):  # the cached prefix survives the warm-up's writes
                        static.warm_up(
                            buckets, kind, opts.cuda_graph, lambda m, f: on_event(Progress(stage, f, m)), verify_ks
                        )
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # inductor/dynamo failures: the step still runs eagerly
                    if not opts.compile:
                        raise
                    log.exception("compile failed; falling back to eager")
                    static.set_compiled(None)
                    reasons["compile"] = f"compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    notices.append("torch.compile failed, so this generation ran eagerly (details in the log)")
                    opts = replace(opts, compile=False)
                    with preserved(static, verify_ks):
                        static.warm_up(
                            buckets, kind, opts.cuda_graph, lambda m, f: on_event(Progress(stage, f, m)), verify_ks
                        )
                compile_s = time.perf_counter() - t_compile
                done = "captured" if opts.cuda_graph else "compiled" if opts.compile else "warmed up"
                on_event(Progress(stage, 1.0, f"decode step {done} in {compile_s:.1f} s"))
        torch.manual_seed(seed)
        lead = tuple(prompt_ids[-LEAD_TOKENS:]) if raw else ()
        rows = [RowText(self.tokenizer, set(self.eos_ids), sampling.stop, lead) for _ in range(opts.candidates)]
        prompt_t = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        window = ProfileWindow(self.device, enabled=opts.profile_window)
        plan = self._prefix.plan(runner, list(prompt_ids), opts.prefix_reuse)
        self._prefix.forget(runner)  # rewritten from here on; remembered again once the generation is complete
        T = len(prompt_ids)
        chunk = PREFILL_CHUNK if T - plan.start > PREFILL_CHUNK else None

        def reading(done: int, total: int) -> None:
            on_event(Progress("prefill", done / total, f"reading the conversation: {done:,} of {total:,} tokens"))

        observers = [
            WindowObserver(window),  # first: it closes before anything else runs after its last step
            reader_for(runner, host_reads=opts.sampling == "host" or spec is not None),
            TextFlush(on_event),
            MonitorDrain(self.monitor, on_event),
            PeakMemory(),
        ]
        try:
            loop = run_loop(
                runner,
                prompt_t,
                kind,
                max_new,
                rows,
                cancel,
                observers,
                spec=spec,
                prefill=prefill_fn(runner, plan, chunk, reading if chunk else None, cancel),
            )
        except PrefillCancelled as exc:
            window.discard()
            self._prefix.remember_read(runner, list(prompt_ids[: exc.done]))
            exc.reused = plan.start
            exc.compile_seconds = compile_s
            return _Attempt(opts, stopped=exc, reasons=reasons, notices=notices)
        except BaseException:
            window.discard()  # a profiler left running would record every later op and block every later window
            raise
        _put_compile(loop.metrics, compile_s)
        # The answer's tokens whose keys and values the cache holds: one a step, or, speculating, every token a
        # verify step fed and accepted (host_pos is the position of the next token to feed).
        fed = (
            runner.host_pos - T if spec is not None and isinstance(runner, StaticRunner) else loop.metrics.decode_steps
        )
        self._prefix.remember(runner, list(prompt_ids), fed)
        m = loop.metrics
        m.put("prompt_reused_tokens", plan.start, plan.source)
        m.put("prompt_computed_tokens", T - plan.start)
        if T == plan.start:  # a Regenerate: the whole prompt, and its last logits, came from the cache
            m.mark_na("prefill_tok_s", "nothing was computed: the whole prompt came from the cache")
        elif m.ttft_ms:  # the prefill's rate is of the positions it computed
            m.put("prefill_tok_s", (T - plan.start) / (m.ttft_ms / 1e3))
        return _Attempt(opts, loop=loop, reasons=reasons, notices=notices)

    def _warm_fused(
        self,
        runner: RunnerBase,
        opts: EngineOptions,
        sampling: SamplingParams,
        prompt_len: int,
        max_new: int,
        on_event: Callable[[object], None],
    ) -> tuple[RunnerBase, Optional[str]]:
        """Compile (and capture) the fused step. A failure with PDL on is tried once more without it; any other
        failure ends the fused kernels for this engine: returns the torch runner to run on, and why."""
        from engine.kernels.runner import FusedRunner

        assert isinstance(runner, FusedRunner)
        fused = runner

        def progress(message: str, fraction: float) -> None:
            on_event(Progress("capture" if opts.cuda_graph else "compile", fraction, message))

        kind = SamplerKind.of(sampling)
        fused.use_graphs = opts.cuda_graph
        buckets = fused.buckets_for(prompt_len, max_new)
        t_warm = time.perf_counter()
        try:
            try:
                with preserved(fused):  # a cached prefix survives the warm-up's writes at position 0
                    fused.warm_up(buckets, kind, opts.cuda_graph, progress)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if not fused.use_pdl:
                    raise
                log.exception("the fused step failed with Programmatic Dependent Launch; trying without it")
                fused.use_pdl = False
                fused.pdl_reason = f"failed here: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                self._pdl_failed = fused.pdl_reason  # a runner made after this one's eviction is not tried with it
                fused.graphs.clear()
                fused.graph_pool = None
                with preserved(fused):
                    fused.warm_up(buckets, kind, opts.cuda_graph, progress)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # a kernel that does not compile or launch here
            log.exception("the fused kernels failed; falling back to the torch kernels")
            self._fused_failed = (
                f"the fused kernels failed here: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            )
            self._runners.pop((opts.kv_cache, opts.candidates, "fused"), None)
            torch_runner = self._runner(replace(opts, kernels="torch"), opts.candidates, prompt_len + max_new)
            torch_runner.sampler.set_params(sampling)
            return torch_runner, self._fused_failed
        self._fused_pdl = {"pdl": fused.use_pdl, "pdl_reason": fused.pdl_reason}
        # the last word of the warm-up, as the torch step's: "compiling the fused kernels" stayed said after it
        done = "compiled and captured" if opts.cuda_graph else "compiled"
        progress(f"fused kernels {done} in {time.perf_counter() - t_warm:.1f} s", 1.0)
        return fused, None

    def _speculator(
        self,
        opts: EngineOptions,
        runner: StaticRunner,
        on_event: Callable,
        seeded: bool = False,
        cancelled: Optional[Callable[[], bool]] = None,
    ) -> Optional[Speculator]:
        """The speculation of this generation, or None when off (or the draft model cannot be had, or its read
        was stopped)."""
        if opts.speculation == "off":
            return None
        k = opts.draft_tokens
        schedule = f"{k} drafts per step" if k else f"adaptive k (one of {', '.join(map(str, ADAPTIVE_KS))})"
        if seeded and not k:
            schedule += ", step times modelled for the seed"
        shapes = ((k,) if k else ADAPTIVE_KS) if opts.compile or opts.cuda_graph else None
        if opts.speculation == "ngram":
            source = f"engine counters: n-gram prompt lookup (n = {NGRAM_MAX}..1) on the host, {schedule}"
            return Speculator(NgramProposer(), k, shapes, source, reproducible=seeded)
        model = self._load_draft(opts, on_event, cancelled)
        if model is None:
            return None
        # Kept from answer to answer while the draft model and the cache's length stay: its cache holds the
        # conversation so far (DraftProposer.reset keeps the prefix the next prompt shares).
        proposer = self._draft_proposer
        if proposer is None or not proposer.serves(model, runner.length):
            proposer = DraftProposer(
                model, runner.length, TORCH_DTYPES[self.dtype], self.device, self.config.vocab_size
            )
            self._draft_proposer = proposer
        source = f"engine counters: draft model {model_file_name(opts.draft_model)}, greedy, {schedule}"
        return Speculator(proposer, k, shapes, source, reproducible=seeded)

    def _stopped_reading(
        self,
        exc: PrefillCancelled,
        prompt_tokens: Optional[int],
        opts: EngineOptions,
        reasons: dict,
        seed: Optional[int],
        notices: list[str],
        overflow: str,
        cut: str,
    ) -> GenerationResult:
        """A stop while the prompt was read, or (prompt_tokens None) while it was made (the chat template's render,
        the tokenizing): no token exists yet, so every candidate's answer is empty."""
        n = opts.candidates
        m = GenerationMetrics(
            prompt_tokens=prompt_tokens or 0, new_tokens=[0] * n, overflow_policy=overflow, prompt_cut=cut or None
        )
        if prompt_tokens is None:
            for key in ("prompt_tokens", "prompt_reused_tokens", "prompt_computed_tokens", "compile_seconds"):
                m.mark_na(key, "stopped before the prompt was made")
        else:
            m.put("prompt_reused_tokens", exc.reused, "stopped while reading: the positions read before the stop")
            m.put("prompt_computed_tokens", exc.done - exc.reused)
            _put_compile(m, exc.compile_seconds)
        for key in figures.REMOTE_ONLY:
            m.mark_na(key, NOT_REMOTE)
        for f in figures.GENERATION_FIGURES:  # every other figure of a token or a step: there was none
            if getattr(m, f.key) is None and f.key not in m.unavailable:
                m.mark_na(f.key, "stopped before the first token")
        return GenerationResult(
            texts=[""] * n,
            token_ids=[[] for _ in range(n)],
            finish_reasons=["cancelled"] * n,
            metrics=m,
            options=opts,
            unavailable=reasons,
            seed=seed,
            notices=[*notices, str(exc)],
            limits=option_limits(self),
        )

    @staticmethod
    def _smaller(opts: EngineOptions) -> tuple[EngineOptions, str, str, str]:
        """After running out of device memory: (the next, smaller options to try, the option given up, why,
        the notice for the user)."""
        if opts.cuda_graph:
            return (
                replace(opts, cuda_graph=False),
                "cuda_graph",
                "ran out of device memory with it on",
                "out of device memory with the CUDA graph on: ran without it",
            )
        if opts.candidates > 1:
            fewer = max(1, opts.candidates // 2)
            return (
                replace(opts, candidates=fewer),
                "candidates",
                f"out of device memory at {opts.candidates}",
                f"out of device memory with {opts.candidates} candidates: ran {fewer}",
            )
        raise GenerationError("out of device memory, even with one candidate and no CUDA graph")

    def _free_device_memory(self) -> None:
        self._runners.clear()
        self._prefix.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        with self._lock:
            self.monitor.close()
            self._runners.clear()
            self.model = None
            self._forget_drafts()  # a draft model and its cache of the chat go with the model drafted for
            heap.release()  # cycles among what was frozen with the model (compiled steps hold some) go now
            heap.trim()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def _put_compile(metrics: GenerationMetrics, seconds: Optional[float]) -> None:
    """The compile figure of a generation: its compile / capture warm-up, or why there was none."""
    if seconds is not None:
        metrics.put("compile_seconds", seconds)
    else:
        metrics.mark_na("compile_seconds", "compile and CUDA graph off: nothing is compiled or captured")


def _compile_cache():
    from engine.paths import compile_cache_dir

    return compile_cache_dir()


def _on_disk(path: str) -> tuple:
    """What is at a model path, to tell whether it changed: each file's name, size and time (a folder's files)."""
    p = user_path(path)
    try:
        entries = sorted(p.iterdir()) if p.is_dir() else [p]
        return tuple((e.name, st.st_size, st.st_mtime_ns) for e in entries for st in (e.stat(),))
    except OSError:
        return ("unreadable",)
