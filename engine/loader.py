"""Checkpoints from disk: config, HF-named CPU state dict and tokenizer, from a GGUF file, a Hugging Face folder
(config.json + *.safetensors) or the default model.

Safety comes first and is decided from names and magic bytes before any file is parsed: pickle checkpoints are
refused (nothing here calls torch.load), and a folder that needs its own Python code is refused rather than run.
Every other failure becomes a ModelLoadError with one line that names the file and the problem.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator, Optional, Sequence

import torch

from engine.errors import ModelLoadError, ReadStopped, UnsafeModelError, one_line
from engine.gguf_header import GGUF_MAGIC, check_gguf, read_gguf_header
from engine.paths import file_stamp, read_into, unchanged_while_read, user_path
from engine.types import Progress, hub_name, is_remote, safetensors_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
# torch.save writes a zip archive holding a pickle; older files are a bare pickle (protocol 2+ starts with 0x80)
_PICKLE_HEADS = (b"PK\x03\x04", b"\x80")
_INDEX_FILE = "model.safetensors.index.json"
_NAMES_SHOWN = 5  # in an error listing missing or mismatched tensors

ProgressFn = Callable[[Progress], None]


@dataclass
class Checkpoint:
    config: "PretrainedConfig"  # a transformers config (native class, never remote code)
    state_dict: dict[
        str, torch.Tensor
    ]  # HF parameter names -> tensors in the dtype and on the device load_checkpoint was given (fp32 on the CPU
    # from transformers' own GGUF reading)
    tokenizer: "PreTrainedTokenizerBase"
    name: str  # display name: file stem or folder name
    source: str  # absolute path, as given (links kept)
    source_kind: str  # "gguf" | "hf-folder" | "default"
    eos_token_ids: list[int] = field(default_factory=list)  # config, generation_config.json and tokenizer, merged
    load_seconds: Optional[float] = None  # perf_counter around load_checkpoint
    # the weights again from the files (GGUF on the native path, safetensors folders), in any dtype on any device,
    # so that the state dict is given up once a model is built
    materialise: Optional[Callable[[torch.dtype, torch.device], dict[str, torch.Tensor]]] = None
    tensor_types: frozenset[str] = frozenset()  # a GGUF's ggml tensor types (Q4_1, F32, ...); empty for others
    unchanged: Optional[Callable[[], None]] = None  # raises ModelLoadError where the file materialise reads changed

    def can_read_again(self) -> None:
        """Raise ModelLoadError where weights() would have to read a file that changed or went away: checked
        before a model is given up for new weights, so a failed switch keeps the model it had."""
        if not self.state_dict and self.unchanged is not None:
            self.unchanged()

    def weights(self, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The state dict to build a model from: the one held, or (after release) a fresh one from the file."""
        if not self.state_dict and self.materialise is not None:
            return self.materialise(dtype, device)
        return self.state_dict

    def release(self) -> None:
        """Drop the held state dict once a model has its own copy, where the file can give it again."""
        if self.materialise is not None:
            self.state_dict = {}


def load_checkpoint(
    source: str,
    progress: Optional[ProgressFn] = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
) -> Checkpoint:
    """Load `source`: "default", a .gguf file, or a Hugging Face folder (a .safetensors or config.json inside it
    stands for its folder). The weights come in `dtype` (floating-point ones) on `device`. Raises UnsafeModelError for pickle or remote code, ModelLoadError otherwise."""
    started = time.perf_counter()
    checkpoint = _load(source, progress, dtype, device)
    checkpoint.load_seconds = time.perf_counter() - started
    return checkpoint


def _load(source: str, progress: Optional[ProgressFn], dtype: torch.dtype, device: torch.device) -> Checkpoint:
    report = progress or _ignore
    if source == "default":
        from engine.default_model import ensure_default_model

        path = ensure_default_model(progress)
        return _load_gguf(Path(path).resolve(), report, "default", dtype, device)

    if not source or not str(source).strip():
        raise ModelLoadError("no model given: choose a .gguf file, a Hugging Face folder, or the default model")
    if is_remote(source):
        raise ModelLoadError(f"{source} is a model on a remote server: it is opened as one, not loaded here")
    path = user_path(source)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        refuse_pickle_path(path)
        raise ModelLoadError(f"model not found: {path}") from None
    except OSError as exc:  # a folder on the way the user may not open, a name too long
        raise ModelLoadError(f"cannot open the model {path}: {exc.strerror or exc}") from exc
    refuse_pickle_path(path)
    if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):  # a FIFO waited forever for a writer
        raise ModelLoadError(f"{path.name}: not a model Gapless can load (not a regular file or a folder)")
    # absolute but with its links kept: a link's own name says what it is (the Hugging Face hub cache links
    # model.safetensors and x.gguf to blobs named by their hashes) and names the model
    path = Path(os.path.abspath(path))
    if stat.S_ISDIR(mode):
        return _load_hf_folder(path, report, dtype, device)
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return _load_gguf(path, report, "gguf", dtype, device)
    if suffix == ".safetensors" or path.name == "config.json":
        return _load_hf_folder(path.parent, report, dtype, device)
    head = _read_head(path)
    if head.startswith(GGUF_MAGIC):
        return _load_gguf(path, report, "gguf", dtype, device)
    if head.startswith(_PICKLE_HEADS):
        raise UnsafeModelError(f"{path.name}: looks like a PyTorch pickle checkpoint; {_PICKLE_REASON}")
    raise ModelLoadError(f"{path.name}: not a model Gapless can load ({_EXPECTED})")


