"""Bad model files: each is refused with the exact error class and a one-line message naming the problem.

Pickles carry a live payload (unpickling it creates a marker file; a control test proves that it does), so a
refusal that happened after unpickling would leave the marker behind."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from gguf_fixtures import hf_llama_to_gguf

from engine.errors import ModelLoadError, UnsafeModelError
from engine.gguf_header import read_gguf_header
from engine.loader import load_checkpoint


class Payload:
    """Unpickling this creates `marker`: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _refused(cls: type, source, match: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(source))
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message
    assert match.lower() in message.lower(), message
    return message


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "PAYLOAD_RAN"
    yield path
    assert not path.exists(), "a pickle payload was executed"


def test_payload_is_live(tmp_path):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Payload(control)))
    assert control.exists()


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".PT")


@pytest.mark.parametrize(
    "name, cls, match",
    [
        *[(f"model{suffix}", UnsafeModelError, "pickle") for suffix in PICKLE_SUFFIXES],
        pytest.param("weights", UnsafeModelError, "pickle", id="zip-pickle-without-suffix-is-recognised"),
        pytest.param("model.gguf", ModelLoadError, "not a GGUF file", id="pickle-disguised-as-gguf"),
    ],
)
def test_pickle_file_is_refused_before_unpickling(tmp_path, marker, name, cls, match):
    path = tmp_path / name
    torch.save({"weight": Payload(marker)}, path)  # the zip + pickle format of a real checkpoint
    _refused(cls, path, match)


def test_bare_pickle_without_suffix_is_recognised(tmp_path, marker):
    path = tmp_path / "model"
    path.write_bytes(pickle.dumps({"weight": Payload(marker)}, protocol=4))
    _refused(UnsafeModelError, path, "pickle")


def test_folder_with_only_pickle_weights(tiny_llama, tmp_path, marker):
    folder = shutil.copytree(tiny_llama, tmp_path / "pickled")
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    message = _refused(UnsafeModelError, folder, "pickle")
    assert "pytorch_model.bin" in message


def test_folder_with_safetensors_and_pickle_uses_safetensors(tiny_llama, tmp_path, marker):
    folder = shutil.copytree(tiny_llama, tmp_path / "both")
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    assert load_checkpoint(str(folder)).source_kind == "hf-folder"


def test_pickle_disguised_as_safetensors(tiny_llama, tmp_path, marker):
    folder = shutil.copytree(tiny_llama, tmp_path / "disguised")
    torch.save({"weight": Payload(marker)}, folder / "model.safetensors")
    _refused(ModelLoadError, folder, "model.safetensors is not a readable safetensors file")


