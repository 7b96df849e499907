"""The engine's public data: options, sampling parameters, model info, events and results.

Everything here is plain data (frozen dataclasses where the value is a setting), so the app and the UI can
hold, display and persist it without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from engine import figures
from engine.errors import OptionsError

REMOTE_PREFIX = "remote:"  # a model source on an OpenAI-compatible server: remote:URL#MODEL (engine.remote)


def is_remote(source: str) -> bool:
    return source.startswith(REMOTE_PREFIX)


def remote_address_problem(url: str) -> Optional[str]:
    """Why `url` cannot be a remote server's base URL; None when it can."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 -- a port that is not a number raises here
    except ValueError as exc:
        return f"a remote server's address must be a URL such as http://host:8000/v1; {url!r} is not one ({exc})"
    if parts.scheme not in ("http", "https") or not host:
        return f"a remote server's address is an http(s) URL such as http://host:8000/v1, got {url!r}"
    if any(c.isspace() or c in "#|" for c in url):  # '#' and '|' end the address in a remote source
        return f"a remote server's address has no spaces, '#' or '|' in it, got {url!r}"
    if ":" not in host and any(not label.isascii() or label.startswith("xn--") for label in host.split(".")):
        import idna  # httpx's own check of such names, made when it connects (an internal error there)

        try:
            idna.encode(host)
        except (UnicodeError, ValueError) as exc:  # idna.IDNAError is a UnicodeError
            return f"a remote server's address has a host name that is not a valid one ({host!r}: {exc})"
    if parts.username is not None or parts.password is not None:
        # it would stay in plain text in the recent models, the settings and the log
        return (
            "a remote server's address may not hold a user name or password (user:password@host); give the "
            "server's key in the API key field instead"
        )
    return None


def source_label(source: str) -> str:
    """A model's source in a few words: a local model by its file or folder name, a remote one by its address and
    model, the default model as such."""
    if source.startswith("remote:"):
        return source[len("remote:") :].split("|")[0].replace("#", " · ")
    return "Default model" if source == "default" else Path(source).name or source


def source_in_full(source: str) -> str:
    """A model's source as a message names it: a local model by its whole path, a remote one by its address and
    model (not the stored form, "remote:http://…#m|timeout=5"), the default model as such."""
    if source == "default" or source.startswith("remote:"):
        return source_label(source)
    return source


def api_key_problem(key: str) -> Optional[str]:
    """Why `key` cannot be sent as a bearer token (it is never quoted back); None when it can."""
    if not (key.isascii() and key.isprintable() and " " not in key):
        return (
            "the API key must be printable ASCII without spaces: it is sent in an HTTP header, where other "
            "characters do not arrive as typed"
        )
    return None


DTYPES = ("auto", "fp32", "fp16", "bf16")
KV_MODES = ("static", "dynamic", "none")
SAMPLING_MODES = ("device", "host")
DEVICES = ("auto", "cpu", "cuda")
# The device of a remote server's answers (engine.remote): every option but the candidate count is the server's.
REMOTE_DEVICE = "remote"
KERNELS = ("torch", "fused")
WEIGHT_FORMATS = ("native", "int8", "int4")
MAX_CANDIDATES = 32
MAX_NEW_TOKENS_LIMIT = 1 << 20
# top_k as the sampler holds it and the server and dialogs take it: over every vocabulary's size (a k at or over it
# keeps every token); a larger one is read as this, as an int64 on the device could not hold any
TOP_K_LIMIT = 1 << 20
# The repetition penalty's least: a seen token's logit is divided by it, and past about 1e-37 that was infinite in
# float32 (the answer came out as one token repeated, empty as text); the settings dialogs stop at it too
REPETITION_PENALTY_MIN = 0.01
SPECULATION_MODES = ("off", "ngram", "draft")
MAX_DRAFT_TOKENS = 15
# What a prompt longer than the context does (engine.prompt): drop the oldest turns, drop turns from the middle
# (the system prompt and the first user message stay), or refuse with a message.
OVERFLOW_POLICIES = ("rolling", "truncate-middle", "stop")
OVERFLOW_LABELS = {
    "rolling": "Rolling window (drop the oldest turns)",
    "truncate-middle": "Truncate the middle (keep the system prompt and the first message)",
    "stop": "Stop at the limit",
}


