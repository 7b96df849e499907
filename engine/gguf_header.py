"""A GGUF file's header, read and checked before any library parses it.

Why our own reader: the libraries report a damaged file as an index or reshape error deep in their code. Walking
the header here (magic, version, metadata, tensor table) costs well under a second even for a 49k-token
vocabulary, and lets the loader say in one line what is wrong: not a GGUF file, truncated, an architecture or a
quantisation nobody here can read. Nothing is executed from the file; it is only measured.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field, replace
from math import prod
from pathlib import Path
from typing import Any, Optional

import numpy as np

from engine.errors import ModelLoadError
from engine.paths import file_stamp

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 counted with 32-bit integers; no file in use still has it
DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent

# metadata value types: fixed-size ones by struct code; 8 = string and 9 = array are walked
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_ARRAY_KEPT = 4096  # longer arrays (vocabularies, token types, scores) are only measured
_ARRAY_NESTING = 16  # arrays of arrays: llama.cpp writes none nested; deeper ones were a RecursionError


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (ggml stores the fastest-moving dimension first)
    type_id: int  # ggml type id
    type_name: str  # e.g. Q4_1, or "type 99" for an id this gguf package does not know
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    architecture: str
    name: str | None  # general.name
    tensors: tuple[GGUFTensor, ...]
    data_start: int
    file_size: int
    byte_order: str = "<"  # struct/numpy prefix: "<" little-endian, ">" big-endian
    rope_scaling_type: str | None = None  # {architecture}.rope.scaling.type
    rope_scaling_factor: float | None = None  # {architecture}.rope.scaling.factor
    # every scalar and string value, and fixed-type arrays of up to _ARRAY_KEPT items as lists, in file order
    metadata: dict[str, object] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)  # every array's length (a vocabulary's, say)
    # which file was read (size, time, device, inode): the weights are read from the same one (engine.loader)
    identity: tuple[int, ...] = ()


class _Truncated(Exception):
    """The header runs past the end of the file."""


class _Cursor:
    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, code: str):
        size = struct.calcsize(code)
        if self.pos + size > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> bytes:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise _Truncated
        value = self.buf[self.pos : self.pos + n]
        self.pos += n
        return value

    def skip_value(self, type_id: int, depth: int = 0) -> None:
        if type_id in _FIXED:
            self.skip(struct.calcsize(_FIXED[type_id]))
        elif type_id == _STRING:
            self.skip(self.take("Q"))
        elif type_id == _ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _FIXED:
                self.skip(count * struct.calcsize(_FIXED[item_type]))
            elif item_type == _STRING:
                self.skip_strings(count)
            elif depth >= _ARRAY_NESTING:
                raise ValueError(f"metadata arrays nested deeper than {_ARRAY_NESTING} levels at byte {self.pos}")
            else:
                for _ in range(count):
                    self.skip_value(item_type, depth + 1)
        else:
            raise ValueError(f"unknown metadata value type {type_id} at byte {self.pos}")

    def skip_strings(self, count: int) -> None:
        """Past `count` strings (a vocabulary's ~50k, say) in one tight loop: each is its u64 length and bytes."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated
            pos += 8 + length(buf, pos)[0]
        if pos > end:
            raise _Truncated
        self.pos = pos

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Truncated
        self.pos += n


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and check the header and tensor table of `path`. Raises ModelLoadError naming the problem."""
    path = Path(path)
    label = path.name
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO waited forever for a writer
            raise ModelLoadError(f"{label}: not a regular file")
        if st.st_size == 0:
            raise ModelLoadError(f"{label}: the file is empty")
        f = open(path, "rb")
    except OSError as exc:  # unreadable to this user, a name too long
        raise ModelLoadError(f"{label}: cannot read: {exc.strerror or exc}") from exc
    size = st.st_size
    with f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(
                f"{label}: corrupt header, not a GGUF file (it does not start with the GGUF magic bytes)"
            )
        identity = file_stamp(os.fstat(f.fileno()))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return replace(_parse(path, buf, size), identity=identity)
            except _Truncated:
                raise ModelLoadError(
                    f"{label}: truncated or damaged GGUF file (its header runs past the end of its {size} bytes)"
                ) from None
            except (ValueError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
                raise ModelLoadError(f"{label}: corrupt GGUF header ({exc})") from None


# ggml type id -> (name, values per block, bytes per block) for the types most files hold (ggml.h's numbering,
# the sizes of ggml-common.h), so a header of these reads without importing the gguf package; others ask it.
_COMMON_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


def _ggml_type(type_id: int) -> Optional[tuple[str, int, int]]:
    if type_id in _COMMON_TYPES:
        return _COMMON_TYPES[type_id]
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return qtype.name, block, type_size


def _parse(path: Path, buf: mmap.mmap, size: int) -> GGUFHeader:
    if size < 24:  # magic, version and the two counts
        raise _Truncated
    (raw_version,) = struct.unpack_from("<I", buf, 4)
    # a big-endian file reads as a huge little-endian version (its low 16 bits are zero)
    order = ">" if raw_version & 0xFFFF == 0 else "<"
    cur = _Cursor(buf, order)
    cur.pos = 4
    version = cur.take("I")
    if version not in GGUF_VERSIONS:
        raise ModelLoadError(f"{path.name}: unsupported GGUF version {version} (supported: 2, 3)")
    tensor_count, kv_count = cur.take("Q"), cur.take("Q")
    if tensor_count > size or kv_count > size:  # each entry takes at least a byte: the counts are garbage
        raise ValueError(f"impossible counts: {tensor_count} tensors, {kv_count} metadata entries")

    wanted: dict[bytes, Any] = {b"general.architecture": None, b"general.name": None, b"general.alignment": None}
    rope: dict[bytes, Any] = {}  # every "*.rope.scaling.type|factor": the architecture may come later
    metadata: dict[str, object] = {}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = cur.string()
        type_id = cur.take("I")
        value: Any = None  # by type_id: int, float or bool; str; a list of them
        if type_id in _FIXED:
            value = cur.take(_FIXED[type_id])
        elif type_id == _STRING:
            value = cur.string().decode("utf-8")
        elif type_id == _ARRAY:
            item_type, count = cur.take("I"), cur.take("Q")
            lengths[key.decode("utf-8")] = count
            if item_type in _FIXED and count <= _ARRAY_KEPT:
                value = [cur.take(_FIXED[item_type]) for _ in range(count)]
            else:
                cur.pos -= 12
                cur.skip_value(type_id)
        else:
            cur.skip_value(type_id)
        if value is not None:
            metadata[key.decode("utf-8")] = value
        if key == b"general.alignment":
            if isinstance(value, bool) or not isinstance(value, int):  # llama.cpp reads it as a uint32
                raise ValueError(f"general.alignment is {value!r}, not an integer")
            wanted[key] = value
        elif key in wanted and type_id == _STRING:
            wanted[key] = value
        elif key.endswith(b".rope.scaling.type") and type_id == _STRING:
            rope[key] = value
        elif key.endswith(b".rope.scaling.factor") and type_id in _FIXED:
            rope[key] = float(value)
    arch = (wanted[b"general.architecture"] or "").encode("utf-8")

    tensors = []
    names: set[str] = set()
    for _ in range(tensor_count):
        name = cur.string().decode("utf-8")
        if name in names:  # the later one would silently replace the earlier (gguf's reader refuses it too)
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.take("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.take("Q") for _ in range(n_dims)]
        type_id, offset = cur.take("I"), cur.take("Q")
        tensors.append((name, tuple(reversed(dims)), type_id, offset))

    alignment = wanted[b"general.alignment"] or DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a power of two")
    data_start = (cur.pos + alignment - 1) // alignment * alignment

    checked = []
    follows: Optional[int] = 0  # where the next tensor's data starts: each follows the one before, padded
    for name, shape, type_id, offset in tensors:
        if offset % alignment:  # as llama.cpp refuses it: a damaged offset, whatever the data there would read as
            raise ValueError(f"tensor {name!r} starts at offset {offset}, not on the file's {alignment}-byte alignment")
        known = _ggml_type(type_id)
        if known is None:
            checked.append(GGUFTensor(name, shape, type_id, f"type {type_id}", offset, 0))
            follows = None  # its size is unknown (and the file is refused for its type)
            continue
        type_name, block, type_size = known
        n = prod(shape)
        if n % block:
            raise ValueError(f"tensor {name!r} of {n} elements is not a whole number of {type_name} blocks")
        if follows is not None and offset != follows:  # llama.cpp refuses it too: another tensor's bytes, say
            raise ValueError(f"tensor {name!r} starts at offset {offset}, where the tensors before it end at {follows}")
        nbytes = n // block * type_size
        follows = offset + (nbytes + alignment - 1) // alignment * alignment
        checked.append(GGUFTensor(name, shape, type_id, type_name, offset, nbytes))
    return GGUFHeader(
        path=path,
        version=version,
        architecture=wanted[b"general.architecture"] or "",
        name=wanted[b"general.name"],
        tensors=tuple(checked),
        data_start=data_start,
        file_size=size,
        byte_order=order,
        rope_scaling_type=rope.get(arch + b".rope.scaling.type"),
        rope_scaling_factor=rope.get(arch + b".rope.scaling.factor"),
        metadata=metadata,
        array_lengths=lengths,
    )


def can_dequantise(type_id: int) -> bool:
    """Whether tensors of this ggml type can be turned into floats: the common types by the project's own
    de-quantisation (engine.gguf_dequant, and the gguf package alike), others where the installed gguf package
    can."""
    if type_id in _COMMON_TYPES:
        return True
    import gguf
    from gguf.quants import dequantize

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return False
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:  # one zero block: a probe through the public function, not the package's private tables
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_gguf(path: Path, supported_architectures: set[str], header: Optional[GGUFHeader] = None) -> GGUFHeader:
    """The header of `path` (read here unless given), after checking it can be loaded here: architecture,
    quantisation, completeness.

    Architecture names match with "-" and "_" ignored: llama.cpp writes "qwen2moe" where transformers says
    "qwen2_moe"."""
    header = header or read_gguf_header(path)
    label = header.path.name
    parts, part = header.metadata.get("split.count"), header.metadata.get("split.no")
    if isinstance(parts, int) and parts > 1:
        number = f"part {part + 1}" if isinstance(part, int) else "a part"
        raise ModelLoadError(
            f"{label}: {number} of a GGUF split into {parts} files; Gapless opens a model in one file: join the "
            "parts with llama.cpp's llama-gguf-split --merge (given the first part and a new file's name)"
        )
    if header.byte_order == ">":
        raise ModelLoadError(
            f"{label}: a big-endian GGUF (converted for s390x and the like); Gapless reads the little-endian "
            "files llama.cpp writes by default"
        )
    if not header.architecture:
        raise ModelLoadError(f"{label}: corrupt GGUF header (no general.architecture)")
    if header.metadata.get("general.type") == "adapter":
        kind = header.metadata.get("adapter.type")
        raise ModelLoadError(
            f"{label}: a {kind + ' ' if isinstance(kind, str) else ''}adapter, not a model: open the model it "
            "was made for (Gapless does not apply adapters)"
        )
    if "tokenizer.chat_template" in header.metadata or "tokenizer.chat_template" in header.array_lengths:
        template = header.metadata.get("tokenizer.chat_template")
        if not isinstance(template, str):  # every message failed with "Can't compile non template nodes"
            kind = "a list" if "tokenizer.chat_template" in header.array_lengths else type(template).__name__
            raise ModelLoadError(f"{label}: corrupt GGUF metadata (tokenizer.chat_template is {kind}, not text)")
    if _plain(header.architecture) not in {_plain(a) for a in supported_architectures}:
        raise ModelLoadError(
            f"{label}: unsupported GGUF architecture {header.architecture!r} "
            f"(this transformers reads: {', '.join(sorted(supported_architectures))})"
        )
    verdict: dict[int, bool] = {}
    for t in header.tensors:
        if t.type_id not in verdict:
            verdict[t.type_id] = can_dequantise(t.type_id)
        if not verdict[t.type_id]:
            raise ModelLoadError(f"{label}: unsupported GGUF quantisation {t.type_name} (tensor {t.name!r})")
    end = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=header.data_start)
    if end > header.file_size:
        raise ModelLoadError(f"{label}: truncated GGUF file ({header.file_size} bytes; its tensors need {end} bytes)")
    return header


def _plain(name: str) -> str:
    return name.replace("-", "").replace("_", "").lower()


def read_gguf_rope(header: GGUFHeader) -> tuple[Optional[str], Optional[float], Optional[np.ndarray]]:
    """(scaling type, scaling factor, per-frequency factors) of a GGUF: its rope scaling metadata, as parsed
    with the header, and its `rope_freqs.weight` tensor (F32), read from the file; None where absent."""
    return header.rope_scaling_type, header.rope_scaling_factor, read_gguf_f32(header, "rope_freqs.weight")


def read_gguf_f32(header: GGUFHeader, name: str) -> Optional[np.ndarray]:
    """The F32 tensor `name` of a GGUF (a small one: rope factors), read from the file; None where absent."""
    t = next((t for t in header.tensors if t.name == name), None)
    if t is None:
        return None
    if t.type_name != "F32":
        raise ModelLoadError(f"{header.path.name}: {name} is {t.type_name}, not F32")
    return np.fromfile(
        header.path, dtype=np.dtype(header.byte_order + "f4"), count=prod(t.shape), offset=header.data_start + t.offset
    )
