"""What the app needs of an engine: the embedded engine (engine.engine.Engine, fast path or transformers
fallback), a remote one, and the tests' scripted engine all provide it."""

from __future__ import annotations

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

    def reconfigure(self, options: EngineOptions, progress: Optional[Callable[[Progress], None]] = None) -> None: ...

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


EngineFactory = Callable[[str, EngineOptions, Optional[Callable[[Progress], None]]], EngineLike]