def _remote_code_folder(tiny_llama: Path, dest: Path, marker: Path, model_type: str) -> Path:
    folder = shutil.copytree(tiny_llama, dest)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["architectures"] = ["EvilForCausalLM"]
    cfg["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    code = f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
    (folder / "configuration_evil.py").write_text(code + "class EvilConfig: pass\n")
    (folder / "modeling_evil.py").write_text(code + "class EvilForCausalLM: pass\n")
    return folder


@pytest.mark.parametrize(
    "name, said",
    [
        ("config.json", "config.json is nested too deeply to read"),
        ("tokenizer_config.json", "the tokenizer could not be loaded: maximum recursion depth exceeded"),
        ("generation_config.json", None),  # only read for more end-of-answer ids: the model loads without them
    ],
)
def test_a_model_folder_s_json_nested_too_deeply_is_named(tiny_llama, tmp_path, name, said):
    """A config nested past Python's recursion limit ended the load in "internal error: RecursionError"."""
    folder = shutil.copytree(tiny_llama, tmp_path / "nested")
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    if said is None:
        assert load_checkpoint(str(folder)).config.model_type == "llama"
    else:
        _refused(ModelLoadError, folder, said)


def test_folder_asking_for_remote_code(tiny_llama, tmp_path, marker):
    folder = _remote_code_folder(tiny_llama, tmp_path / "remote", marker, model_type="evil")
    message = _refused(UnsafeModelError, folder, "remote code")
    assert "'evil'" in message and "never runs code" in message


def test_remote_code_ignored_when_the_model_type_is_native(tiny_llama, tmp_path, marker):
    folder = _remote_code_folder(tiny_llama, tmp_path / "native", marker, model_type="llama")
    ck = load_checkpoint(str(folder))
    assert type(ck.config).__name__ == "LlamaConfig"


def test_tokenizer_asking_for_remote_code(tiny_llama, tmp_path, marker):
    folder = shutil.copytree(tiny_llama, tmp_path / "remote-tokenizer")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "tokenization_evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    _refused(UnsafeModelError, folder, "tokenizer asks for remote code")


def test_missing_path(tmp_path):
    _refused(ModelLoadError, tmp_path / "nowhere" / "model.gguf", "model not found")


@pytest.mark.parametrize("source", ["", "  "])
def test_no_source(source):
    _refused(ModelLoadError, source, "no model given")


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(ModelLoadError, tmp_path / "empty", "no model weights")


def test_directory_with_config_but_no_weights(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    _refused(ModelLoadError, folder, "no model weights")


def test_directory_holding_a_gguf_points_to_it(tiny_gguf, tmp_path):
    folder = tmp_path / "ggufdir"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "x.gguf")
    _refused(ModelLoadError, folder, "choose the file itself (x.gguf)")


def test_unknown_file_type(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    _refused(ModelLoadError, path, "not a model Gapless can load")


def test_a_fifo_is_refused_at_once(tmp_path):
    """Opened to read its first bytes, a FIFO with no writer waited forever."""
    fifo = tmp_path / "model"
    os.mkfifo(fifo)
    _refused(ModelLoadError, fifo, "model: not a model Gapless can load (not a regular file or a folder)")
    named = tmp_path / "model.gguf"
    os.mkfifo(named)
    _refused(ModelLoadError, named, "model.gguf: not a model Gapless can load (not a regular file or a folder)")
    with pytest.raises(ModelLoadError, match="model.gguf: not a regular file"):
        read_gguf_header(named)  # as a draft model's or a listed model's header is read


def test_a_name_too_long_for_the_file_system_is_one_line(tmp_path):
    """Path.exists() raises for a name too long (and for a folder the user may not open): a traceback."""
    _refused(ModelLoadError, tmp_path / ("c" * 300 + ".gguf"), "cannot open the model")


# ---- GGUF ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    return hf_llama_to_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_gguf_data(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    message = _refused(ModelLoadError, path, "truncated GGUF file")
    assert "cut.gguf" in message


def test_truncated_gguf_header(tiny_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[:300])
    _refused(ModelLoadError, path, "truncated or damaged GGUF file (its header runs past the end")


def test_gguf_with_corrupt_magic(tiny_gguf, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUX" + tiny_gguf.read_bytes()[4:])
    _refused(ModelLoadError, path, "corrupt header, not a GGUF file")


def test_gguf_with_garbage_counts(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # tensor count
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    _refused(ModelLoadError, path, "corrupt GGUF header")


def test_gguf_metadata_arrays_nested_past_any_use_are_refused(tmp_path):
    """A 12 KB file of one value, an array of arrays 1,000 deep: a RecursionError (an internal error)."""
    import struct

    body = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9)  # key "x", an array
    body += struct.pack("<IQ", 9, 1) * 1000 + struct.pack("<IQ", 4, 0)  # of one array, ..., of no uint32
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    _refused(ModelLoadError, path, "corrupt GGUF header (metadata arrays nested deeper than 16 levels")


def test_gguf_whose_layer_count_is_met_by_one_far_block_is_refused_at_once(tiny_llama, tmp_path):
    """A 390 KB file saying 100,000 layers, with a tensor for the last one: 5.5 GB of tensor-name map and model
    before a MemoryError."""
    import numpy as np
    from gguf import GGUFValue, GGUFValueType

    def far(w):
        w.kv_data[0]["llama.block_count"] = GGUFValue(100_000, GGUFValueType.UINT32)
        w.add_tensor("blk.99999.attn_norm.weight", np.ones(64, dtype=np.float32))

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "far.gguf", edit=far)
    _refused(ModelLoadError, path, "layers blk.0 to blk.99999, but 99997 of them have none (the first: blk.2)")


def test_gguf_with_unknown_version(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    path = tmp_path / "v7.gguf"
    path.write_bytes(bytes(data))
    _refused(ModelLoadError, path, "unsupported GGUF version 7")


def test_empty_gguf(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _refused(ModelLoadError, path, "empty")


def _patched(gguf_bytes: bytes, key: str, value: int) -> bytes:
    """The file with the integer metadata value under `key` replaced (its width kept: uint32 as the writer
    writes sizes)."""
    import struct

    data = bytearray(gguf_bytes)
    at = data.index(key.encode()) + len(key)
    (type_id,) = struct.unpack_from("<I", data, at)
    assert type_id == 4, f"{key} is ggml value type {type_id}, not uint32"
    struct.pack_into("<I", data, at + 4, value)
    return bytes(data)


def _tensor_offset_moved(gguf_bytes: bytes, name: str, by: int) -> bytes:
    import struct

    data = bytearray(gguf_bytes)
    at = data.index(name.encode()) + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims + 4  # the dims, then the type
    (offset,) = struct.unpack_from("<Q", data, at)
    struct.pack_into("<Q", data, at, offset + by)
    return bytes(data)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("llama.block_count", 0, "num_hidden_layers = 0; it must be at least 1"),
        ("llama.attention.head_count", 0, "num_attention_heads = 0; it must be at least 1"),
        ("llama.context_length", 0, "max_position_embeddings = 0; it must be at least 1"),
        ("llama.block_count", 1, "says 1 layers, but its tensors are for 2 (blk.0 to blk.1)"),
        ("llama.block_count", 3, "says 3 layers, but its tensors are for 2"),
        ("llama.embedding_length", 63, "cannot read the model settings in this GGUF"),
    ],
)
def test_gguf_with_impossible_sizes_is_refused_at_load(tiny_gguf, tmp_path, key, value, match):
    """A damaged size in the metadata is said as such, where it would fail far from its cause (a division by zero
    in the config, a model of no layers, layers missing their weights)."""
    path = tmp_path / "sizes.gguf"
    path.write_bytes(_patched(tiny_gguf.read_bytes(), key, value))
    _refused(ModelLoadError, path, match)


@pytest.mark.parametrize("value", ["10000", 0.0, -10000.0], ids=["string", "zero", "negative"])
def test_a_gguf_whose_rope_base_is_not_a_positive_number_is_refused(tiny_llama, tmp_path, value):
    """A string failed building the model with "unsupported operand type(s) for ** or pow(): 'str' and 'Tensor'";
    0 or a negative base loaded, then every answer's first token scored NaN, reported as damaged weights."""

    def base(w):
        w.kv_data[0].pop("llama.rope.freq_base")
        if isinstance(value, str):
            w.add_string("llama.rope.freq_base", value)
        else:
            w.add_float32("llama.rope.freq_base", value)

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "base.gguf", edit=base)
    _refused(ModelLoadError, path, f"the GGUF's metadata gives rope_theta = {value!r}; it must be a positive number")


@pytest.mark.parametrize("kind, said", [("int", "int"), ("list", "a list")])
def test_a_gguf_whose_chat_template_is_not_text_is_refused(tiny_llama, tmp_path, kind, said):
    """It loaded, then every message failed with "Can't compile non template nodes" (an internal error)."""

    def template(w):
        w.kv_data[0].pop("tokenizer.chat_template", None)
        if kind == "int":
            w.add_uint32("tokenizer.chat_template", 7)
        else:
            w.add_array("tokenizer.chat_template", ["{{ messages }}", "{{ bos_token }}"])

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "template.gguf", edit=template)
    _refused(ModelLoadError, path, f"corrupt GGUF metadata (tokenizer.chat_template is {said}, not text)")


