"""What the app needs of an engine: the embedded engine (engine.engine.Engine, fast path or transformers
fallback), a remote one, and the tests' scripted engine all provide it."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from engine.types import EngineOptions, Event, GenerationResult, ModelInfo, Progress, SamplingParams


@runtime_checkable
class EngineLike(Protocol):
    options: EngineOptions  # the options in force (the next generation uses them)

    @property
    def info(self) -> ModelInfo: ...

    def unavailable(self, options: Optional[EngineOptions] = None) -> dict[str, str]:
        """Option -> why it cannot be honoured with this model on this machine."""
        ...

    def reconfigure(
        self,
        options: EngineOptions,
        progress: Optional[Callable[[Progress], None]] = None,
        cancelled: Optional[Callable[[], bool]] = None,  # true once a long read (a draft model's) is not wanted
    ) -> None: ...

    def generate(
        self,
        messages: list[dict],
        sampling: SamplingParams,
        on_event: Optional[Callable[[Event], None]] = None,
        cancel: Optional[threading.Event] = None,
        raw: bool = False,
        overflow: str = "rolling",  # what a prompt longer than the context does (engine.types.OVERFLOW_POLICIES)
    ) -> GenerationResult: ...

    def measure_prompt(self, messages: list[dict], max_new_tokens: int, overflow: str = "rolling") -> Any:
        """What the conversation would take of the context (engine.types.ContextUse), for the context meter."""
        ...

    def close(self) -> None: ...


log = logging.getLogger(__name__)

# The sampling settings OpenAI's API lacks that Gapless's own engine takes (SamplingParams.top_k and
# .repetition_penalty); a remote engine takes those its server is known to (engine.remote.SAMPLING_EXTENSIONS).
SAMPLING_EXTENSION_NAMES = ("top_k", "repetition_penalty")

EngineFactory = Callable[[str, EngineOptions, Optional[Callable[[Progress], None]]], EngineLike]


def sampling_extensions(engine: Any) -> tuple[str, ...]:
    """Those of SAMPLING_EXTENSION_NAMES the engine honours: all of them on the embedded engine, those its server
    passes on where the model is remote (what a Gapless server lists for its model; a client sending others is
    refused)."""
    passes_on = getattr(engine, "passes_on", None)
    return tuple(n for n in SAMPLING_EXTENSION_NAMES if passes_on is None or passes_on(n))


def option_limits(engine: EngineLike) -> dict[tuple[str, Any], str]:
    """{(option, value): reason} for the values the engine cannot run on its model and the device in use whatever
    the other options are (the device itself is one of them: the fused kernels on a CPU run would run on CUDA).
    Each value is asked about from the options in force with the others set as it needs them: the torch kernels,
    no drafts and one candidate unless the probe is for one of them; compile and CUDA graphs with the static
    cache; the fused kernels with the model's own weights; speculation on the static cache. A probe that fails
    (e.g. a Triton that imports but breaks) is logged and left out: it never costs an answer, a load or a switch,
    and the value it asked about is refused with its reason when it is chosen."""
    base = engine.options.with_(kernels="torch", speculation="off", candidates=1)
    probes = {
        ("device", "cuda"): base.with_(device="cuda"),
        ("dtype", "bf16"): base.with_(dtype="bf16"),
        ("kv_cache", "static"): base.with_(kv_cache="static"),
        ("compile", True): base.with_(kv_cache="static", compile=True),
        ("cuda_graph", True): base.with_(kv_cache="static", compile=True, cuda_graph=True),
        ("kernels", "fused"): base.with_(kv_cache="static", kernels="fused", weights="native"),
        ("weights", "int8"): base.with_(weights="int8"),
        ("weights", "int4"): base.with_(weights="int4"),
        ("speculation", "ngram"): base.with_(kv_cache="static", speculation="ngram"),
    }
    out: dict[tuple[str, Any], str] = {}
    for (name, value), probe in probes.items():
        try:
            why = engine.unavailable(probe).get(name)
        except Exception:
            log.warning("checking whether %s=%r can run failed", name, value, exc_info=True)
            continue
        if why:
            out[(name, value)] = why
    return out
