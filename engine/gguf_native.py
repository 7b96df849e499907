"""GGUF loading on the project's own path: the metadata parsed once (engine.gguf_header), the tensor names mapped
once, each tensor de-quantised straight into the target dtype on the target device (engine.gguf_dequant).

transformers still builds what it is good at, the config class and the tokenizer, once per file: the results
(config JSON, the saved tokenizer with its chat template and special tokens, the tensor layout) are kept in the
user cache dir keyed by the file's identity (path, size, mtime_ns and a hash of its header), so a second load
converts nothing. A changed file, or other versions of transformers and tokenizers, miss the cache; a damaged
entry is rebuilt, with a log line.

A cached load imports none of transformers where the conversion found that nothing needs it: the config comes
back as a CachedConfig (the attributes transformers' config class resolved, read from JSON) and the tokenizer
as engine.fast_tokenizer's, each used only where the conversion checked it gives what transformers' gives.

Architectures whose GGUF tensors transformers reshapes in ways not mirrored here load through transformers'
own GGUF path instead (engine.loader decides, with `native_architecture`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from engine.errors import ModelLoadError, one_line
from engine.gguf_dequant import dequantize
from engine.gguf_header import GGUFHeader
from engine.paths import read_into, unchanged_while_read
from engine.types import Progress

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# 4: a GGUF's tokenizer read from the GGUF alone (3 let files beside it take its place); 5: the manifest holds each
# file's digest (a damaged file that still parsed was never rebuilt)
CACHE_VERSION = 6
CONVERTED_BY = ("transformers", "tokenizers")  # a cache entry is of these libraries' versions (made_with)
TMP_ABANDONED_S = 3600.0  # a half-written entry older than this was left by a process that stopped
CACHE_ENTRIES_KEPT = 32
# GGUF architecture -> how its q/k rows are stored: llama.cpp permutes Llama's for its rotary layout
NATIVE_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "gemma3": False}
# GGUF architecture -> what llama.cpp added to its norms' weights (Gemma scales by 1 + weight and stores the sum)
NORM_OFFSETS = {"gemma3": 1.0}
# transformers' model type -> the gguf package's architecture name, where they differ
# tensors of a GGUF that the model reads another way (llama.cpp's rope factors are read into the config)
UNUSED_BY_DESIGN = ("rope_freqs.weight", ".attn_rot_embd")

# model types whose GGUF tensor names are another architecture's (transformers names a Llama GGUF called
# "mistral" a Mistral; its tensors are Llama's)
GGUF_MODEL_TYPES = {"gemma3_text": "gemma3", "mistral": "llama"}
PROGRESS_EVERY = 16  # tensors

ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor as the model takes it."""

    gguf_name: str
    hf_name: str
    permute_heads: int  # > 0: un-permute the rows of llama.cpp's rotary layout over this many heads
    offset: float = 0.0  # subtracted from the stored values (in fp32, before the cast), as transformers does


@dataclass
class Converted:
    """What a GGUF file converts to besides its weights; the cached part of a load."""

    config: dict[str, Any]  # the config dict transformers' GGUF reading builds
    tokenizer: Any  # transformers' class, or a FastTokenizer where the conversion checked it agrees
    plan: list[TensorPlan]
    shapes: dict[str, list[int]]  # every parameter the model class has, with its shape
    tied: dict[str, str]  # alias -> the parameter it shares storage with
    from_cache: bool
    # the attributes of transformers' config object, where a CachedConfig made of them stands in for it
    resolved: Optional[dict[str, Any]] = None
    tokenizer_facts: Optional[dict[str, Any]] = None  # what a FastTokenizer needs, where it stands in
    built: Any = None  # transformers' config object, when this conversion just made it

    def config_object(self, label: str):
        """The model config: the one just built, a CachedConfig where the conversion allowed it, or else
        transformers' class built again."""
        if self.built is not None:
            return self.built
        if self.resolved is not None:
            return CachedConfig(self.resolved, self.config, label)
        return build_config(self.config, label)