def test_gguf_with_a_misaligned_tensor_is_refused(tiny_gguf, tmp_path):
    path = tmp_path / "moved.gguf"
    path.write_bytes(_tensor_offset_moved(tiny_gguf.read_bytes(), "blk.0.ffn_down.weight", 3))
    _refused(ModelLoadError, path, "'blk.0.ffn_down.weight' starts at offset")


def test_gguf_with_a_tensor_pointing_at_another_s_data_is_refused(tiny_gguf, tmp_path):
    """A damaged offset that still fell on the alignment loaded another tensor's bytes as this one's weights."""
    header = read_gguf_header(tiny_gguf)
    names = [t.name for t in header.tensors]
    moved, after = names[1], header.tensors[2]
    path = tmp_path / "moved.gguf"
    path.write_bytes(_tensor_offset_moved(tiny_gguf.read_bytes(), moved, after.offset - header.tensors[1].offset))
    _refused(ModelLoadError, path, f"corrupt GGUF header (tensor '{moved}' starts at offset {after.offset}, where")


def test_gguf_with_unsupported_quantisation(tiny_llama, tmp_path):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "q81.gguf", tensor_types={"blk.0.attn_q.weight": "Q8_1"})
    message = _refused(ModelLoadError, path, "unsupported GGUF quantisation Q8_1")
    assert "blk.0.attn_q.weight" in message


