"""A generation's telemetry kept as a file: the step records and monitor samples as they streamed, the final
figures with their sources, the options, the model and the machine, in a versioned JSON document.

`gapless generate --telemetry-out FILE` writes one, the GPU check writes one from the GPU it runs on, and
`gapless replay FILE` shows it in the HUD on a machine that has Qt (the GPU machine has none). Reading is
strict: a file that is not ours, of another version or with a field of the wrong type is refused with where
and why; nothing in it is executed (plain JSON, never pickle).
"""

from __future__ import annotations

import json
import math
import re
import stat
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

from engine import figures
from engine.errors import GaplessError
from engine.paths import output_file, write_whole
from engine.types import (
    EngineOptions,
    Event,
    GenerationMetrics,
    GenerationResult,
    MonitorSample,
    StepRecord,
    limits_as_list,
    limits_from_list,
)

FORMAT = "gapless-telemetry"
VERSION = 1
MAX_BYTES = 64 << 20  # a recording of a long answer with samples at 10 Hz is a few MB


class RecordingError(GaplessError):
    pass


@dataclass
class Recording:
    label: str  # what the HUD calls the generation
    options: EngineOptions
    metrics: GenerationMetrics
    steps: list[StepRecord] = field(default_factory=list)
    samples: list[MonitorSample] = field(default_factory=list)
    t_start: Optional[float] = None  # the engine clock (perf_counter) when the prompt went in
    t_end: Optional[float] = None
    model: dict[str, Any] = field(default_factory=dict)  # ModelInfo.to_dict()
    machine: dict[str, Any] = field(default_factory=dict)  # engine.telemetry.machine.describe_machine()
    created: float = field(default_factory=time.time)
    unavailable: dict[str, str] = field(default_factory=dict)  # option asked for -> why it could not run there
    limits: dict[tuple[str, Any], str] = field(default_factory=dict)  # (option, value) never run there -> why

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "label": self.label,
            "options": self.options.to_dict(),
            "unavailable": dict(self.unavailable),
            "limits": limits_as_list(self.limits),
            "metrics": self.metrics.to_dict(),
            "t_start": self.t_start,
            "t_end": self.t_end,
            "steps": [asdict(s) for s in self.steps],
            "samples": [_sample_dict(s) for s in self.samples],
            "model": self.model,
            "machine": self.machine,
        }


class Recorder:
    """Wraps a generation's event callback and keeps the step records and monitor samples it passes on."""

    def __init__(
        self, on_event: Optional[Callable[[Event], None]] = None, clock: Callable[[], float] = time.perf_counter
    ):
        self._on_event = on_event
        self._clock = clock
        self.steps: list[StepRecord] = []
        self.samples: list[MonitorSample] = []
        self.t_start = clock()

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepRecord):
            self.steps.append(event)
        elif isinstance(event, MonitorSample):
            self.samples.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def finish(
        self,
        result: GenerationResult,
        label: str,
        model: Optional[dict[str, Any]] = None,
        machine: Optional[dict[str, Any]] = None,
    ) -> Recording:
        return Recording(
            label=label,
            options=result.options,
            metrics=result.metrics,
            steps=list(self.steps),
            samples=list(self.samples),
            t_start=self.t_start,
            t_end=self._clock(),
            model=dict(model or {}),
            machine=dict(machine or {}),
            unavailable=dict(result.unavailable),
            limits=dict(result.limits),
        )


def save(recording: Recording, path: Path) -> None:
    """Written whole or not at all (engine.paths.write_whole), where engine.paths.output_file allows."""
    target = output_file(path, "the telemetry")
    try:
        write_whole(target, figures.strict_json(recording.to_dict(), ensure_ascii=False))
    except OSError as exc:  # a full disk: said in one line, the answer already given
        raise RecordingError(f"cannot write the telemetry to {path}: {exc.strerror or exc}") from exc