class CachedConfig:
    """A model config read back from the cache: the attributes transformers' config class gave this file, as
    plain values, without importing transformers. `to_transformers()` builds the real one where code needs it
    (transformers' own model classes)."""

    def __init__(self, resolved: dict[str, Any], source: dict[str, Any], label: str):
        self.__dict__.update({k: v for k, v in resolved.items() if not k.startswith("_")})
        self.name_or_path = str(resolved.get("_name_or_path", ""))
        if isinstance(resolved.get("id2label"), dict):  # JSON made its int keys strings; transformers' are ints
            self.id2label = {int(k): v for k, v in resolved["id2label"].items()}
        self._resolved = resolved
        self._source = source
        self._label = label

    def to_dict(self) -> dict[str, Any]:
        """As transformers' `to_dict` gives it: the resolved attributes, with any set since."""
        out = {**self._resolved, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}
        out["_name_or_path"] = out.pop("name_or_path")
        return out

    def to_transformers(self):
        config = build_config(self._source, self._label)
        config.name_or_path = self.name_or_path
        if getattr(self, "rope_freq_factors", None) is not None:
            config.rope_freq_factors = self.rope_freq_factors
        return config

    def __repr__(self) -> str:
        return f"CachedConfig({vars(self).get('model_type')!r})"


def native_architecture(header: GGUFHeader) -> bool:
    return header.architecture in NATIVE_ARCHITECTURES and header.byte_order == "<"


def cache_root() -> Path:
    from engine.paths import cache_dir

    return cache_dir() / "gguf"


def file_identity(header: GGUFHeader) -> dict[str, Any]:
    st = header.path.stat()
    h = hashlib.sha256()
    with open(header.path, "rb") as f:
        h.update(f.read(header.data_start))
    return {"path": str(header.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": h.hexdigest()}


# ---- conversion (a cache miss) ---------------------------------------------------------------------------


def config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The config dict transformers' `load_gguf_checkpoint` builds, from metadata already parsed: the same
    renames (its GGUF_TO_TRANSFORMERS_MAPPING), defaults and fix-ups, for the architectures handled here."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    meta = header.metadata
    arch = header.architecture
    name = meta.get("general.name")
    # transformers tests membership in a one-item list here: only a model named exactly "mistral" qualifies
    updated = "mistral" if "llama" in arch and "mistral" in ([name] if name is not None else []) else arch
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, default in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, default)
    renames: dict[str, dict[str, Any]] = GGUF_TO_TRANSFORMERS_MAPPING["config"]  # type: ignore[assignment]
    for key, value in meta.items():
        prefix, _, config_key = key.replace(arch, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        target = renames.get(prefix, {}).get(config_key) if prefix in renames else None
        if target is not None and target != -1:
            config[target] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.array_lengths:
        config["vocab_size"] = header.array_lengths["tokenizer.ggml.tokens"]
    if config.get("model_type") == "gemma3":  # a Gemma-3 GGUF holds the text model only
        config["model_type"] = "gemma3_text"
    return config


def tensor_name_map(model: torch.nn.Module, model_type: str, n_layers: int) -> dict[str, str]:
    """GGUF name -> HF name for a model object (see name_map)."""
    return name_map(list(model.state_dict(keep_vars=True)), model_type, n_layers)


def name_map(hf_names: list[str], model_type: str, n_layers: int) -> dict[str, str]:
    """GGUF name -> HF name, as transformers' `get_gguf_hf_weights_map` maps a model's parameters (each module's
    names tried relative to it, the first found kept; the modules here are the dotted prefixes of the names,
    in the order they appear), with the gguf package's name table built once, not per module."""
    import gguf

    model_type = GGUF_MODEL_TYPES.get(model_type, model_type)
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model_type), None)
    if arch is None:
        raise ModelLoadError(f"the gguf package has no tensor names for {model_type!r}")
    names = gguf.get_tensor_name_map(arch, n_layers)

    def walk(relative: list[str], qual: str) -> dict[str, str]:
        found: dict[str, str] = {}
        children: dict[str, list[str]] = {}
        for hf_name in relative:
            base, suffix = hf_name, ""
            if hf_name.endswith((".weight", ".bias")):
                base, _, tail = hf_name.rpartition(".")
                suffix = "." + tail
            gguf_name = names.get_name(base)
            if gguf_name is not None:
                found[gguf_name + suffix] = qual + hf_name
            head, dot, rest = hf_name.partition(".")
            if dot:
                children.setdefault(head, []).append(rest)
        for child_name, child in children.items():
            for k, v in walk(child, f"{qual}{child_name}.").items():
                found.setdefault(k, v)
        return found

    return walk(hf_names, "")