_PICKLE_REASON = "Gapless loads only safetensors or GGUF, because opening a pickle can run code"
_EXPECTED = "expected a .gguf file, or a folder with config.json and *.safetensors"


def refuse_pickle_path(path: Path) -> None:
    """Refuse a pickle checkpoint by its name alone, before the file is opened."""
    if path.suffix.lower() in PICKLE_SUFFIXES and not path.is_dir():
        raise UnsafeModelError(f"{path.name}: pickle checkpoint refused; {_PICKLE_REASON}")


# ---- GGUF ------------------------------------------------------------------------------------------------


def _load_gguf(path: Path, report: ProgressFn, kind: str, dtype: torch.dtype, device: torch.device) -> Checkpoint:
    from engine.gguf_dequant import supported
    from engine.gguf_native import NATIVE_ARCHITECTURES, native_architecture

    label = path.name
    report(Progress("load", 0.0, f"checking {label}"))
    header = read_gguf_header(path)
    # transformers' table of GGUF architectures costs a heavy import; the native ones do not need it
    known = set(NATIVE_ARCHITECTURES) if header.architecture in NATIVE_ARCHITECTURES else gguf_architectures()
    header = check_gguf(path, known, header)
    odd = sorted({t.type_name for t in header.tensors if not supported(t.type_name)})
    if native_architecture(header) and not odd:
        return _load_gguf_native(header, report, kind, dtype, device)
    why = f"its tensor types {', '.join(odd)}" if odd else f"architecture {header.architecture!r}"
    log.info("%s: loading through transformers' GGUF reader (%s not on the native path)", label, why)
    return _load_gguf_transformers(header, report, kind)


def _load_gguf_native(header, report: ProgressFn, kind: str, dtype: torch.dtype, device: torch.device) -> Checkpoint:
    from engine.gguf_header import read_gguf_rope
    from engine.gguf_native import check_shapes, dequantise_tensors, load_converted

    path, label = header.path, header.path.name
    report(Progress("load", 0.1, "reading the settings and tokenizer"))
    conv = load_converted(header, label, report)
    config = conv.config_object(label)
    config.name_or_path = str(path.parent)  # as transformers' GGUF reading names it
    if not conv.from_cache:  # a cached conversion passed this check when it was made
        _check_causal_lm(config.model_type, label, architecture=header.architecture)
    if read_gguf_rope(header)[0] not in (None, "none") and hasattr(config, "to_transformers"):
        config = config.to_transformers()  # transformers computes the scaled rope from its own config class
    _apply_gguf_settings(header, config, label)
    check_shapes(header, conv, label)
    report(Progress("load", 1.0, "settings and tokenizer ready" + (" (cached)" if conv.from_cache else "")))
    report(Progress("dequantise", 0.0, f"de-quantising {len(conv.plan)} tensors into {dtype} on {device}"))

    unchanged = _SinceLoaded(label, {path: "the file"}, {path: header.identity} if header.identity else None)

    def opened(f: BinaryIO) -> None:
        unchanged.opened(path, f)

    def read(dt: torch.dtype, dev: torch.device, report: ProgressFn, again: str = "") -> dict[str, torch.Tensor]:
        try:
            return dequantise_tensors(header, conv.plan, dt, dev, report, opened)
        except OSError as exc:  # the file gone or unreadable since its header was read, a disk's read error
            raise ModelLoadError(f"{label}: cannot read the weights{again}: {exc.strerror or exc}") from exc

    def materialise(dt: torch.dtype, dev: torch.device) -> dict[str, torch.Tensor]:
        unchanged()
        return read(dt, dev, _ignore, " again")

    state = read(dtype, device, report)
    return Checkpoint(
        config=config,
        state_dict=state,
        tokenizer=conv.tokenizer,
        name=path.stem,
        source=str(path),
        source_kind=kind,
        eos_token_ids=_eos_ids(config, conv.tokenizer, None, _gguf_turn_ends(header, conv.tokenizer, config)),
        materialise=materialise,
        tensor_types=frozenset(t.type_name for t in header.tensors),
        unchanged=unchanged,
    )