def test_gguf_with_unsupported_architecture(tiny_llama, tmp_path):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "odd.gguf", architecture="gapless-mystery")
    message = _refused(ModelLoadError, path, "unsupported GGUF architecture 'gapless-mystery'")
    assert "llama" in message and "qwen2" in message


def test_a_gguf_architecture_transformers_names_but_cannot_build_is_refused_as_unsupported(tiny_llama, tmp_path):
    """transformers' GGUF table lists "deci", which it has no model for: the refusal was its own long text
    ("... does not recognize this architecture ... You can update Transformers ...")."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "deci.gguf", architecture="deci")
    message = _refused(ModelLoadError, path, "unsupported GGUF architecture 'deci'")
    assert "Transformers" not in message


def test_a_lora_adapter_gguf_is_refused_as_an_adapter(tiny_llama, tmp_path):
    """It was reported as a tokenizer that could not be built."""

    def adapter(w):
        w.add_type("adapter")
        w.add_string("adapter.type", "lora")

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "my-lora.gguf", edit=adapter)
    _refused(ModelLoadError, path, "my-lora.gguf: a lora adapter, not a model: open the model it was made for")


@pytest.mark.parametrize("key", ["tokenizer.ggml.padding_token_id", "tokenizer.ggml.bos_token_id"])
def test_a_special_token_id_outside_the_vocabulary_is_named(tiny_llama, tmp_path, key):
    """The tokenizer's conversion failed with "list index out of range"."""

    def far(w):
        w.kv_data[0].pop(key, None)
        w.add_uint32(key, 100_000)

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "far.gguf", edit=far)
    _refused(ModelLoadError, path, f"the GGUF's {key} is 100000, outside its 320-token vocabulary")


def test_tensors_the_model_does_not_have_are_refused_not_dropped(tiny_factory, tmp_path):
    """A Llama GGUF with q/k/v biases (a "llamafied" Qwen; the metadata cannot say so) loaded without them, and
    answered as another model would."""
    folder = tiny_factory("qwen2")  # q/k/v biases
    path = hf_llama_to_gguf(folder, tmp_path / "llamafied.gguf", architecture="llama")
    message = _refused(ModelLoadError, path, "the GGUF holds tensors a llama model does not have (blk.0.attn_")
    assert message.endswith("it cannot be run as written") and "more" in message


def test_a_llama_gguf_named_mistral_loads(tiny_factory, tmp_path):
    """transformers reads a Llama GGUF named "mistral" as a Mistral, whose tensor names the gguf package lacks."""
    folder = tiny_factory("mistral")

    def named(w):
        w.kv_data[0]["general.name"].value = "mistral"

    path = hf_llama_to_gguf(folder, tmp_path / "m.gguf", edit=named)
    got, want = load_checkpoint(str(path)), load_checkpoint(str(folder))
    assert got.config.model_type == "mistral"
    for name, t in want.state_dict.items():
        assert torch.equal(got.state_dict[name], t), name


# ---- safetensors folders ---------------------------------------------------------------------------------