def load(path: Path) -> Recording:
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise RecordingError(f"cannot read the telemetry file {path}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise RecordingError(f"cannot read the telemetry file {path}: it is a folder")
    if not stat.S_ISREG(st.st_mode):  # a FIFO waited forever, /dev/zero filled the memory
        raise RecordingError(f"cannot read the telemetry file {path}: it is not a regular file")
    if st.st_size > MAX_BYTES:
        raise RecordingError(
            f"{path} is {st.st_size / 2**20:.0f} MiB; a telemetry file is at most {MAX_BYTES >> 20} MiB"
        )
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)  # a file that grew since: read no more than a telemetry file can hold
        if len(data) > MAX_BYTES:
            raise RecordingError(f"{path} is larger than a telemetry file can be ({MAX_BYTES >> 20} MiB)")
        doc = json.loads(data.decode("utf-8-sig"))  # a BOM an editor added when saving it is not part of it
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: JSONDecodeError, an integer of 4,300+ digits
        raise RecordingError(f"{path} is not a telemetry file (not valid JSON: {exc})") from exc
    except RecursionError:
        raise RecordingError(f"{path} is not a telemetry file (its JSON is nested too deep to read)") from None
    except OSError as exc:  # a folder, or unreadable
        raise RecordingError(f"cannot read the telemetry file {path}: {exc.strerror or exc}") from exc
    if _SURROGATE_ESCAPE.search(data):  # only a \\u escape can make one: the walk is for such files alone
        bad = _lone_surrogate(doc)
        if bad is not None:  # it reads, but every export of it (CSV, JSON, a copy) would fail
            raise RecordingError(f"{path}: {bad} is text that is not valid Unicode (a lone surrogate)")
    return from_dict(doc, str(path))


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(doc: Any) -> Optional[str]:
    """Where in `doc` a text (a value or a key) holds a lone surrogate, as `machine.gpus[0].name`; None where none."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                name = f"{where}.{k}" if where else str(k)
                if not figures.utf8_text(k):
                    return f"the key {name!r}"
                stack.append((v, name))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
        elif isinstance(value, str) and not figures.utf8_text(value):
            return where or "the file"
    return None


def from_dict(doc: Any, where: str = "the recording") -> Recording:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecordingError(f'{where} is not a Gapless telemetry file (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION or type(doc.get("version")) is not int:
        raise RecordingError(f"{where} has telemetry version {doc.get('version')!r}; this Gapless reads {VERSION}")
    label = _typed(doc, "label", str, where)
    try:
        options = EngineOptions.from_dict(_typed(doc, "options", dict, where))
    except (GaplessError, TypeError) as exc:
        raise RecordingError(f"{where}: options: {exc}") from exc
    metrics = _metrics(_typed(doc, "metrics", dict, where), f"{where}: metrics")
    steps = _steps(_typed(doc, "steps", list, where), where)
    samples = [_sample(s, f"{where}: samples[{i}]") for i, s in enumerate(_typed(doc, "samples", list, where))]
    t_start = _number(doc.get("t_start"), f"{where}: t_start", optional=True)
    t_end = _number(doc.get("t_end"), f"{where}: t_end", optional=True)
    _check_times(steps, samples, t_start, t_end, where)
    return Recording(
        label=label,
        options=options,
        metrics=metrics,
        steps=steps,
        samples=samples,
        t_start=t_start,
        t_end=t_end,
        model=_typed(doc, "model", dict, where),
        machine=_machine(_typed(doc, "machine", dict, where), where),
        created=_number(doc.get("created", 0.0), f"{where}: created") or 0.0,
        unavailable=_reasons(doc.get("unavailable", {}), f"{where}: unavailable"),
        limits=_limits(doc.get("limits", []), f"{where}: limits"),
    )


def _machine(machine: dict, where: str) -> dict:
    """The machine as written; its GPUs, where listed, a list of objects whose names are text (the window's title
    reads them)."""
    gpus = machine.get("gpus")
    if gpus is not None and not (
        isinstance(gpus, list) and all(isinstance(g, dict) and isinstance(g.get("name", ""), str) for g in gpus)
    ):
        raise RecordingError(f'{where}: machine "gpus" is not a list of objects with a name')
    return machine


def _reasons(value: Any, where: str) -> dict[str, str]:
    """Option -> reason; absent in files written before it was recorded."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise RecordingError(f"{where} is not a map of option names to reasons")
    return dict(value)


def _limits(value: Any, where: str) -> dict[tuple[str, Any], str]:
    """(option, value) -> reason; absent in files written before it was recorded."""
    try:
        return limits_from_list(value)
    except ValueError as exc:
        raise RecordingError(f"{where}: {exc}") from None


def _typed(doc: dict, key: str, kind: type, where: str) -> Any:
    if key not in doc:
        raise RecordingError(f'{where}: "{key}" is missing')
    value = doc[key]
    if not isinstance(value, kind):
        raise RecordingError(f'{where}: "{key}" is {type(value).__name__}, not {kind.__name__}')
    return value


def _number(value: Any, where: str, optional: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordingError(f"{where} is {value!r}, not a finite number")
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range (10**400)
        raise RecordingError(f"{where} is too large a number") from None
    if not math.isfinite(number):
        raise RecordingError(f"{where} is {value!r}, not a finite number")
    return number


def _metrics(d: dict, where: str) -> GenerationMetrics:
    """A registered figure is a finite number (or null); its source and the other fields are plain JSON scalars."""
    problem = figures.metrics_problem(d)
    if problem:
        raise RecordingError(f"{where}: {problem}")
    m = GenerationMetrics()
    for f in fields(GenerationMetrics):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name == "new_tokens":
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise RecordingError(f"{where}: new_tokens is not a list of integers")
        elif f.name == "unavailable":
            if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(r, str) for k, r in v.items()):
                raise RecordingError(f"{where}: unavailable is not an object of reasons")
        elif f.name in figures.BY_KEY:
            if v is not None:
                x = _number(v, f"{where}: {f.name}")
                v = v if isinstance(v, int) else figures.BY_KEY[f.name].typed(x)
        elif v is not None and not isinstance(v, (str, int, float, bool)):
            raise RecordingError(f"{where}: {f.name} is {type(v).__name__}, not text or a number")
        setattr(m, f.name, v)
    return m