def _load_gguf_transformers(header, report: ProgressFn, kind: str) -> Checkpoint:
    """transformers' own GGUF path: for what the native path does not cover, and the tests' reference."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, label = header.path, header.path.name
    with gguf_alone(path) as (folder, gguf_file):
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
        except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
            if "does not recognize this architecture" in str(exc):  # its GGUF table names more than it builds
                raise ModelLoadError(
                    f"{label}: unsupported GGUF architecture {header.architecture!r}: transformers reads its "
                    "settings but has no model for it"
                ) from exc
            raise ModelLoadError(f"{label}: cannot read the model settings in this GGUF: {one_line(exc)}") from exc
        config.name_or_path = str(path.parent)  # not the empty folder it was read through
        _check_causal_lm(config.model_type, label, architecture=header.architecture)
        _apply_gguf_settings(header, config, label)
        report(Progress("load", 1 / 3, "reading the tokenizer"))
        tokenizer = _load_tokenizer(Path(folder), label, gguf_file=gguf_file)
    report(Progress("load", 2 / 3, "building the model layout"))
    layout = _Layout.of(config, label)

    report(Progress("dequantise", None, f"de-quantising {len(header.tensors)} tensors"))
    try:
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=layout.model)["tensors"]
    except (ValueError, KeyError, IndexError, TypeError, NotImplementedError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"{label}: cannot de-quantise the weights: {one_line(exc)}") from exc
    layout.verify({k: tuple(v.shape) for k, v in tensors.items()})
    state = {k: v for k, v in tensors.items() if k in layout.shapes}
    del tensors
    _unpermute_left(header, config, state)
    report(Progress("dequantise", 1.0, f"{len(state)} tensors ready"))
    return Checkpoint(
        config=config,
        state_dict=state,
        tokenizer=tokenizer,
        name=path.stem,
        source=str(path),
        source_kind=kind,
        eos_token_ids=_eos_ids(config, tokenizer, None, _gguf_turn_ends(header, tokenizer, config)),
        tensor_types=frozenset(t.type_name for t in header.tensors),
    )


def _unpermute_left(header, config, state: dict[str, torch.Tensor]) -> None:
    """A Llama GGUF without head_count_kv (llama.cpp's converter leaves it out for a config without
    num_key_value_heads) has as many KV heads as query heads; transformers' reader then leaves q and k in llama.cpp's
    rotary layout (engine.gguf_native un-permutes them on the native path)."""
    from engine.gguf_native import NATIVE_ARCHITECTURES, _unpermute

    arch = header.architecture
    if not NATIVE_ARCHITECTURES.get(arch) or f"{arch}.attention.head_count_kv" in header.metadata:
        return
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return
    for name, t in state.items():
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            state[name] = _unpermute(t, heads).contiguous()


def _apply_gguf_rope(header, config, label: str) -> None:
    """Rope settings llama.cpp's converter writes that transformers' GGUF reading leaves out: linear scaling
    goes into the config; per-frequency factors (`rope_freqs.weight`, Llama 3.1+ long-context rope) are kept on
    the config for the fast path, which divides the base frequencies by them as llama.cpp does. Anything else
    is refused: running without it would give wrong answers."""
    from engine.gguf_header import read_gguf_rope
    from engine.model import FAST_FAMILIES, rope_parameters

    kind, factor, freq_factors = read_gguf_rope(header)
    if kind not in (None, "none"):
        if kind != "linear" or not factor:
            raise ModelLoadError(
                f"{label}: rope scaling {kind!r} in this GGUF is not supported; its Hugging Face "
                f"folder can be opened instead"
            )
        params = rope_parameters(config)
        params.update(rope_type="linear", factor=float(factor))
        _set_rope(config, params)
    _apply_gguf_rope_dimensions(header, config, label)
    _apply_gguf_long_rope(header, config, label)
    if freq_factors is not None:
        if config.model_type not in FAST_FAMILIES:
            raise ModelLoadError(
                f"{label}: rope frequency factors (rope_freqs) are only applied on the fast path, "
                f"which {config.model_type} does not use"
            )
        config.rope_freq_factors = [float(x) for x in freq_factors]


def _set_rope(config, params: dict) -> None:
    """`params` (engine.model.rope_parameters' form) as the config's rope settings, in the form it keeps them."""
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict) and isinstance(nested.get("full_attention"), dict):
        nested["full_attention"] = params  # per layer type (Gemma-3): the scaling is the global layers'
    elif isinstance(nested, dict):
        config.rope_parameters = params  # transformers 5 (rope_scaling is its alias there)
    else:
        config.rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}


def _head_size(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _apply_gguf_rope_dimensions(header, config, label: str) -> None:
    """A rope over part of each head (`rope.dimension_count` below the head size: Phi-4-mini's 0.75), which
    transformers' GGUF reading of Phi-3 leaves out: set as the config's partial_rotary_factor where its model
    class takes one; refused where it does not (the fast path rotates whole heads)."""
    from engine.model import FAST_FAMILIES, rope_parameters

    dims = header.metadata.get(f"{header.architecture}.rope.dimension_count")
    if not isinstance(dims, int) or isinstance(dims, bool) or not getattr(config, "num_attention_heads", None):
        return
    head = _head_size(config)
    params = rope_parameters(config)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if round((partial or 1.0) * head) == dims:
        return
    if partial is None or config.model_type in FAST_FAMILIES or not 0 < dims < head:
        raise ModelLoadError(
            f"{label}: this GGUF rotates {dims} of each head's {head} dimensions, which Gapless does not run "
            f"for {config.model_type}"
        )
    params["partial_rotary_factor"] = dims / head
    _set_rope(config, params)
    if hasattr(config, "partial_rotary_factor"):
        config.partial_rotary_factor = dims / head


LONG_ROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # llama.cpp's, for Phi-3's longrope


def _apply_gguf_long_rope(header, config, label: str) -> None:
    """Phi-3's long-context rope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): llama.cpp writes its factors as
    two tensors and its scale and original context as metadata, none of which transformers' GGUF reading
    takes. Set on the config as transformers' longrope; refused for a model class without it."""
    from engine.gguf_header import read_gguf_f32
    from engine.model import rope_parameters

    long, short = (read_gguf_f32(header, name) for name in LONG_ROPE_TENSORS)
    if long is None and short is None:
        return
    if long is None or short is None or config.model_type != "phi3":
        raise ModelLoadError(
            f"{label}: the long-context rope factors ({', '.join(LONG_ROPE_TENSORS)}) of this "
            f"{config.model_type} GGUF are not supported; its Hugging Face folder can be opened instead"
        )
    params = rope_parameters(config)
    rotated = round(params.get("partial_rotary_factor", 1.0) * _head_size(config))
    if len(long) != rotated // 2 or len(short) != rotated // 2:
        raise ModelLoadError(
            f"{label}: corrupt GGUF: {len(long)} long and {len(short)} short rope factors for "
            f"{rotated}-dimension rotations (expected {rotated // 2} each)"
        )
    arch = header.architecture
    original = header.metadata.get(f"{arch}.rope.scaling.original_context_length")
    scale = header.metadata.get(f"{arch}.rope.scaling.attn_factor")
    params.update(rope_type="longrope", long_factor=[float(x) for x in long], short_factor=[float(x) for x in short])
    if isinstance(original, int) and not isinstance(original, bool) and original > 0:
        params["original_max_position_embeddings"] = original
        config.original_max_position_embeddings = original
    if isinstance(scale, float) and scale > 0:
        params["attention_factor"] = scale
    _set_rope(config, params)


def _apply_gguf_settings(header, config, label: str) -> None:
    """What a GGUF means that transformers' reading of it leaves out, on either load path."""
    _apply_gguf_rope(header, config, label)
    _apply_gguf_attention_scale(config)


# how llama.cpp tells the 27B models of Gemma-2 and Gemma-3 from their smaller sizes
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _apply_gguf_attention_scale(config) -> None:
    """Gemma-2's and Gemma-3's attention scale, which a GGUF does not store, as llama.cpp takes it: 1/sqrt(head
    size), and for the 27B models 1/sqrt(hidden / heads) (144 and 168, as their original configs say).
    transformers' GGUF reading leaves its default of 256, the head size of the smaller models only."""
    if config.model_type not in GEMMA_27B_LAYERS:
        return
    if config.num_hidden_layers == GEMMA_27B_LAYERS[config.model_type]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def gguf_architectures() -> set[str]:
    """The GGUF architectures the installed transformers reads (its mapping table also holds two non-model keys)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer", "tokenizer_config"}


# ---- Hugging Face folder ---------------------------------------------------------------------------------


def _load_hf_folder(folder: Path, report: ProgressFn, dtype: torch.dtype, device: torch.device) -> Checkpoint:
    from safetensors import safe_open

    label = hub_name(folder)
    report(Progress("load", 0.0, f"checking {label}"))
    files = _safetensors_files(folder)
    config = _load_config(folder)
    report(Progress("load", 0.1, "reading the tokenizer"))
    tokenizer = _load_tokenizer(folder, label)

    keys: list[tuple[Path, str, tuple[int, ...]]] = []  # (file, name in the file, shape)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys.extend((file, key, tuple(f.get_slice(key).get_shape())) for key in f.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError (a plain Exception) on a bad header
            raise ModelLoadError(f"{label}: {file.name} is not a readable safetensors file: {one_line(exc)}") from exc
    _check_layers_stored(config, [key for _, key, _ in keys], label)
    layout = _Layout.of(config, label)
    stored: dict[str, tuple[Path, str]] = {}  # our name -> (file, name in the file)
    shapes: dict[str, tuple[int, ...]] = {}
    for file, key, shape in keys:
        name = layout.rename(key)
        stored[name] = (file, key)
        shapes[name] = shape
    layout.verify(shapes)

    wanted = [n for n in stored if n in layout.shapes]
    unused = sorted(set(stored) - set(wanted))
    if unused:
        log.info("%s: %d stored tensors not used by the model, e.g. %s", label, len(unused), unused[:3])
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(stored[name][0], []).append(name)
    unchanged = _SinceLoaded(label, {file: file.name for file in by_file})

    def materialise(dt: torch.dtype, dev: torch.device) -> dict[str, torch.Tensor]:
        unchanged()
        return _read_safetensors(by_file, stored, label, _ignore, dt, dev, unchanged)

    return Checkpoint(
        config=config,
        state_dict=_read_safetensors(by_file, stored, label, report, dtype, device, unchanged),
        tokenizer=tokenizer,
        name=label,
        source=str(folder),
        source_kind="hf-folder",
        eos_token_ids=_eos_ids(config, tokenizer, folder, _template_turn_ends(tokenizer, config)),
        materialise=materialise,
        unchanged=unchanged,
    )


class _SinceLoaded:
    """The weights files (each with how a message names it) as they were when they were loaded (`seen`: a file's
    stamp taken earlier, as a GGUF's header read), for two checks. Called: that they are still the ones loaded and
    can be read again, made before a switch gives up the model in use for weights read from them (a file changed,
    moved or made unreadable since was read after the model was given up, and answers failed until it was opened
    again). opened(): that a file just opened to read its weights is the one loaded (another moved over its path
    after that check, or while an earlier shard was read, gave a model of two files' tensors without a word)."""

    def __init__(self, label: str, files: dict[Path, str], seen: Optional[dict[Path, tuple[int, ...]]] = None):
        self.label, self.files = label, files
        self.seen = {file: (seen or {}).get(file) or file_stamp(os.stat(file)) for file in files}

    def __call__(self) -> None:
        for file, stamp in self.seen.items():
            what = self.files[file]
            try:
                now = file_stamp(os.stat(file))
            except OSError as exc:
                raise ModelLoadError(
                    f"{self.label}: {what} was moved or deleted since it was loaded ({exc.strerror or exc}); open it "
                    "again"
                ) from None
            if now != stamp:
                raise ModelLoadError(f"{self.label}: {what} changed since it was loaded; open it again")
            try:
                with open(file, "rb"):
                    pass
            except OSError as exc:
                raise ModelLoadError(f"{self.label}: cannot read {what} again: {exc.strerror or exc}") from None

    def opened(self, file: Path, f: BinaryIO) -> None:
        if file_stamp(os.fstat(f.fileno())) != self.seen[file]:
            raise ModelLoadError(f"{self.label}: {self.files[file]} changed while it was read; open it again")


# safetensors' dtype names (its format's header) -> torch's
_SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U8", "uint8"),
        ("U16", "uint16"),
        ("U32", "uint32"),
        ("U64", "uint64"),
        ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
    )
    if hasattr(torch, attr)
}
_MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header


def _read_safetensors(
    by_file: dict[Path, list[str]],
    stored: dict[str, tuple[Path, str]],
    label: str,
    report: ProgressFn,
    dtype: torch.dtype,
    device: torch.device,
    loaded: _SinceLoaded,
) -> dict[str, torch.Tensor]:
    """The tensors named in `by_file` (our names, by file), read from each file into memory of their own and given
    in `dtype` (floating-point ones) on `device`; each file, as it is opened, checked to be the one `loaded`.

    Read, not mapped: a tensor left on the file's mapping ended the process with SIGBUS at the next answer once the
    file was overwritten in place, and a copy out of a mapping could still meet it while the copy ran (a large
    embedding takes a third of a second); a read of a file cut short is a short read, said as such. Each file is
    read through one descriptor, so a file moved over its path during the read does not mix two files' tensors,
    and a change in place between two tensors is refused. In the target dtype on the target device, a CUDA load
    needs no copy of the whole model in host memory; the checkpoint reads the files again for a switch instead of
    holding a second set. Read again for a switch, a 538 MB fp32 folder took 0.46 s where copies out of the
    mapping took 1.26 s (medians of 5 on a busy 2-core CPU; safetensors' own get_tensor maps the file, and reads
    the header first, see _load_hf_folder)."""
    state: dict[str, torch.Tensor] = {}
    total = sum(len(names) for names in by_file.values())
    for file, names in by_file.items():
        try:
            where = f"{label}: {file.name}"
            with open(file, "rb", buffering=0) as own:
                loaded.opened(file, own)
                unchanged = unchanged_while_read(own, where)
                data_start, table = _safetensors_table(own, where)
                for name in names:
                    unchanged()
                    t = _read_tensor(own, data_start, table, stored[name][1], where)
                    state[name] = t.to(device, dtype if t.is_floating_point() else t.dtype)  # itself where it is so
                    if len(state) % 16 == 0 or len(state) == total:
                        report(Progress("load", 0.2 + 0.8 * len(state) / total, f"read {len(state)}/{total} tensors"))
        except (ReadStopped, ModelLoadError):  # a read no longer wanted (the progress hook), a file that changed
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{label}: cannot read the weights in {file.name}: {one_line(exc)}") from exc
    return state


def _safetensors_table(f: io.RawIOBase, name: str) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data starts, and its header: tensor name -> dtype, shape, data_offsets."""
    head = _read_exactly(f, 0, 8, name)
    size = int.from_bytes(head, "little")
    if not 0 < size <= _MAX_SAFETENSORS_HEADER:
        raise ModelLoadError(f"{name} is not a readable safetensors file: a header of {size} bytes")
    try:
        table = json.loads(_read_exactly(f, 8, size, name))
    except (ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{name} is not a readable safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ModelLoadError(f"{name} is not a readable safetensors file: its header is not a JSON object")
    return 8 + size, table


def _read_tensor(f: io.RawIOBase, data_start: int, table: dict[str, Any], key: str, name: str) -> torch.Tensor:
    entry: Any = table.get(key)
    try:
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(f"{name}: tensor {key!r} has no dtype, shape and offsets this version reads") from None
    count = math.prod(shape)
    if end - begin != count * dtype.itemsize or begin < 0:
        raise ModelLoadError(f"{name}: tensor {key!r} takes {end - begin} bytes, not the {count} values of its shape")
    buf = torch.empty(end - begin, dtype=torch.uint8)
    read_into(f, data_start + begin, buf.numpy().data, name)
    return buf.view(dtype).reshape(shape)


def _read_exactly(f: io.RawIOBase, at: int, n: int, name: str) -> bytes:
    buf = bytearray(n)
    read_into(f, at, memoryview(buf), name)
    return bytes(buf)


def _safetensors_files(folder: Path) -> list[Path]:
    label = folder.name
    index = folder / _INDEX_FILE
    if index.is_file():
        data = _read_json(index, label)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{label}: {_INDEX_FILE} has no weight_map")
        files = [folder / name for name in sorted(set(map(str, weight_map.values())))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{label}: weight shard(s) listed in {_INDEX_FILE} are missing: {', '.join(missing[:_NAMES_SHOWN])}"
            )
        return files
    files = safetensors_weights(folder)
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeModelError(f"{label}: only pickle weights ({', '.join(pickles[:3])}); {_PICKLE_REASON}")
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    hint = f"; to load a GGUF, choose the file itself ({ggufs[0]})" if ggufs else ""
    raise ModelLoadError(f"{label}: no model weights in this folder ({_EXPECTED}){hint}")


def _load_config(folder: Path) -> "PretrainedConfig":
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    label = folder.name
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{label}: no config.json next to the weights")
    raw = _read_json(path, label)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{label}: config.json is not a JSON object")
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if raw.get("auto_map") and not known:
        raise UnsafeModelError(
            f"{label}: config.json asks for remote code (model type {model_type!r}"
            f"{f', {arch}' if arch else ''}); Gapless never runs code from a model folder"
        )
    if not model_type:
        raise ModelLoadError(f"{label}: config.json has no model_type{f' (architecture {arch})' if arch else ''}")
    if not known:
        raise ModelLoadError(
            f"{label}: unsupported architecture: model type {model_type!r}{f' ({arch})' if arch else ''} "
            f"is unknown to the installed transformers"
        )
    _check_causal_lm(model_type, label, architecture=arch)
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ModelLoadError(
            f"{label}: the weights are quantised ({method}); Gapless runs unquantised safetensors folders and "
            f"GGUF files (use the model's unquantised folder or a GGUF of it)"
        )
    if raw.get("auto_map"):
        log.info("%s: ignoring auto_map; model type %r has a native transformers class", label, model_type)
    try:
        # trust_remote_code is passed as False, not left unset: unset, transformers may stop and ask on a terminal
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers' own validation errors too (a size written as text: "320")
        raise ModelLoadError(f"{label}: cannot read config.json: {one_line(exc)}") from exc
    _check_sizes(config, label)
    return config


SIZES = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")  # each a whole number >= 1


def _check_sizes(config: "PretrainedConfig", label: str) -> None:
    """A model of no layers (or no width, no vocabulary) built and loaded, then failed at the first answer."""
    for name in SIZES:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ModelLoadError(f"{label}: config.json gives {name} = {value!r}; a model needs a whole number >= 1")
    from engine.model import is_rope_base, rope_parameters

    # 0 or a negative base loaded, and every answer's first token scored NaN, reported as damaged weights
    theta = rope_parameters(config).get("rope_theta")
    if theta is not None and not is_rope_base(theta):
        raise ModelLoadError(f"{label}: config.json gives rope_theta = {theta!r}; it must be a positive number")


def _check_layers_stored(config: "PretrainedConfig", keys: list[str], label: str) -> None:
    """Layers the config asks for beyond those the weights hold are refused before the model is built: a config
    saying 100,000 layers built them all (3 minutes, 4.8 GB) before naming the missing weights."""
    n = getattr(config, "num_hidden_layers", None)
    held = {int(m.group(1)) for k in keys if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))}
    if held and isinstance(n, int) and n > max(held) + 1:
        raise ModelLoadError(
            f"{label}: config.json gives num_hidden_layers = {n}, but the weights hold layers 0 to {max(held)}: "
            "missing weights (an incomplete download, or a config from another model)"
        )


# ---- shared ----------------------------------------------------------------------------------------------


def _check_causal_lm(model_type: str, label: str, architecture: Optional[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        what = f"{architecture} (model type {model_type!r})" if architecture else f"model type {model_type!r}"
        raise ModelLoadError(
            f"{label}: unsupported architecture: {what} is not a causal language model transformers can run"
        )


@dataclass
class _Layout:
    """The parameter names and shapes the model class expects, from a weightless build on the meta device."""

    label: str
    model: torch.nn.Module
    shapes: dict[str, tuple[int, ...]]
    tied: dict[str, str]  # alias -> the name it shares storage with (lm_head.weight -> model.embed_tokens.weight)
    prefix: str

    @classmethod
    def of(cls, config: "PretrainedConfig", label: str) -> "_Layout":
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ZeroDivisionError) as exc:
            raise ModelLoadError(
                f"{label}: cannot build {type(config).__name__} from its settings: {one_line(exc)}"
            ) from exc
        shapes: dict[str, tuple[int, ...]] = {}
        first: dict[int, str] = {}
        tied: dict[str, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            shapes[name] = tuple(t.shape)
            if id(t) in first:
                tied[name] = first[id(t)]
            else:
                first[id(t)] = name
        return cls(label, model, shapes, tied, getattr(model, "base_model_prefix", "") or "")

    def rename(self, key: str) -> str:
        """A stored name as the model names it: checkpoints saved from the bare base model lack its prefix."""
        if key not in self.shapes and self.prefix and f"{self.prefix}.{key}" in self.shapes:
            return f"{self.prefix}.{key}"
        return key

    def verify(self, stored: dict[str, tuple[int, ...]]) -> None:
        verify_shapes(self.label, self.shapes, self.tied, stored)


def verify_shapes(
    label: str, shapes: dict[str, tuple[int, ...]], tied: dict[str, str], stored: dict[str, tuple[int, ...]]
) -> None:
    """Every parameter the model class has is stored (or tied to one that is), each in the expected shape."""
    wrong = [(n, s, shapes[n]) for n, s in stored.items() if n in shapes and s != shapes[n]]
    if wrong:
        name, got, want = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ModelLoadError(f"{label}: tensor {name} has shape {list(got)} but the config expects {list(want)}{more}")
    missing = [n for n in shapes if n not in stored and not (n in tied and tied[n] in stored)]
    if missing:
        more = f" (and {len(missing) - _NAMES_SHOWN} more)" if len(missing) > _NAMES_SHOWN else ""
        raise ModelLoadError(
            f"{label}: missing weights: {', '.join(missing[:_NAMES_SHOWN])}{more}; "
            f"the checkpoint does not match its config"
        )


@contextmanager
def gguf_alone(path: Path) -> Iterator[tuple[str, str]]:
    """(folder, gguf_file) for a transformers from_pretrained that reads this GGUF and nothing beside it: given
    the GGUF's own folder, transformers prefers the files it finds there (an HF model's tokenizer.json,
    tokenizer_config.json and config.json, where convert_hf_to_gguf.py leaves the GGUF) to the GGUF's metadata,
    and its chat template is lost. An empty folder, and the file by its absolute path, which the join keeps."""
    with tempfile.TemporaryDirectory(prefix="gapless-gguf-") as empty:
        yield empty, os.path.abspath(path)


# what a model folder's tokenizer is read from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(folder: Path, label: str, gguf_file: Optional[str] = None) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    elif not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # transformers goes on to build one from nothing and fails with a hint to install sentencepiece
        raise ModelLoadError(f"{label}: no tokenizer in the folder (none of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    except Exception as exc:  # the tokenizers backend raises plain Exception on a damaged tokenizer.json
        if gguf_file is None and _tokenizer_wants_remote_code(folder):
            raise UnsafeModelError(
                f"{label}: the tokenizer asks for remote code; Gapless never runs code from a model folder"
            ) from exc
        raise ModelLoadError(f"{label}: the tokenizer could not be loaded: {one_line(exc)}") from exc
    if tokenizer is None:
        raise ModelLoadError(f"{label}: no tokenizer in the folder (none of {', '.join(TOKENIZER_FILES)})")
    return tokenizer


def _tokenizer_wants_remote_code(folder: Path) -> bool:
    path = folder / "tokenizer_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and bool(data.get("auto_map"))


def _eos_ids(
    config: "PretrainedConfig", tokenizer: "PreTrainedTokenizerBase", folder: Optional[Path], more: Sequence[int] = ()
) -> list[int]:
    """Every id that ends an answer: chat models often list several (e.g. <|eot_id|> and <|end_of_text|>)."""
    found: list[Any] = [getattr(config, "eos_token_id", None), list(more)]
    gen = folder / "generation_config.json" if folder is not None else None
    if gen is not None and gen.is_file():
        try:
            data = json.loads(gen.read_text(encoding="utf-8"))
            found.append(data.get("eos_token_id") if isinstance(data, dict) else None)
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            log.warning("%s: ignoring unreadable generation_config.json: %s", gen.parent.name, exc)
    found.append(getattr(tokenizer, "eos_token_id", None))
    ids: list[int] = []
    for item in found:
        for v in item if isinstance(item, (list, tuple)) else [item]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)
    return ids


# Tokens that end a chat turn (llama.cpp stops on them too): a model whose EOS is another token (Gemma's <eos>, a
# Qwen base model's <|endoftext|> with a ChatML template, early Llama-3-Instruct's <|end_of_text|>) ends its answers
# with one of these where its chat template ends each turn with it.
TURN_END_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")


def _gguf_turn_ends(header, tokenizer, config) -> list[int]:
    """The ids that end a turn besides EOS: the file's end-of-turn and end-of-message ids, and the turn-end
    tokens its chat template writes. An id outside the vocabulary is left out (llama.cpp ignores it too)."""
    vocab_size = getattr(config, "vocab_size", None)
    ids = []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = header.metadata.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            if vocab_size is None or 0 <= v < vocab_size:
                ids.append(v)
            else:
                log.warning("%s: ignoring %s %d, outside the %s-token vocabulary", header.path.name, key, v, vocab_size)
    return ids + _template_turn_ends(tokenizer, config)


def _template_turn_ends(tokenizer, config) -> list[int]:
    """The turn-end tokens (TURN_END_TEXTS) the chat template writes, within the model's vocabulary: a folder's
    model whose EOS is another token ran on past the end of its turn into the next turns (the same model as a
    GGUF stopped there)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return []
    vocab, vocab_size = tokenizer.get_vocab(), getattr(config, "vocab_size", None)
    ids = [vocab[t] for t in TURN_END_TEXTS if t in template and t in vocab]
    return [i for i in ids if vocab_size is None or 0 <= i < vocab_size]


def _read_json(path: Path, label: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{label}: {path.name} is not valid JSON: {one_line(exc)}") from exc
    except RecursionError:
        raise ModelLoadError(f"{label}: {path.name} is nested too deeply to read") from None


def _read_head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError as exc:
        raise ModelLoadError(f"{path.name}: cannot read: {exc.strerror or exc}") from exc


def _ignore(_: Progress) -> None:
    return None