def native_layout(config) -> Optional[tuple[dict[str, tuple[int, ...]], dict[str, str]]]:
    """The parameters (names and shapes, in transformers' order) and ties of transformers' model class for the
    families loaded natively, from the config alone: building the class, even on the meta device, imports
    transformers' modelling code (~130 MiB of it resident, on a first launch). None for other families.
    Tested against the model class for each family and option (tests/engine/test_gguf_native.py)."""
    family = config.model_type
    if family not in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
        return None
    gemma = family == "gemma3_text"
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or hidden // heads
    attention_bias = bool(getattr(config, "attention_bias", False)) and family in ("llama", "qwen3", "gemma3_text")
    qkv_bias = family == "qwen2" or attention_bias
    mlp_bias = bool(getattr(config, "mlp_bias", False)) and family == "llama"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for proj, rows, cols, bias in (
            ("q_proj", heads * hd, hidden, qkv_bias),
            ("k_proj", kv * hd, hidden, qkv_bias),
            ("v_proj", kv * hd, hidden, qkv_bias),
            ("o_proj", hidden, heads * hd, attention_bias),
        ):
            shapes[f"{a}{proj}.weight"] = (rows, cols)
            if bias:
                shapes[f"{a}{proj}.bias"] = (rows,)
        if family == "qwen3" or gemma:
            shapes[a + "q_norm.weight"] = shapes[a + "k_norm.weight"] = (hd,)
        for proj, rows, cols in (
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ):
            shapes[f"{m}{proj}.weight"] = (rows, cols)
            if mlp_bias:
                shapes[f"{m}{proj}.bias"] = (rows,)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
        if gemma:
            shapes[f"model.layers.{i}.pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"model.layers.{i}.post_feedforward_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if getattr(config, "tie_word_embeddings", False) else {}
    return shapes, tied


def _tokenizer_from_file(path: Path, config, label: str) -> "PreTrainedTokenizerBase":
    """The tokenizer AutoTokenizer builds for this GGUF, by its own class choice, from the GGUF alone (see
    loader.gguf_alone), without AutoTokenizer parsing the whole file again for the config."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from engine.loader import gguf_alone

    cls: Any = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if getattr(cls, "__name__", "") == "MistralCommonBackend" or cls is None:
        cls = TokenizersBackend
    with gguf_alone(path) as (folder, gguf_file):
        try:
            return cls.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True, trust_remote_code=False)
        except KeyError as exc:  # transformers' conversion reads tokenizer.ggml.<key> without asking
            raise ModelLoadError(
                f"{label}: the tokenizer could not be built from this GGUF: its tokenizer metadata is incomplete "
                f"(no tokenizer.ggml.{exc.args[0] if exc.args else '?'})"
            ) from exc
        except Exception as exc:  # the tokenizers backend raises plain Exception on a vocabulary it cannot build
            raise ModelLoadError(f"{label}: the tokenizer could not be built from this GGUF: {one_line(exc)}") from exc


def convert(header: GGUFHeader, label: str, report: ProgressFn) -> Converted:
    from engine.loader import _check_causal_lm, _Layout

    cfg = config_dict(header)
    _check_counts(cfg, header, label)
    config = build_config(cfg, label)
    resolved = _resolved(config, cfg, label)
    _check_causal_lm(config.model_type, label, architecture=header.architecture)
    report(Progress("load", 0.2, "reading the tokenizer"))
    tokenizer = _tokenizer_from_file(header.path, config, label)
    report(Progress("load", 0.5, "building the model layout"))
    native = native_layout(config)
    if native is not None:
        layout_shapes, layout_tied = native
    else:
        layout = _Layout.of(config, label)
        layout_shapes, layout_tied = layout.shapes, layout.tied
    try:
        names = name_map(list(layout_shapes), config.model_type, config.num_hidden_layers)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{label}: {exc}") from None
    permute = NATIVE_ARCHITECTURES.get(header.architecture, False)
    # llama.cpp's converter leaves head_count_kv out where the model's config had no num_key_value_heads (older
    # Llamas): as many as the query heads, as llama.cpp reads it (transformers then un-permutes neither q nor k)
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    norm_offset = NORM_OFFSETS.get(header.architecture, 0.0)
    plan = []
    unused = []
    for t in header.tensors:
        hf = names.get(t.name)
        if hf is None or hf not in layout_shapes:
            if not t.name.endswith(UNUSED_BY_DESIGN):
                unused.append(t.name)
            continue
        n = 0
        if permute and heads is not None and kv_heads is not None:
            if ".attn_q." in t.name:
                n = heads
            elif ".attn_k." in t.name:
                n = kv_heads
        plan.append(TensorPlan(t.name, hf, n, norm_offset if "norm.weight" in t.name else 0.0))
    if unused:  # dropped, the answers would be another model's (biases a "llamafied" Qwen keeps, say)
        shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        raise ModelLoadError(
            f"{label}: the GGUF holds tensors a {config.model_type} model does not have ({shown}): it cannot be "
            "run as written"
        )
    shapes = {k: list(v) for k, v in layout_shapes.items()}
    return Converted(cfg, tokenizer, plan, shapes, dict(layout_tied), from_cache=False, resolved=resolved, built=config)


# what the engine reads of a config besides ModelArgs' fields
_ENGINE_ATTRIBUTES = ("model_type", "vocab_size", "max_position_embeddings", "eos_token_id", "architectures")


def _resolved(config, cfg: dict[str, Any], label: str) -> Optional[dict[str, Any]]:
    """transformers' config as plain attributes, where a CachedConfig of them gives the engine the same model
    (the fast path's arguments and the rest it reads); None where it does not, or the fast path is not taken."""
    from engine.model import ModelArgs

    try:
        resolved = json.loads(json.dumps(config.to_dict()))
        light = CachedConfig(resolved, cfg, label)
        same = ModelArgs.from_hf_config(light) == ModelArgs.from_hf_config(config)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        log.info("%s: the config is kept as transformers' class (%s)", label, one_line(exc))
        return None
    if not same or any(getattr(light, a, None) != getattr(config, a, None) for a in _ENGINE_ATTRIBUTES):
        log.info("%s: the config is kept as transformers' class (its plain attributes differ)", label)
        return None
    return resolved


# the sizes a GGUF's metadata gives that must be positive (a damaged file's 0 would fail far from its cause)
_COUNTS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
)


# the special ids transformers' tokenizer conversion looks up in the vocabulary
SPECIAL_ID_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding"))


def _check_counts(cfg: dict[str, Any], header: GGUFHeader, label: str) -> None:
    """The metadata's sizes (and rope base) are positive and its layer count is the one its tensors are for."""
    for key in _COUNTS:
        v = cfg.get(key)
        if isinstance(v, int) and v < 1:
            raise ModelLoadError(f"{label}: the GGUF's metadata gives {key} = {v}; it must be at least 1")
    from engine.model import is_rope_base

    theta = cfg.get("rope_theta")  # transformers' config takes any value here
    if theta is not None and not is_rope_base(theta):
        raise ModelLoadError(f"{label}: the GGUF's metadata gives rope_theta = {theta!r}; it must be a positive number")
    lengths = header.array_lengths
    tokens = lengths.get("tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):  # one entry per token, or the ids shift
        if tokens is not None and key in lengths and lengths[key] != tokens:
            raise ModelLoadError(
                f"{label}: the GGUF's {key} has {lengths[key]} entries for {tokens} tokens: the file is damaged"
            )
    for key in SPECIAL_ID_KEYS:  # the tokenizer's conversion failed with "list index out of range"
        v = header.metadata.get(key)
        if tokens is not None and isinstance(v, int) and not 0 <= v < tokens:
            raise ModelLoadError(
                f"{label}: the GGUF's {key} is {v}, outside its {tokens}-token vocabulary: the file is damaged"
            )
    blocks = {int(m.group(1)) for t in header.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    n = cfg.get("num_hidden_layers")
    if blocks and isinstance(n, int) and max(blocks) + 1 != n:
        raise ModelLoadError(
            f"{label}: the GGUF's metadata says {n} layers, but its tensors are for {max(blocks) + 1} (blk.0 to "
            f"blk.{max(blocks)}): the file is damaged"
        )
    if blocks and len(blocks) != max(blocks) + 1:  # the tensor-name map and the model were built for every one
        lost = min(set(range(max(blocks) + 1)) - blocks)
        raise ModelLoadError(
            f"{label}: the GGUF's tensors are for layers blk.0 to blk.{max(blocks)}, but {max(blocks) + 1 - len(blocks)}"
            f" of them have none (the first: blk.{lost}): the file is damaged"
        )


def build_config(cfg: dict[str, Any], label: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"{label}: unsupported architecture: model type {model_type!r} is unknown to transformers")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(cfg))
    except Exception as exc:  # the config classes' own checks raise their own kinds (huggingface_hub's, arithmetic)
        raise ModelLoadError(f"{label}: cannot read the model settings in this GGUF: {one_line(exc)}") from exc


# ---- the cache -------------------------------------------------------------------------------------------


def _remove_entry(entry: Path) -> None:
    """Remove a cache entry, a folder, or whatever else took its name (a file there was left by rmtree, and every
    load converted again and could not write its cache)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            entry.unlink(missing_ok=True)


def _entry(root: Path, path: Path) -> Path:
    return root / hashlib.sha256(os.fsencode(path)).hexdigest()[:20]


def read_cache(root: Path, identity: dict[str, Any]) -> Optional[Converted]:
    """The cached conversion of this very file, or None (absent, of another version of the file, or damaged:
    damaged and stale entries are removed, with a log line)."""
    entry = _entry(root, Path(identity["path"]))
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / "manifest.json").read_text(encoding="utf-8"))
        if manifest.get("version") != CACHE_VERSION or manifest.get("identity") != identity:
            log.info("%s changed since it was converted; converting it again", Path(identity["path"]).name)
            _remove_entry(entry)
            return None
        if manifest.get("made_with") != made_with():
            log.info(
                "%s was converted by other versions of the libraries that convert it (%s, now %s); converting it again",
                Path(identity["path"]).name,
                manifest.get("made_with"),
                made_with(),
            )
            _remove_entry(entry)
            return None
        if manifest.get("digests") != _digests(entry):
            raise ValueError("its files are not those it was written with")
        data = json.loads((entry / "layout.json").read_text(encoding="utf-8"))
        plan = [TensorPlan(str(g), str(h), int(n), float(o)) for g, h, n, o in data["plan"]]
        shapes = {str(k): [int(x) for x in v] for k, v in data["shapes"].items()}
        tied = {str(k): str(v) for k, v in data["tied"].items()}
        cfg = json.loads((entry / "config.json").read_text(encoding="utf-8"))
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise ValueError("config.json is not a model config")
        facts = manifest.get("fast_tokenizer")
        if isinstance(facts, dict):
            from engine.fast_tokenizer import FastTokenizer

            tokenizer: Any = FastTokenizer(entry / "tokenizer" / "tokenizer.json", facts)
        else:
            tokenizer = _saved_tokenizer(entry / "tokenizer", str(manifest["tokenizer_class"]))
        resolved = manifest.get("resolved_config")
    except Exception as exc:  # any damage (JSON, files, a tokenizer that will not load) means: convert again
        log.warning(
            "the converted cache of %s is damaged (%s); rebuilding it", Path(identity["path"]).name, one_line(exc)
        )
        _remove_entry(entry)
        return None
    with contextlib.suppress(OSError):  # a read-only cache is read as it is
        os.utime(entry / "manifest.json")  # recency, for pruning
    return Converted(
        cfg,
        tokenizer,
        plan,
        shapes,
        tied,
        from_cache=True,
        resolved=resolved if isinstance(resolved, dict) else None,
        tokenizer_facts=facts if isinstance(facts, dict) else None,
    )


def made_with() -> dict[str, str]:
    """The versions of the libraries a conversion comes from: an upgrade that converts tokenizers or configs
    differently converts again (read from their installed metadata: a cached load imports neither)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in CONVERTED_BY:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def _digests(entry: Path) -> dict[str, str]:
    """SHA-256 of every file of a cache entry but its manifest (a few MB: milliseconds)."""
    return {
        f.relative_to(entry).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(entry.rglob("*"))
        if f.is_file() and f.name != "manifest.json"
    }


def _saved_tokenizer(folder: Path, class_name: str) -> "PreTrainedTokenizerBase":
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    cls = tokenizer_class_from_name(class_name)
    if cls is None:
        raise ValueError(f"unknown tokenizer class {class_name!r}")
    return cls.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def write_cache(root: Path, identity: dict[str, Any], conv: Converted) -> None:
    """Written into a fresh folder and renamed into place, so a reader never sees half an entry."""
    entry = _entry(root, Path(identity["path"]))
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    try:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(conv.config, indent=1), encoding="utf-8")
        layout = {
            "plan": [[p.gguf_name, p.hf_name, p.permute_heads, p.offset] for p in conv.plan],
            "shapes": conv.shapes,
            "tied": conv.tied,
        }
        (tmp / "layout.json").write_text(json.dumps(layout), encoding="utf-8")
        conv.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        facts = _fast_tokenizer_facts(tmp / "tokenizer", conv.tokenizer, Path(identity["path"]).name)
        manifest = {
            "version": CACHE_VERSION,
            "identity": identity,
            "made_with": made_with(),
            "digests": _digests(tmp),  # last: of the files as they stay
            "tokenizer_class": type(conv.tokenizer).__name__,
            "fast_tokenizer": facts,
            "resolved_config": conv.resolved,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _remove_entry(entry)
        os.replace(tmp, entry)
    except OSError as exc:  # a read-only or full cache dir costs a conversion at the next start, nothing more
        log.warning("cannot write the converted cache of %s: %s", Path(identity["path"]).name, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    _prune(root)


def _fast_tokenizer_facts(folder: Path, tokenizer, label: str) -> Optional[dict[str, Any]]:
    """What a FastTokenizer over the saved tokenizer.json needs, where it agrees with transformers' class on
    the probe; else None (and the cached load uses transformers' class)."""
    from engine.fast_tokenizer import FastTokenizer, disagreement, tokenizer_facts

    facts = tokenizer_facts(tokenizer)
    if facts is None or not (folder / "tokenizer.json").is_file():
        log.info("%s: the tokenizer is kept as transformers' %s", label, type(tokenizer).__name__)
        return None
    why = disagreement(FastTokenizer(folder / "tokenizer.json", facts), tokenizer)
    if why is not None:
        log.info("%s: the tokenizer is kept as transformers' class: the fast one differs on %s", label, why)
        return None
    return facts


def _prune(root: Path) -> None:
    """Keeps the CACHE_ENTRIES_KEPT entries used last, and removes what a process stopped while writing one left
    behind (a .tmp- folder no writer has touched for TMP_ABANDONED_S)."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > TMP_ABANDONED_S:
                shutil.rmtree(tmp, ignore_errors=True)
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if len(entries) <= CACHE_ENTRIES_KEPT:
        return

    def used(p: Path) -> float:
        try:
            return (p / "manifest.json").stat().st_mtime
        except OSError:
            return 0.0

    for old in sorted(entries, key=used)[: len(entries) - CACHE_ENTRIES_KEPT]:
        shutil.rmtree(old, ignore_errors=True)


# ---- weights ---------------------------------------------------------------------------------------------


def dequantise_tensors(
    header: GGUFHeader,
    plan: list[TensorPlan],
    dtype: torch.dtype,
    device: torch.device,
    report: ProgressFn,
    opened: Callable[[io.FileIO], None],
) -> dict[str, torch.Tensor]:
    """HF name -> tensor in `dtype` on `device`, one tensor at a time read from the file (engine.paths.read_into;
    not mapped: a file cut short under a mapping ended the process with SIGBUS), once `opened` found the file open
    is the one the header was read from (it raises where another took its path): the host holds the results (when
    `device` is the CPU) and one tensor's bytes and temporaries."""
    state: dict[str, torch.Tensor] = {}
    threads = torch.get_num_threads()
    # Memory-bound byte ops on small tensors gain nothing from intra-op threads, and lose much when the cores
    # are busy: the default model took 0.9 s on one thread, 21.8 s on two, on a loaded 2-core machine.
    torch.set_num_threads(1)
    try:
        with open(header.path, "rb", buffering=0) as f:
            opened(f)
            _dequantise_all(f, header, plan, state, dtype, device, report, unchanged_while_read(f, header.path.name))
    finally:
        torch.set_num_threads(threads)
    return state


# Weights the fast decoder fuses into one matrix, in its row order: de-quantised straight into their rows of
# one buffer, so building the model takes the buffer as it is instead of concatenating (engine.model.joined).
FUSED_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
)


def _fused_slots(
    plan: list[TensorPlan], shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[tuple[str, ...], int, int]]:
    """HF name -> (its group's names, the first row of it in the group's buffer, the group's rows), for every
    tensor whose whole group is in the plan with the same row length."""
    slots: dict[str, tuple[tuple[str, ...], int, int]] = {}
    for p in plan:
        prefix, dot, _ = p.hf_name.rpartition(".layers.")
        layer = p.hf_name[len(prefix) + len(dot) :].split(".", 1)[0]
        for group in FUSED_GROUPS:
            names = tuple(f"{prefix}.layers.{layer}.{member}" for member in group)
            if p.hf_name != names[0] or not all(n in shapes for n in names):
                continue
            if len({shapes[n][1:] for n in names}) != 1:
                continue
            total, first = sum(shapes[n][0] for n in names), 0
            for n in names:
                slots[n] = (names, first, total)
                first += shapes[n][0]
    return slots


def _dequantise_all(
    f: io.FileIO,
    header: GGUFHeader,
    plan: list[TensorPlan],
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    report: ProgressFn,
    unchanged: Callable[[], None],
) -> None:
    by_name = {t.name: t for t in header.tensors}
    slots = _fused_slots(plan, {p.hf_name: tuple(by_name[p.gguf_name].shape) for p in plan if p.gguf_name in by_name})
    buffers: dict[tuple[str, ...], torch.Tensor] = {}
    total = len(plan)
    for i, p in enumerate(plan, 1):
        t = by_name[p.gguf_name]
        unchanged()
        try:
            raw = torch.empty(t.nbytes, dtype=torch.uint8)
            read_into(f, header.data_start + t.offset, raw.numpy().data, header.path.name)
            out = None
            slot = slots.get(p.hf_name)
            if slot is not None:
                names, first, rows = slot
                if names not in buffers:
                    buffers[names] = torch.empty(rows, *t.shape[1:], dtype=dtype, device=device)
                out = buffers[names][first : first + t.shape[0]]
            if p.permute_heads:
                w = _unpermute(dequantize(raw.to(device), t.type_name, t.shape, dtype), p.permute_heads, out)
            elif p.offset:
                w = (dequantize(raw.to(device), t.type_name, t.shape, torch.float32) - p.offset).to(dtype)
            else:
                w = dequantize(raw.to(device), t.type_name, t.shape, dtype, out)
            del raw
            state[p.hf_name] = w
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{header.path.name}: cannot de-quantise tensor {t.name} ({t.type_name}): {one_line(exc)}"
            ) from None
        if i % PROGRESS_EVERY == 0 or i == total:
            report(Progress("dequantise", i / total, f"de-quantised {i}/{total} tensors"))


def _unpermute(w: torch.Tensor, n_head: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's two rotary halves (rows along dim 0), into `out` if given."""
    dim = w.shape[0] // n_head // 2
    swapped = w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2)
    if out is None:
        return swapped.reshape(w.shape)
    out.view(swapped.shape).copy_(swapped)
    return out


def check_shapes(header: GGUFHeader, conv: Converted, label: str) -> None:
    from engine.loader import verify_shapes

    by_name = {t.name: t for t in header.tensors}
    missing = [p.gguf_name for p in conv.plan if p.gguf_name not in by_name]
    if missing:
        raise ModelLoadError(f"{label}: tensor {missing[0]} is not in the file")
    stored = {p.hf_name: tuple(by_name[p.gguf_name].shape) for p in conv.plan}
    verify_shapes(label, {k: tuple(v) for k, v in conv.shapes.items()}, conv.tied, stored)


def load_converted(header: GGUFHeader, label: str, report: ProgressFn, root: Optional[Path] = None) -> Converted:
    """The conversion of this file: from the cache when it holds this very file, else built and cached."""
    root = root or cache_root()
    try:
        identity = file_identity(header)
    except OSError as exc:  # gone or unreadable since its header was read
        raise ModelLoadError(f"{label}: cannot read it again: {exc.strerror or exc}") from exc
    conv = read_cache(root, identity)
    if conv is not None:
        return conv
    started = time.perf_counter()
    conv = convert(header, label, report)
    log.info("%s: converted config and tokenizer in %.2f s", label, time.perf_counter() - started)
    write_cache(root, identity, conv)
    return conv