def _step(d: Any, where: str) -> StepRecord:
    if not isinstance(d, dict):
        raise RecordingError(f"{where} is not an object")
    values: dict[str, Any] = {}
    for f in fields(StepRecord):
        v = d.get(f.name)
        if f.name == "profiled":
            if not isinstance(v, (bool, type(None))):  # "false" is a true value to bool()
                raise RecordingError(f"{where}: profiled is {json.dumps(v)[:40]}, not true or false")
            values[f.name] = bool(v)
        elif f.name == "t":
            values[f.name] = _number(v, f"{where}: t")
        elif f.name in ("step", "tokens_total"):
            x = _number(v, f"{where}: {f.name}")
            if x is None or x < 0 or not x.is_integer():
                raise RecordingError(f"{where}: {f.name} is {v!r}, not a count")
            values[f.name] = int(x)
        else:  # the step's optional figures (None when not measured)
            values[f.name] = _figure(v, f.name, where)
    return StepRecord(**values)


def _steps(items: list, where: str) -> list[StepRecord]:
    """The step records in the order they were made: neither time nor the step count goes back (the token count
    may, where a stop string cut tokens an earlier record counted)."""
    steps = [_step(s, f"{where}: steps[{i}]") for i, s in enumerate(items)]
    for i in range(1, len(steps)):
        a, b = steps[i - 1], steps[i]
        for name in ("t", "step"):
            if getattr(b, name) < getattr(a, name):
                raise RecordingError(f"{where}: steps[{i}] goes back in {name} ({getattr(a, name)} before it)")
    return steps


MAX_SPAN_S = 7 * 86400.0  # one answer's recording: longer is not one
SLACK_S = 60.0  # a record this far outside the answer's start and end still belongs to it (a late monitor sample)


def _check_times(
    steps: list[StepRecord], samples: list[MonitorSample], t_start: Optional[float], t_end: Optional[float], where: str
) -> None:
    """One clock for the whole recording: samples in order, and every record within the answer's start and end.
    Times apart by 1e308 replayed as blank plots and an export that failed on an infinite range."""
    for i in range(1, len(samples)):
        if samples[i].t < samples[i - 1].t:
            raise RecordingError(f"{where}: samples[{i}] goes back in t ({samples[i - 1].t} before it)")
    times = [r.t for r in steps] + [r.t for r in samples]
    first = t_start if t_start is not None else min(times, default=0.0)
    last = t_end if t_end is not None else max(times, default=first)
    if last < first:
        raise RecordingError(f"{where}: t_end ({last}) is before t_start ({first})")
    if last - first > MAX_SPAN_S:
        raise RecordingError(
            f"{where}: its times span {last - first:.3g} s; one answer's recording spans at most 7 days"
        )
    for name, at in (("steps", [r.t for r in steps]), ("samples", [r.t for r in samples])):
        for i, t in enumerate(at):
            if not first - SLACK_S <= t <= last + SLACK_S:
                raise RecordingError(f"{where}: {name}[{i}] is at t = {t}, outside the answer ({first} to {last})")


def _sample(d: Any, where: str) -> MonitorSample:
    if not isinstance(d, dict):
        raise RecordingError(f"{where} is not an object")
    values: dict[str, Any] = {}
    for f in fields(MonitorSample):
        if f.name == "sources":
            src = d.get("sources", {})
            if not isinstance(src, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in src.items()):
                raise RecordingError(f"{where}: sources is not an object of labels")
            values["sources"] = dict(src)
        elif f.name == "unavailable":
            why = d.get("unavailable", {})
            if not isinstance(why, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in why.items()):
                raise RecordingError(f"{where}: unavailable is not an object of reasons")
            values["unavailable"] = dict(why)
        elif f.name == "t":
            values["t"] = _number(d.get("t"), f"{where}: t")
        else:
            v = _figure(d.get(f.name), f.name, where)
            values[f.name] = int(v) if v is not None and f.name.endswith("_bytes") else v
    return MonitorSample(**values)


def _sample_dict(s: MonitorSample) -> dict[str, Any]:
    d = asdict(s)
    if not d["unavailable"]:  # said once a generation: the other samples leave it out
        del d["unavailable"]
    return d


def _figure(value: Any, name: str, where: str) -> Optional[float]:
    """An optional number; a registered figure's also within what it can be (a share at most all of it)."""
    x = _number(value, f"{where}: {name}", optional=True)
    spec = figures.BY_KEY.get(name)
    problem = figures.value_problem(spec, x) if spec is not None and x is not None else None
    if problem:
        raise RecordingError(f"{where}: {name} {problem}")
    return x