def _refuse_unknown(cls: type, data: dict[str, Any], what: str) -> None:
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise OptionsError(f"unknown {what}: {', '.join(unknown)}")


@dataclass(frozen=True)
class EngineOptions:
    """One choice of every decode optimization. Changing it takes effect at the next generation."""

    device: str = "auto"  # cpu | cuda | auto (cuda when available)
    dtype: str = "auto"  # fp32 | fp16 | bf16 | auto (fp16 on CUDA, fp32 on CPU)
    kv_cache: str = "static"  # static (preallocated) | dynamic (torch.cat per step) | none (re-run the prefix)
    sampling: str = "device"  # device (no host sync per token) | host (.item() every token)
    compile: bool = False  # torch.compile of the decode step
    cuda_graph: bool = False  # capture the decode step once per candidate count, replay per token
    candidates: int = 1  # same-prompt answers decoded as one batch
    profile_window: bool = True  # trace a short window of decode steps for kernel/op gap
    kernels: str = "torch"  # torch (the model's modules) | fused (Triton decode kernels; implies the static cache)
    speculation: str = "off"  # off | ngram (drafts looked up in the prompt and answer) | draft (a smaller model)
    draft_tokens: int = 0  # drafts verified per step, 1..15; 0 = adaptive
    draft_model: str = ""  # the draft model for speculation "draft" (a GGUF file or a folder); "" = none
    weights: str = "native"  # native (dtype) | int8 (per-channel, weight-only) | int4 (group-wise, weight-only)
    prefix_reuse: bool = True  # keep the KV cache across generations; compute only past the common prefix

    def validate(self) -> "EngineOptions":
        choices = {
            "device": DEVICES,
            "dtype": DTYPES,
            "kv_cache": KV_MODES,
            "sampling": SAMPLING_MODES,
            "kernels": KERNELS,
            "weights": WEIGHT_FORMATS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed and not (name == "device" and self.device == REMOTE_DEVICE):
                raise OptionsError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("compile", "cuda_graph", "profile_window", "prefix_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_int("candidates", self.candidates, 1, MAX_CANDIDATES)
        if self.speculation not in SPECULATION_MODES:
            raise OptionsError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        _check_int("draft_tokens", self.draft_tokens, 0, MAX_DRAFT_TOKENS, f"1 and {MAX_DRAFT_TOKENS} (0 = adaptive)")
        if not isinstance(self.draft_model, str):
            raise OptionsError(f"draft_model must be a path (a string), got {self.draft_model!r}")
        return self

    def with_(self, **changes: Any) -> "EngineOptions":
        return replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineOptions":
        _refuse_unknown(cls, data, "engine option(s)")
        return cls(**data).validate()


_DESCRIBED = ("device", "dtype", "kv_cache", "sampling", "compile", "cuda_graph", "candidates", "profile_window")


def model_file_name(path: str) -> str:
    """A model path's file or folder name, as a few words show it ("/m/small.gguf/" -> "small.gguf")."""
    return path.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or path


def hub_name(folder: Path) -> str:
    """A folder's name as a model's: in the Hugging Face hub cache (models--org--name/snapshots/<commit>) the
    repository's, not the commit's."""
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return folder.name


def safetensors_weights(folder: Path) -> list[Path]:
    """The safetensors files a folder's weights are read from, sorted: Mistral folders carry a second, differently
    named copy of the weights ("consolidated.safetensors"), left out where the "model*" files are there."""
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    return [p for p in files if p.name.startswith("model")] or files


def server_decides(options: "EngineOptions | Mapping[str, Any] | None") -> bool:
    """Whether `options` are a remote server's answer's: none but the candidate count is known here."""
    device = options.device if isinstance(options, EngineOptions) else (options or {}).get("device")
    return device == REMOTE_DEVICE


def describe_options(options: "EngineOptions | dict[str, Any] | None", sep: str = " · ", device: bool = False) -> str:
    """The one way options are written in a few words: "fp16 · static KV · device sampling · compiled · CUDA
    graph · 4 candidates", then every other option that differs from its default ("kernels fused"). Takes the
    options or their dict form (JSON, the store); "" for none."""
    if not options:
        return ""
    o = options.to_dict() if isinstance(options, EngineOptions) else dict(options)
    n = o.get("candidates", 1)
    many = [f"{n} candidates"] if isinstance(n, int) and n > 1 else []
    if server_decides(o):
        return sep.join([*([REMOTE_DEVICE] if device else []), "set by the server", *many])
    parts = [str(o["device"])] if device and "device" in o else []
    parts += [
        str(o.get("dtype", "?")),
        f"{o.get('kv_cache', '?')} KV",
        f"{o.get('sampling', '?')} sampling",
        "compiled" if o.get("compile") else "eager",
    ]
    if o.get("cuda_graph"):
        parts.append("CUDA graph")
    parts += many
    defaults = EngineOptions().to_dict()
    # the draft settings say nothing while speculation is off, nor a draft model unless it drafts
    idle = {"draft_tokens", "draft_model"} if o.get("speculation", "off") == "off" else set()
    if o.get("speculation") == "ngram":
        idle.add("draft_model")
    for name, value in o.items():
        if name not in _DESCRIBED and name not in idle and name in defaults and value != defaults[name]:
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            if name == "draft_model":  # its file or folder name: the path is in the options themselves
                shown = model_file_name(str(value))
            parts.append(f"{name.replace('_', ' ')} {shown}")
    return sep.join(parts)


# The ladder, in the order a user should apply the fixes. Each preset is complete (not a delta), except that
# the device, profile_window, prefix_reuse, draft_tokens and draft_model of the current options are kept when a
# preset is applied.
PRESETS: dict[str, EngineOptions] = {
    "naive": EngineOptions(dtype="fp32", kv_cache="dynamic", sampling="host", compile=False, cuda_graph=False),
    "half": EngineOptions(dtype="fp16", kv_cache="dynamic", sampling="host"),
    "device-sampling": EngineOptions(dtype="fp16", kv_cache="dynamic", sampling="device"),
    "first-fixes": EngineOptions(dtype="fp16", kv_cache="static", sampling="device"),
    "compile": EngineOptions(dtype="fp16", kv_cache="static", sampling="device", compile=True),
    "cuda-graph": EngineOptions(dtype="fp16", kv_cache="static", sampling="device", compile=True, cuda_graph=True),
    # The fused kernels replace the compiled step, so compile is off here; the graph captures the kernels.
    "fused": EngineOptions(dtype="fp16", kv_cache="static", sampling="device", cuda_graph=True, kernels="fused"),
    "int8": EngineOptions(
        dtype="fp16", kv_cache="static", sampling="device", compile=True, cuda_graph=True, weights="int8"
    ),
    "candidates": EngineOptions(
        dtype="fp16", kv_cache="static", sampling="device", compile=True, cuda_graph=True, candidates=4
    ),
    "speculation": EngineOptions(
        dtype="fp16", kv_cache="static", sampling="device", compile=True, cuda_graph=True, speculation="ngram"
    ),
}
PRESET_LABELS: dict[str, str] = {
    "naive": "Naive",
    "half": "+ half precision",
    "device-sampling": "+ device sampling",
    "first-fixes": "+ static KV cache",
    "compile": "+ compile",
    "cuda-graph": "+ CUDA graph",
    "fused": "+ fused kernels",
    "int8": "+ int8 weights",
    "candidates": "+ N candidates",
    "speculation": "+ speculation",
}


# What a preset takes from the options it is applied to rather than setting itself.
PRESET_KEEPS = ("device", "profile_window", "prefix_reuse", "draft_tokens", "draft_model")


def preset_options(
    name: str, base: EngineOptions, half_dtype: str = "fp16", candidates: Optional[int] = None
) -> EngineOptions:
    """The options of preset `name`, keeping `base`'s PRESET_KEEPS (device, profiling switch, prompt-cache reuse,
    draft length and draft model).

    `half_dtype` replaces fp16 in the presets (bf16 where fp16 is a poor fit, fp32 on a CPU where half
    precision is slower than single); `candidates` overrides the candidate count of the last rung.
    """
    if name not in PRESETS:
        raise OptionsError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[name]
    dtype = half_dtype if p.dtype == "fp16" else p.dtype
    n = candidates if (candidates is not None and p.candidates > 1) else p.candidates
    kept = {key: getattr(base, key) for key in PRESET_KEEPS}
    return replace(p, dtype=dtype, candidates=n, **kept).validate()


def _check_int(name: str, value: Any, lo: int, hi: int, between: Optional[str] = None) -> None:
    """`value` is an int (not a bool) in [lo, hi], else the OptionsError saying so; `between` words the range
    when "lo and hi" would not."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise OptionsError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise OptionsError(f"{name} must be between {between or f'{lo} and {hi}'}, got {value}")


# A temperature below this samples greedily (as vLLM's servers do): logits divided by 1e-300, which float32 holds
# as 0, are not numbers, and every token would be drawn alike.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. A temperature below GREEDY_BELOW (0 most often) means greedy."""

    temperature: float = 0.7
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    max_new_tokens: int = 256
    seed: Optional[int] = None  # None = a fresh seed per generation (reported in the result)
    stop: tuple[str, ...] = ()

    def validate(self) -> "SamplingParams":
        def finite(name: str, v: Any) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise OptionsError(f"{name} must be a finite number, got {v!r}")
            try:
                f = float(v)
            except OverflowError:  # an integer past what a float holds (a chat file's): an internal error it was
                raise OptionsError(
                    f"{name} must be a finite number, got an integer of {len(str(v)):,} digits"
                ) from None
            if not math.isfinite(f):
                raise OptionsError(f"{name} must be a finite number, got {v!r}")
            return f

        if finite("temperature", self.temperature) < 0:
            raise OptionsError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > 100:
            raise OptionsError(f"temperature must be <= 100, got {self.temperature}")
        # any k: one at or over the vocabulary's size keeps every token (the sampler holds at most TOP_K_LIMIT)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise OptionsError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        tp = finite("top_p", self.top_p)
        if not 0 < tp <= 1:
            raise OptionsError(f"top_p must be in (0, 1], got {self.top_p}")
        rp = finite("repetition_penalty", self.repetition_penalty)
        if not REPETITION_PENALTY_MIN <= rp <= 10:
            raise OptionsError(
                f"repetition_penalty must be in [{REPETITION_PENALTY_MIN}, 10], got {self.repetition_penalty}"
            )
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise OptionsError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        bad = [s for s in self.stop if not (isinstance(s, str) and s)]
        if bad:
            raise OptionsError(f"stop must be non-empty strings, got {bad[0]!r}")
        for s in self.stop:
            try:  # a lone surrogate is no character a model writes, and nothing holding it can be saved
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise OptionsError(f"stop string {s!r} holds an invalid character (a lone surrogate)") from None
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        _refuse_unknown(cls, data, "sampling parameter(s)")
        d = dict(data)
        if "stop" in d:
            if not isinstance(d["stop"], (list, tuple)):  # tuple("abc") would be three stop strings
                raise OptionsError(f"stop must be a list of strings, got {type(d['stop']).__name__}")
            d["stop"] = tuple(d["stop"])
        return cls(**d).validate()


@dataclass(frozen=True)
class ModelInfo:
    name: str  # a display name, e.g. the file or folder name
    family: str  # llama, qwen2, qwen3, or the transformers model_type on the fallback
    architecture: str  # e.g. LlamaForCausalLM
    backend: str  # "fast" (our decoder) or "transformers" (fallback)
    parameters: int
    dtype: str
    device: str
    context_length: int
    weight_bytes: int
    source: str  # the path the model was loaded from
    source_kind: str  # "gguf", "hf-folder" or "default"
    backend_reason: str = ""  # why a model of a fast-path family runs on the fallback ("" otherwise)
    weights: str = "native"  # the weight format the linears run in (EngineOptions.weights, as applied)
    weights_kernel: str = ""  # what computes the quantised linears ("" for native weights)
    bytes_per_token: Optional[int] = None  # weight bytes one decode token reads
    bytes_per_token_source: str = ""
    memory_floor_ms: Optional[float] = None  # bytes_per_token at the device's peak bandwidth; None where unknown
    memory_floor_source: str = ""  # the source, or "n/a: why"
    load_seconds: Optional[float] = None  # how long the load took, file to model ready
    load_seconds_source: str = ""

    # The figures above this model's backend cannot know, each with the reason (a remote server says nothing of
    # its weights): null in the JSON, never a made-up 0.
    unknown: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        unknown = out.pop("unknown")
        if unknown:
            out.update(dict.fromkeys(unknown))
            out["unavailable"] = unknown
        return out


Metric = Optional[float]


@dataclass
class GenerationMetrics:
    """Figures of one generation. A figure with no source on this machine is None, shown as "n/a"."""

    prompt_tokens: int = 0
    new_tokens: list[int] = field(default_factory=list)  # per candidate
    new_tokens_total: int = 0
    count_source: Optional[str] = None  # who counted the tokens, where not the engine (a remote server's usage)
    ttft_ms: Metric = None  # prompt in -> first token on the host
    compile_seconds: Metric = None  # compile / capture warm-up before the first token (not part of ttft_ms)
    prefill_tok_s: Metric = None
    decode_tok_s: Metric = None  # aggregate over candidates, device-synchronised, profiled window excluded
    decode_steps: int = 0
    decode_seconds: Metric = None
    step_ms_p50: Metric = None
    step_ms_p90: Metric = None
    step_ms_p99: Metric = None
    peak_memory_bytes: Optional[int] = None
    peak_memory_source: Optional[str] = None
    kernel_gap_pct: Metric = None
    kernel_gap_source: Optional[str] = None
    launches_per_step: Metric = None  # kernels (CUDA) or top-level aten ops (CPU) per decode step, traced window
    launches_per_step_source: Optional[str] = None
    sm_activity_pct: Metric = None
    sm_activity_source: Optional[str] = None
    gpu_util_pct: Metric = None
    gpu_util_source: Optional[str] = None
    dram_bw_util_pct: Metric = None
    dram_bw_util_source: Optional[str] = None
    profiled_steps: int = 0  # decode steps inside the traced window (left out of tok/s)
    tokens_per_step: Metric = None  # tokens kept per decode step and candidate (1 without speculation)
    drafted_tokens: Optional[int] = None  # speculation: drafts verified by the target
    accepted_tokens: Optional[int] = None  # speculation: drafts the target accepted
    acceptance_rate: Metric = None  # accepted / drafted
    verify_steps: Optional[int] = None  # speculation: decode steps that verified drafts (the rest ran plain)
    paused_steps: Optional[int] = None  # speculation: plain steps whose drafts the adaptive schedule held back
    speculation_source: Optional[str] = None  # what drafted and how k was chosen
    # A remote engine: what the client measures over HTTP, and what the server reports about itself.
    http_ttft_ms: Metric = None
    http_decode_tok_s: Metric = None
    inter_token_ms_p50: Metric = None
    inter_token_ms_p99: Metric = None
    server_ttft_ms: Metric = None
    server_ttft_source: Optional[str] = None
    server_decode_tok_s: Metric = None
    server_decode_source: Optional[str] = None
    server_running_requests: Metric = None
    server_waiting_requests: Metric = None
    server_kv_cache_pct: Metric = None
    prompt_reused_tokens: Optional[int] = None  # prompt positions taken from the last generation's KV cache
    prompt_computed_tokens: Optional[int] = None  # prompt positions the prefill computed
    prompt_reuse_source: Optional[str] = None
    overflow_policy: Optional[str] = None  # the policy the prompt was fitted with (engine.prompt)
    prompt_cut: Optional[str] = None  # what was dropped to fit the context, e.g. "2 oldest messages dropped"
    unavailable: dict[str, str] = field(default_factory=dict)  # metric name -> why it is n/a

    def put(self, key: str, value: Optional[float], source: Optional[str] = None) -> None:
        """Sets figure `key` (registered in engine.figures) with its source; a value clears an earlier n/a."""
        s = figures.spec(key)
        if value is None:
            raise ValueError(f"{key}: a figure without a value is set with mark_na(key, reason)")
        setattr(self, key, value)
        if s.source_field:
            if not source and not s.source:
                raise ValueError(f"{key}: its source depends on the machine and must be given")
            setattr(self, s.source_field, source)
        self.unavailable.pop(key, None)

    def mark_na(self, key: str, reason: str) -> None:
        """Figure `key` is n/a on this run, for `reason`."""
        s = figures.spec(key)
        setattr(self, key, None)
        # a source field figures share (the token counts', the speculation counters') still names the source of
        # those of them that have a value
        if s.source_field and not any(
            getattr(self, f.key, None) is not None for f in figures.FIGURES if f.source_field == s.source_field
        ):
            setattr(self, s.source_field, None)
        self.unavailable[key] = reason

    def figure(self, key: str) -> figures.Figure:
        return figures.read(self, key)

    def to_dict(self) -> dict[str, Any]:
        """The fields, and under "sources" the source of every figure that has a value (the registry's where the
        figure has no source field of its own), so each number in the JSON names where it came from."""
        d = asdict(self)
        d["sources"] = {
            f.key: fig.source
            for f in figures.GENERATION_FIGURES
            if (fig := self.figure(f.key)).available and fig.source is not None
        }
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GenerationMetrics":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class ContextUse:
    """What a conversation would take of the model's context (Engine.measure_prompt), counted with the same
    prompt rendering a generation uses."""

    tokens: int  # the whole conversation, as the chat template renders it, nothing dropped
    prompt_tokens: Optional[int]  # what a generation would feed after the overflow policy; None: it would refuse
    context_length: int
    budget: int  # the most prompt tokens allowed (the context less room for the answer)
    policy: str  # the overflow policy it was counted under
    cut: str = ""  # what the policy would drop, "" when nothing
    refused: str = ""  # why a generation would refuse this prompt, "" when it would not


# ---- events streamed by Engine.generate / Engine.load -------------------------------------------------


@dataclass(frozen=True)
class LadderRow:
    """One rung of the app's "Run ladder": what it ran with and its median figures, or why it has none."""

    NOT_RUN = "cancelled before it ran"  # `skipped` of a rung the ladder was stopped before
    # `skipped` of the rung the ladder was stopped in, before it had a timed run (it was said not to have run)
    CUT_SHORT = "cancelled while it ran (during its {}): a run cut short is no measurement"

    preset: str  # a key of PRESETS
    label: str
    status: str  # "ok" | "skipped" | "failed"
    options: Optional[dict[str, Any]] = None  # the options the engine ran it with
    skipped: Optional[str] = None  # why it has no figures (skipped, failed, cancelled); None when it ran
    notes: tuple[str, ...] = ()  # e.g. optimisations left out of the candidates rung
    metrics: Optional[dict[str, Any]] = None  # medians over its repeats, keyed as GenerationMetrics

    def figure(self, key: str) -> figures.Figure:
        return figures.read(self.metrics or {}, key)

    @property
    def ran(self) -> bool:
        return self.skipped is None and self.metrics is not None

    @property
    def cancelled(self) -> bool:
        return self.skipped == self.NOT_RUN or (self.skipped or "").startswith(self.CUT_SHORT.split("{")[0])

    @property
    def decode_tok_s(self) -> Optional[float]:
        return self.figure("decode_tok_s").value

    @property
    def kernel_gap_pct(self) -> Optional[float]:
        return self.figure("kernel_gap_pct").value

    @property
    def kernel_gap_source(self) -> Optional[str]:
        return self.figure("kernel_gap_pct").source

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


@dataclass(frozen=True)
class Progress:
    stage: str  # "fetch", "load", "dequantise", "compile", "capture", "warmup", ...
    fraction: Optional[float]  # 0..1, None when unknown
    message: str


@dataclass(frozen=True)
class TextDelta:
    candidate: int
    text: str


def whole_text(text: str) -> str:
    """`text` as it can be stored and sent as UTF-8: halves of a pair joined into their character, a half alone
    replaced by U+FFFD (Unicode's replacement character)."""
    if not any("\ud800" <= ch <= "\udfff" for ch in text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


@dataclass(frozen=True)
class RowFinished:
    """One candidate's answer ended while the others may go on; reason as in GenerationResult.finish_reasons.
    Sent once per candidate, after its last TextDelta."""

    candidate: int
    reason: str


@dataclass(frozen=True)
class StepRecord:
    """One decode step (or a batch of steps read back together in device sampling)."""

    t: float  # time.perf_counter() on the host
    step: int  # decode steps done so far
    tokens_total: int  # tokens generated so far, all candidates
    step_ms: Optional[float]  # mean device-synchronised step latency over the steps this record covers
    profiled: bool = False  # inside the traced window
    tokens_per_step: Optional[float] = None  # tokens kept per open row and step over the steps it covers (LoopState)


@dataclass(frozen=True)
class MonitorSample:
    """One reading of the machine monitor. None means not measured on this machine."""

    t: float  # time.perf_counter()
    gpu_util_pct: Metric = None
    sm_activity_pct: Metric = None
    sm_occupancy_pct: Metric = None
    dram_bw_util_pct: Metric = None
    gpu_memory_used_bytes: Optional[int] = None
    power_w: Metric = None
    sm_clock_mhz: Metric = None
    cpu_util_pct: Metric = None  # this process, all cores = 100 * cores
    process_rss_bytes: Optional[int] = None
    sources: dict[str, str] = field(default_factory=dict)  # field name -> source label
    # field name -> why the monitor cannot measure it here (told with a generation's first sample; a GPM figure
    # whose reading no share can be, with that sample)
    unavailable: dict[str, str] = field(default_factory=dict)


Limits = Mapping[tuple[str, Any], str]  # (option, value) -> why this model on this device never runs that value


def limits_as_list(limits: Limits) -> list[dict[str, Any]]:
    """Limits in JSON's terms (whose keys are strings): [{"option": "weights", "value": "int4", "why": "..."}]."""
    return [{"option": n, "value": v, "why": w} for (n, v), w in sorted(limits.items(), key=lambda e: repr(e[0]))]


def limits_from_list(entries: Any) -> dict[tuple[str, Any], str]:
    """The inverse of limits_as_list, for what was read back from a file; ValueError names what is wrong."""
    if not isinstance(entries, list):
        raise ValueError(f"limits are a list, not {type(entries).__name__}")
    out: dict[tuple[str, Any], str] = {}
    for i, e in enumerate(entries):
        ok = isinstance(e, dict) and set(e) == {"option", "value", "why"}
        if not ok or not isinstance(e["option"], str) or not isinstance(e["why"], str):
            raise ValueError(f"limits[{i}] is not an object of option, value and why (text)")
        if not isinstance(e["value"], (str, bool, int)):
            raise ValueError(f"limits[{i}]: value is {type(e['value']).__name__}, not text, a number or true/false")
        out[(e["option"], e["value"])] = e["why"]
    return out


def options_as_run(
    options: EngineOptions, unavailable: Mapping[str, str], limits: Optional[Limits] = None
) -> dict[str, Any]:
    """The options a generation ran with; under "unavailable", those asked for that the model or machine refused
    and why; under "limits", the option values this model on this device never runs, whatever else is chosen
    (engine.protocol.option_limits). The JSON's `options`, what a stored answer keeps and what the diagnosis
    reads, so it advises nothing that cannot run."""
    return {**options.to_dict(), "unavailable": dict(unavailable), "limits": limits_as_list(limits or {})}


def stored_options_problem(options: Mapping[str, Any]) -> Optional[str]:
    """What makes options read back in options_as_run's form (a chat file, the store) unfit to show or run
    again: a value no option takes, n/a reasons or limits of the wrong shape. None when they are fit."""
    try:
        EngineOptions.from_dict({k: v for k, v in options.items() if k in EngineOptions.__dataclass_fields__})
        limits_from_list(options.get("limits", []))
    except (TypeError, ValueError) as exc:
        return str(exc)
    if not figures.texts(options.get("unavailable", {})):
        return "its unavailable options are not an object of texts"
    return None


CPU_DTYPE_NOTE = (
    "CPU ladder: Naive and every rung after '+ half precision' run in fp32; the half-precision rung runs in bf16, "
    "because CPUs run fp16 matmuls slowly and bf16 only as fast as their bf16 support allows"
)


# Why an answer ended, in words (GenerationResult.finish_reasons; "context" where the context left less room than
# asked, "interrupted" where the app closed mid-answer).
# Why an answer ran without the draft model it was asked to draft with when Stop ended the model's read: not a
# refusal of the option (the next answer reads it), so the Optimizations panel does not pin it on the option.
DRAFT_READ_STOPPED = "the draft model's read was stopped"

FINISH_WORDS = {
    "eos": "end of answer",
    "length": "token limit",
    "stop": "stop string",
    "cancelled": "stopped by you",
    "interrupted": "cut off: the app closed mid-answer",
    "context": "context full",
    "error": "failed",
    "filtered": "held back by the server's content filter",  # a remote server's finish reason "content_filter"
    "server": "ended by the server",  # a remote server's finish reason of another kind (its word in a notice)
}


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]  # "eos", "stop", "length", "cancelled"
    metrics: GenerationMetrics
    options: EngineOptions  # the options actually used
    unavailable: dict[str, str]  # option -> why it could not be honoured
    seed: Optional[int]
    notices: list[str] = field(default_factory=list)  # e.g. "prompt cut: 3 oldest turns dropped"
    limits: dict[tuple[str, Any], str] = field(default_factory=dict)  # what never runs here (see options_as_run)

    def to_dict(self) -> dict[str, Any]:
        return {
            "texts": self.texts,
            "token_ids": self.token_ids,
            "finish_reasons": self.finish_reasons,
            "metrics": self.metrics.to_dict(),
            "options": options_as_run(self.options, self.unavailable, self.limits),
            "seed": self.seed,
            "notices": list(self.notices),
        }


Event = Union[Progress, TextDelta, RowFinished, StepRecord, MonitorSample]
ROLES: tuple[Literal["system", "user", "assistant"], ...] = ("system", "user", "assistant")


def blank(text: str) -> bool:
    """Whether a message says nothing to the model: only white space and NUL characters (the prompt drops NULs,
    so a message of them was sent, made a chat of an invisible title and then failed as "empty prompt")."""
    return not text.replace("\x00", "").strip()