def test_a_folder_without_a_tokenizer_says_so(tiny_llama, tmp_path):
    """transformers built one from nothing and failed with a hint to install sentencepiece."""
    folder = shutil.copytree(tiny_llama, tmp_path / "no-tokenizer")
    for f in folder.glob("tokenizer*"):
        f.unlink()
    _refused(ModelLoadError, folder, "no-tokenizer: no tokenizer in the folder (none of tokenizer.json,")


def test_safetensors_shapes_do_not_match_the_config(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "shapes")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the stored MLP weights are 128 wide
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(
        ModelLoadError,
        folder,
        "tensor model.layers.0.mlp.down_proj.weight has shape [64, 128] but the config expects [64, 96]",
    )


def test_missing_weights_are_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_llama, tmp_path / "missing")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    _refused(ModelLoadError, folder, "missing weights: model.layers.1.mlp.up_proj.weight")


@pytest.mark.parametrize("theta", [0.0, -1.0])
def test_a_config_whose_rope_base_is_not_a_positive_number_is_refused(tiny_llama, tmp_path, theta):
    """It loaded, and the first token scored NaN: "its weights are damaged, or its numbers overflow in this dtype"."""
    folder = shutil.copytree(tiny_llama, tmp_path / "theta")
    config = json.loads((folder / "config.json").read_text())
    rope = {**(config.get("rope_parameters") or {"rope_type": "default"}), "rope_theta": theta}
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": theta, "rope_parameters": rope}))
    _refused(ModelLoadError, folder, f"config.json gives rope_theta = {theta!r}; it must be a positive number")


def test_a_config_asking_for_layers_the_weights_lack_is_refused_before_the_model_is_built(tiny_llama, tmp_path):
    """100,000 layers in config.json were all built (3 minutes, 4.8 GB) before the missing weights were named."""
    folder = shutil.copytree(tiny_llama, tmp_path / "deep")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    _refused(ModelLoadError, folder, "config.json gives num_hidden_layers = 100000, but the weights hold layers 0 to 1")


def test_untied_config_without_lm_head(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "untied")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(ModelLoadError, folder, "missing weights: lm_head.weight")


def test_truncated_safetensors(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "cut")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(ModelLoadError, folder, "model.safetensors")


def test_index_naming_a_missing_shard(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "shards")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    _refused(ModelLoadError, folder, "model-00002-of-00002.safetensors")


@pytest.mark.parametrize(
    "model_type, arch, match",
    [
        (
            "gapless_mystery",
            "MysteryForCausalLM",
            "unsupported architecture: model type 'gapless_mystery' (MysteryForCausalLM)",
        ),
        ("vit", "ViTModel", "ViTModel (model type 'vit') is not a causal language model"),
        (None, "LlamaForCausalLM", "config.json has no model_type"),
    ],
)
def test_unsupported_architecture_in_config(tiny_llama, tmp_path, model_type, arch, match):
    folder = shutil.copytree(tiny_llama, tmp_path / "arch")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("model_type")
    if model_type:
        cfg["model_type"] = model_type
    cfg["architectures"] = [arch]
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(ModelLoadError, folder, match)


def test_config_that_is_not_json(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "badjson")
    (folder / "config.json").write_text("{ not json")
    _refused(ModelLoadError, folder, "config.json is not valid JSON")


def test_broken_tokenizer(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "badtok")
    (folder / "tokenizer.json").write_text("{ broken")
    _refused(ModelLoadError, folder, "the tokenizer could not be loaded")


# ---- through the CLI: one line on stderr, a non-zero exit, no traceback -------------------------------------


def _cli_generate(model: Path, tmp_path: Path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), GAPLESS_DATA_DIR=str(tmp_path / "data"))
    return subprocess.run(
        [sys.executable, "-m", "app", "generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "4"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("case", ["pickle", "pickle-folder", "remote-code", "truncated-gguf", "shapes"])
def test_cli_answers_a_bad_model_with_one_line(tiny_llama, tiny_gguf, tmp_path, marker, case):
    if case == "pickle":
        model = tmp_path / "model.pt"
        torch.save({"weight": Payload(marker)}, model)
        expected = "pickle checkpoint refused"
    elif case == "pickle-folder":
        model = shutil.copytree(tiny_llama, tmp_path / "pickled")
        (model / "model.safetensors").unlink()
        torch.save({"weight": Payload(marker)}, model / "pytorch_model.bin")
        expected = "only pickle weights (pytorch_model.bin)"
    elif case == "remote-code":
        model = _remote_code_folder(tiny_llama, tmp_path / "remote", marker, model_type="evil")
        expected = "asks for remote code"
    elif case == "truncated-gguf":
        model = tmp_path / "cut.gguf"
        model.write_bytes(tiny_gguf.read_bytes()[:-1000])
        expected = "truncated GGUF file"
    else:
        model = shutil.copytree(tiny_llama, tmp_path / "shapes")
        cfg = json.loads((model / "config.json").read_text())
        cfg["hidden_size"] = 32
        (model / "config.json").write_text(json.dumps(cfg))
        expected = "but the config expects"
    r = _cli_generate(model, tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gapless: error: ") and expected in lines[0]


@pytest.mark.parametrize("split", [True, False])
def test_a_split_or_big_endian_gguf_is_refused_for_what_it_is(tiny_llama, tmp_path, monkeypatch, split):
    """Each part of a split GGUF looked like a broken model ("missing weights", "no general.architecture"), and a
    big-endian one like a GGUF of version 50331648."""
    import gguf

    real = gguf.GGUFWriter.__init__

    def writer(self, path, arch, *a, **k):
        if split:
            k["split_max_tensors"] = 12
        else:
            k["endianess"] = gguf.GGUFEndian.BIG
        real(self, path, arch, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "__init__", writer)
    hf_llama_to_gguf(tiny_llama, tmp_path / "m.gguf")
    files = sorted(tmp_path.glob("*.gguf"))
    if split:
        assert len(files) > 1
        for i, f in enumerate(files):
            _refused(ModelLoadError, f, f"part {i + 1} of a GGUF split into {len(files)} files")
    else:
        _refused(ModelLoadError, files[0], "a big-endian GGUF")


def test_a_gguf_whose_tokenizer_lacks_its_merges_says_what_is_missing(tiny_llama, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_token_merges", lambda self, merges: None)
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "nomerges.gguf")
    _refused(ModelLoadError, path, "its tokenizer metadata is incomplete (no tokenizer.ggml.")


def test_a_gguf_naming_a_tensor_twice_is_refused(tiny_gguf, tmp_path):
    """The later tensor silently replaced the earlier (a damaged name read as another layer's weight)."""
    data = bytearray(tiny_gguf.read_bytes())
    at = data.index(b"blk.1.ffn_down.weight")
    data[at : at + 5] = b"blk.0"
    path = tmp_path / "twice.gguf"
    path.write_bytes(bytes(data))
    _refused(ModelLoadError, path, "corrupt GGUF header (duplicate tensor 'blk.0.ffn_down.weight')")


def test_a_gguf_whose_token_types_do_not_match_its_tokens_is_refused(tiny_llama, tmp_path, monkeypatch):
    """Five token types for 320 tokens loaded as a tokenizer whose special tokens were plain text."""
    import gguf

    real = gguf.GGUFWriter.add_token_types
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_types", lambda self, types: real(self, list(types)[:5]))
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "types.gguf")
    _refused(ModelLoadError, path, "tokenizer.ggml.token_type has 5 entries for")


@pytest.mark.parametrize(
    "add, value, shown",
    [("add_float32", 32.0, "32.0"), ("add_string", "32", "'32'"), ("add_array", [32], "[32]")],
    ids=["float", "string", "array"],  # a string one failed with "'<=' not supported between 'str' and 'int'"
)
def test_a_gguf_whose_alignment_is_not_an_integer_is_refused(tiny_llama, tmp_path, monkeypatch, add, value, shown):
    import gguf

    real = gguf.GGUFWriter.add_token_merges

    def merges_and_an_odd_alignment(self, merges):
        real(self, merges)
        getattr(self, add)("general.alignment", value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_token_merges", merges_and_an_odd_alignment)
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "align.gguf")
    _refused(ModelLoadError, path, f"corrupt GGUF header (general.alignment is {shown}, not an integer)")
