"""The native GGUF path against its references: every block type de-quantised bit-exactly as the gguf package
does it, tiny GGUF models loaded to exactly transformers' tensors, config and tokenizer, the converted cache
(used, invalidated, rebuilt), and the default model (slow)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_fixtures import gguf_name, hf_llama_to_gguf, random_blocks

from engine import gguf_native
from engine.errors import ModelLoadError
from engine.fast_tokenizer import FastTokenizer
from engine.gguf_dequant import BLOCKS, dequantize
from engine.gguf_header import check_gguf, read_gguf_header
from engine.loader import _load_gguf_transformers, gguf_architectures, load_checkpoint
from engine.prompt import build_prompt

TEXT = "hello world <|im_start|>user\nParis is the capital of France. 42 ünï"
WRITER_QUANTISES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    root = tmp_path / "converted"
    monkeypatch.setattr(gguf_native, "cache_root", lambda: root)
    return root


def _reference(path: Path):
    return _load_gguf_transformers(check_gguf(path, gguf_architectures()), lambda p: None, "gguf")


def _assert_same_checkpoint(ck, ref) -> None:
    assert sorted(ck.state_dict) == sorted(ref.state_dict)
    for name, t in ref.state_dict.items():
        got = ck.state_dict[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.view(torch.int32), t.contiguous().view(torch.int32)), name  # bit for bit
    assert ck.config.to_dict() == ref.config.to_dict()
    if not isinstance(ck.tokenizer, FastTokenizer):  # a cached load's stand-in, checked when it was converted
        assert type(ck.tokenizer) is type(ref.tokenizer)
        assert ck.tokenizer.all_special_tokens == ref.tokenizer.all_special_tokens
    ids = ck.tokenizer(TEXT)["input_ids"]
    assert ids == ref.tokenizer(TEXT)["input_ids"]
    assert ck.tokenizer.decode(ids, skip_special_tokens=True) == ref.tokenizer.decode(ids, skip_special_tokens=True)
    assert ck.tokenizer.chat_template == ref.tokenizer.chat_template
    assert ck.tokenizer.all_special_ids == ref.tokenizer.all_special_ids
    assert ck.eos_token_ids == ref.eos_token_ids
    # a special token's text typed in a message is read as text by both (engine.prompt)
    typed = [{"role": "user", "content": "what ends a turn: <|im_end|>?"}]
    prompt = build_prompt(ck.tokenizer, typed, 256, 16)
    assert prompt.ids == build_prompt(ref.tokenizer, typed, 256, 16).ids
    assert ck.tokenizer.decode(prompt.ids) == prompt.text


# ---- de-quantisation -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory) -> Path:
    """One 2-D tensor per type, written with the gguf writer: quantised by gguf where it can, random blocks
    (every bit pattern, finite scales) otherwise, and random blocks of the quantisable types too."""
    import gguf

    path = tmp_path_factory.mktemp("types") / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(1)
    rows, cols = 6, 512
    for name in BLOCKS:
        qtype = gguf.GGMLQuantizationType[name]
        if name == "F32":
            w.add_tensor(name, rng.standard_normal((rows, cols)).astype(np.float32))
        elif name == "F16":
            w.add_tensor(name, rng.standard_normal((rows, cols)).astype(np.float16))
        elif name == "BF16":
            raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            if name in WRITER_QUANTISES:
                x = rng.standard_normal((rows, cols)).astype(np.float32)
                w.add_tensor(f"{name}.quantised", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
            block, _ = gguf.GGML_QUANT_SIZES[qtype]
            raw = random_blocks(name, rows * cols // block, seed=len(name)).reshape(rows, -1)
            w.add_tensor(f"{name}.random", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_dequantise_is_bit_exact_with_the_gguf_package(every_type_gguf, type_name):
    import gguf
    from gguf.quants import dequantize as reference

    header = read_gguf_header(every_type_gguf)
    reader = gguf.GGUFReader(str(every_type_gguf))
    stored = {t.name: t for t in reader.tensors}
    tensors = [t for t in header.tensors if t.name.split(".")[0] == type_name]
    assert tensors and all(t.type_name == type_name for t in tensors)
    data = every_type_gguf.read_bytes()
    for t in tensors:
        start = header.data_start + t.offset
        raw = torch.frombuffer(bytearray(data[start : start + t.nbytes]), dtype=torch.uint8)
        want = torch.from_numpy(np.array(reference(stored[t.name].data, stored[t.name].tensor_type)))
        want = want.float().reshape(t.shape)
        got = dequantize(raw, type_name, t.shape, torch.float32)
        assert got.shape == want.shape
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), t.name
        assert torch.isfinite(got).all()
        for dtype in (torch.bfloat16, torch.float16):  # straight into the target dtype: fp32, then one rounding
            assert torch.equal(dequantize(raw, type_name, t.shape, dtype), want.to(dtype)), (t.name, dtype)


PACKAGE_TYPES = ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"]


@pytest.mark.parametrize("type_name", PACKAGE_TYPES)
def test_types_only_the_gguf_package_knows_are_its_dequantize_in_the_asked_dtype(type_name, monkeypatch):
    """A file with one such tensor went whole through transformers' reader: fp32 whatever dtype was asked (an
    8B Q3_K_M would hold 32 GB), and 11.5 s against 2.5 s for a 43M-parameter Llama shape (2-core CPU)."""
    import gguf

    from engine.gguf_dequant import supported

    qtype = gguf.GGMLQuantizationType[type_name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 5, 512
    blocks = random_blocks(type_name, rows * cols // block, seed=7)
    want = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype))).float().reshape(rows, cols)
    raw = torch.from_numpy(blocks.reshape(-1))
    assert supported(type_name) and torch.isfinite(want).all()
    got = dequantize(raw, type_name, (rows, cols), torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(dequantize(raw, type_name, (rows, cols), torch.bfloat16), want.to(torch.bfloat16))
    monkeypatch.setattr("engine.gguf_dequant.CHUNK_ELEMENTS", 1000)  # two rows a step, the last one short
    assert torch.equal(dequantize(raw, type_name, (rows, cols), torch.float32), got)


def test_a_type_nothing_here_dequantises_is_refused():
    from engine.gguf_dequant import supported

    assert not supported("Q8_1") and not supported("Q8_K")
    with pytest.raises(ValueError, match="no de-quantisation for ggml type Q8_K"):
        dequantize(torch.zeros(292, dtype=torch.uint8), "Q8_K", (256,), torch.float32)


def test_a_llama_gguf_with_tensors_only_the_gguf_package_knows_loads_natively(tiny_llama, tmp_path, conversions):
    types = {"blk.0.attn_q.weight": "IQ4_NL", "blk.1.ffn_up.weight": "IQ4_NL", "blk.0.ffn_down.weight": "IQ4_NL"}
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "iq4.gguf", quant="Q8_0", tensor_types=types)
    ck = load_checkpoint(str(path))
    assert conversions == [path.name]  # the native path, not transformers' whole-file one
    _assert_same_checkpoint(ck, _reference(path))
    half = load_checkpoint(str(path), dtype=torch.bfloat16)
    assert {t.dtype for t in half.state_dict.values()} == {torch.bfloat16}
    assert torch.equal(
        half.state_dict["model.layers.0.mlp.down_proj.weight"],
        ck.state_dict["model.layers.0.mlp.down_proj.weight"].bfloat16(),
    )


def test_dequantise_in_chunks_matches_one_pass(monkeypatch):
    raw = torch.from_numpy(random_blocks("Q6_K", 64, seed=3).reshape(-1))
    whole = dequantize(raw, "Q6_K", (16, 1024), torch.float32)
    monkeypatch.setattr("engine.gguf_dequant.CHUNK_ELEMENTS", 3000)  # two rows a step, the last one short
    assert torch.equal(dequantize(raw, "Q6_K", (16, 1024), torch.float32), whole)


@pytest.mark.parametrize("type_name", ["F16", "Q8_0", "Q4_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantise_into_a_slice_writes_only_its_rows(type_name, dtype):
    block, size = BLOCKS[type_name]
    cols = 2 * max(block, 32)
    raw = torch.from_numpy(random_blocks(type_name, 6 * cols // block, seed=5).reshape(-1))
    alone = dequantize(raw, type_name, (6, cols), dtype)
    buffer = torch.full((10, cols), 7.0, dtype=dtype)
    got = dequantize(raw, type_name, (6, cols), dtype, out=buffer[3:9])
    assert got.data_ptr() == buffer[3].data_ptr()
    torch.testing.assert_close(buffer[3:9], alone, rtol=0, atol=0, equal_nan=True)  # random F16 bits hold NaNs
    assert (buffer[:3] == 7).all() and (buffer[9:] == 7).all()


def test_dequantise_refuses_an_output_it_cannot_fill():
    raw = torch.from_numpy(random_blocks("Q8_0", 4, seed=1).reshape(-1))
    with pytest.raises(ValueError, match="must be a contiguous torch.float32"):
        dequantize(raw, "Q8_0", (2, 64), torch.float32, out=torch.empty(64, 2).t())
    with pytest.raises(ValueError, match="must be a contiguous torch.float32"):
        dequantize(raw, "Q8_0", (2, 64), torch.float32, out=torch.empty(2, 64, dtype=torch.float16))


def test_dequantise_refuses_a_wrong_size():
    with pytest.raises(ValueError, match="do not hold a tensor"):
        dequantize(torch.zeros(35, dtype=torch.uint8), "Q8_0", (32,), torch.float32)


# ---- whole models against transformers' path ---------------------------------------------------------------


@pytest.mark.parametrize("quant", ["F32", "F16", "Q8_0", "Q4_0", "Q5_1"])
def test_tiny_gguf_loads_to_transformers_tensors(tiny_llama, tmp_path, quant):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / f"tiny.{quant}.gguf", quant=quant)
    _assert_same_checkpoint(load_checkpoint(str(path)), _reference(path))


def test_a_llama_gguf_without_a_kv_head_count_has_as_many_as_query_heads(tiny_factory, tmp_path):
    """llama.cpp's converter leaves head_count_kv out for a config without num_key_value_heads (older Llamas);
    q and k were then left permuted (as transformers' GGUF path leaves them), and the answers were wrong."""
    folder = tiny_factory("llama", num_key_value_heads=4)  # as many as the query heads
    path = hf_llama_to_gguf(folder, tmp_path / "mha.gguf", omit=("llama.attention.head_count_kv",))
    got, want = load_checkpoint(str(path)).state_dict, load_checkpoint(str(folder)).state_dict
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("template", [False, True])
def test_a_gguf_s_end_of_turn_token_ends_answers(tiny_llama, tmp_path, template):
    """A GGUF whose EOS is another token than the one ending its turns (the file's eot_token_id, or the turn end its
    chat template writes): answers ran to the token limit."""

    def eos_elsewhere(w):
        w.kv_data[0].pop("tokenizer.ggml.eos_token_id")
        w.add_eos_token_id(0)  # <|endoftext|>
        if not template:
            w.add_eot_token_id(2)  # <|im_end|>, which ends a turn
            w.add_eom_token_id(100_000)  # outside the vocabulary: left out, as llama.cpp does

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "eot.gguf", chat_template=template, edit=eos_elsewhere)
    ck = load_checkpoint(str(path))
    assert ck.tokenizer.get_vocab()["<|im_end|>"] == 2 and ck.eos_token_ids == [0, 2]


def test_without_a_kv_head_count_transformers_path_un_permutes_too(tiny_factory, tmp_path):
    """A tensor type only transformers' reader takes (Q2_K) sends the file there, which left q and k permuted."""
    folder = tiny_factory("llama", tie=False, hidden_size=256, intermediate_size=512, num_key_value_heads=4)
    types = {"blk.0.ffn_down.weight": "Q2_K"}
    kv = hf_llama_to_gguf(folder, tmp_path / "kv.gguf", tensor_types=types)
    nokv = hf_llama_to_gguf(folder, tmp_path / "nokv.gguf", tensor_types=types, omit=("llama.attention.head_count_kv",))
    want, got = load_checkpoint(str(kv)), load_checkpoint(str(nokv))
    assert "Q2_K" in got.tensor_types
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(got.state_dict[name], want.state_dict[name]), name


def test_fused_weights_are_read_into_one_buffer_and_built_without_a_copy(tiny_llama, tmp_path):
    """q/k/v (q and k un-permuted on the way) and gate/up land in adjacent rows of one buffer per layer, which the
    decoder takes as its wqkv / w13 as is; the values are torch.cat's."""
    from engine.model import build_transformer

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "tiny.Q8_0.gguf", quant="Q8_0")
    ck = load_checkpoint(str(path))
    sd = ck.state_dict
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = [sd[a + n + "_proj.weight"] for n in "qkv"]
    gate_up = [sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]
    want_qkv, want_w13 = torch.cat(qkv), torch.cat(gate_up)
    assert all(t.untyped_storage().data_ptr() == qkv[0].untyped_storage().data_ptr() for t in qkv)
    model = build_transformer(ck.config, dict(sd), torch.float32, torch.device("cpu"))
    wqkv = model.layers[1].attention.wqkv.weight
    w13 = model.layers[1].feed_forward.w13.weight
    assert wqkv.data_ptr() == qkv[0].data_ptr() and w13.data_ptr() == gate_up[0].data_ptr()
    assert torch.equal(wqkv, want_qkv) and torch.equal(w13, want_w13)


def test_joined_copies_parts_that_do_not_lie_together():
    from engine.model import joined

    base = torch.arange(24.0).view(6, 4)
    together = joined([base[0:2], base[2:5]])
    assert together.data_ptr() == base.data_ptr() and torch.equal(together, base[0:5])
    apart = [base[0:2], base[3:5]]
    got = joined(apart)
    assert got.data_ptr() != base.data_ptr() and torch.equal(got, torch.cat(apart))
    swapped = joined([base[2:4], base[0:2]])
    assert torch.equal(swapped, torch.cat([base[2:4], base[0:2]]))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_ggufs_load_natively_to_transformers_tensors(tiny_factory, tmp_path, family, conversions):
    # transformers' GGUF config for qwen3 leaves head_dim at Qwen3Config's 128 (real Qwen3 models' size)
    folder = tiny_factory(family, **({"head_dim": 128} if family == "qwen3" else {}))
    path = hf_llama_to_gguf(folder, tmp_path / f"tiny-{family}.Q8_0.gguf", quant="Q8_0", architecture=family)
    ck = load_checkpoint(str(path))
    assert conversions == [path.name] and ck.config.model_type == family  # the native path, not transformers'
    _assert_same_checkpoint(ck, _reference(path))


def test_a_gemma3_gguf_loads_natively_to_transformers_tensors(tiny_factory, tmp_path, conversions):
    """Gemma-3: the text model's config, the norms llama.cpp stores as 1 + weight given back as transformers
    holds them (in fp32 before any cast), first from a conversion and then from the cache; the engine's own
    decoder answers as transformers' model on the same tensors does."""
    from tiny_models import greedy_continuation
    from transformers import AutoModelForCausalLM

    from engine.engine import Engine
    from engine.fallback import build_hf_model
    from engine.prompt import build_prompt
    from engine.types import EngineOptions, SamplingParams

    folder = tiny_factory("gemma3_text")
    path = hf_llama_to_gguf(folder, tmp_path / "tiny-gemma3.Q8_0.gguf", quant="Q8_0", architecture="gemma3")
    ref = _reference(path)
    ck = load_checkpoint(str(path))
    assert conversions == [path.name] and ck.config.model_type == "gemma3_text"  # the native path
    _assert_same_checkpoint(ck, ref)
    _assert_same_checkpoint(load_checkpoint(str(path)), ref)
    assert conversions == [path.name]  # the second load read the cache
    bf16 = load_checkpoint(str(path), dtype=torch.bfloat16).state_dict["model.norm.weight"]
    assert torch.equal(bf16, ref.state_dict["model.norm.weight"].to(torch.bfloat16))

    model = AutoModelForCausalLM.from_config(ref.config)
    model.load_state_dict(ref.state_dict, strict=False)  # the tied head is the embedding
    model.tie_weights()
    fallback = build_hf_model(ref.config, dict(ref.state_dict), torch.float32, torch.device("cpu"))
    embedding = ref.state_dict["model.embed_tokens.weight"]
    assert fallback.get_input_embeddings().weight.data_ptr() == embedding.data_ptr()  # taken, not copied
    eng = Engine.load(str(path), EngineOptions(device="cpu"))
    try:
        messages = [{"role": "user", "content": "hello world"}]
        got = eng.generate(messages, SamplingParams(temperature=0, max_new_tokens=8))
        assert eng.info.backend == "fast"
        prompt = build_prompt(eng.tokenizer, messages, eng.context_length, 8).ids
        want = greedy_continuation(model.eval(), prompt, 8, None)
        assert got.token_ids[0] == want[: len(got.token_ids[0])] and got.token_ids[0]
    finally:
        eng.close()


def test_k_quant_gguf_loads_to_transformers_tensors(tiny_factory, tmp_path):
    folder = tiny_factory("llama", tie=False, hidden_size=256, intermediate_size=512)
    names = [n for n in ("model.embed_tokens.weight", "lm_head.weight")] + [
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    kinds = ["Q4_K", "Q5_K", "Q6_K"]
    types = {gguf_name(n): kinds[i % 3] for i, n in enumerate(names)}
    path = hf_llama_to_gguf(folder, tmp_path / "tiny.Q4_K_M.gguf", quant="F32", tensor_types=types)
    assert {t.type_name for t in read_gguf_header(path).tensors} >= set(kinds)
    _assert_same_checkpoint(load_checkpoint(str(path)), _reference(path))


def test_tensor_names_and_config_as_transformers_builds_them(tiny_llama, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from engine.loader import _Layout

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "names.gguf")
    header = read_gguf_header(path)
    cfg = gguf_native.config_dict(header)
    assert cfg == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    model = _Layout.of(gguf_native.build_config(cfg, "names.gguf"), "names.gguf").model
    assert gguf_native.tensor_name_map(model, "llama", 2) == get_gguf_hf_weights_map(model, LlamaTensorProcessor(cfg))


def test_weights_come_in_the_asked_dtype(tiny_llama, tmp_path):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "tiny.Q8_0.gguf", quant="Q8_0")
    full = load_checkpoint(str(path))
    half = load_checkpoint(str(path), dtype=torch.bfloat16)
    for name, t in full.state_dict.items():
        assert half.state_dict[name].dtype == torch.bfloat16
        assert torch.equal(half.state_dict[name], t.to(torch.bfloat16)), name
    again = half.materialise(torch.float32, torch.device("cpu"))
    assert all(torch.equal(again[n], t) for n, t in full.state_dict.items())


# ---- the converted cache ---------------------------------------------------------------------------------


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = gguf_native.convert

    def counted(header, label, report):
        calls.append(label)
        return real(header, label, report)

    monkeypatch.setattr(gguf_native, "convert", counted)
    return calls


def test_second_load_converts_nothing(tiny_llama, tmp_path, conversions, _private_cache):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "cached.gguf")
    first = load_checkpoint(str(path))
    assert conversions == ["cached.gguf"]
    assert (_private_cache / next(os.walk(_private_cache))[1][0] / "tokenizer" / "tokenizer.json").is_file()
    events = []
    second = load_checkpoint(str(path), progress=events.append)
    assert conversions == ["cached.gguf"]  # not called again
    assert any("(cached)" in e.message for e in events)
    _assert_same_checkpoint(second, first)


def test_a_library_upgrade_converts_again(tiny_llama, tmp_path, conversions, _private_cache, monkeypatch):
    """The cache was keyed by the file alone: a transformers or tokenizers upgrade that converts a GGUF's
    tokenizer or config differently kept serving the old conversion."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "upgraded.gguf")
    ref = load_checkpoint(str(path))
    monkeypatch.setattr(gguf_native, "made_with", lambda: {"transformers": "99.0.0", "tokenizers": "0.99.0"})
    _assert_same_checkpoint(load_checkpoint(str(path)), ref)
    assert conversions == ["upgraded.gguf", "upgraded.gguf"]
    load_checkpoint(str(path))
    assert len(conversions) == 2  # converted by these versions now


def test_a_half_written_cache_entry_left_by_a_stopped_process_is_removed(tiny_factory, tmp_path, _private_cache):
    """A process stopped while it wrote a conversion left its .tmp- folder (a few MB) in the cache for good."""
    load_checkpoint(str(hf_llama_to_gguf(tiny_factory("llama", seed=0), tmp_path / "a.gguf")))
    old, fresh = _private_cache / ".tmp-stopped", _private_cache / ".tmp-writing"
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    hours_ago = time.time() - 2 * gguf_native.TMP_ABANDONED_S
    os.utime(old, (hours_ago, hours_ago))
    load_checkpoint(str(hf_llama_to_gguf(tiny_factory("llama", seed=1), tmp_path / "b.gguf")))  # a conversion
    assert not old.exists() and fresh.exists()  # another process may still be writing the fresh one


def test_a_gguf_whose_name_is_not_utf_8_loads_and_is_cached(tiny_llama, tmp_path, conversions):
    """A Latin-1 file name (as old archives unpack on Linux) failed every load with "'utf-8' codec can't encode
    character '\\udce9'": the cache entry was named by the path encoded as UTF-8."""
    import shutil

    path = os.path.join(os.fsencode(tmp_path), b"mod\xe9le.gguf")
    try:
        shutil.copyfile(hf_llama_to_gguf(tiny_llama, tmp_path / "plain.gguf"), path)
    except OSError:
        pytest.skip("this file system takes only UTF-8 names")
    first = load_checkpoint(os.fsdecode(path))
    second = load_checkpoint(os.fsdecode(path))
    assert conversions == ["mod\udce9le.gguf"]
    _assert_same_checkpoint(second, first)


def test_a_gguf_in_a_model_folder_reads_its_own_tokenizer_and_template(tiny_llama, tmp_path):
    """convert_hf_to_gguf.py leaves the GGUF beside the Hugging Face files it came from. Those files must not
    stand in for the GGUF's own: they lost the GGUF's chat template, and a tokenizer_config.json asking for
    remote code refused the GGUF outright."""
    import json
    import shutil

    (tmp_path / "alone").mkdir()
    alone = hf_llama_to_gguf(tiny_llama, tmp_path / "alone" / "m.gguf")
    folder = tmp_path / "folder"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    beside = folder / "m.gguf"
    shutil.copyfile(alone, beside)
    ref = load_checkpoint(str(alone))
    assert ref.tokenizer.chat_template
    for ck in (load_checkpoint(str(beside)), _reference(beside)):
        assert ck.tokenizer.chat_template == ref.tokenizer.chat_template
        assert ck.tokenizer(TEXT)["input_ids"] == ref.tokenizer(TEXT)["input_ids"]


def test_a_changed_file_is_converted_again(tiny_factory, tmp_path, conversions):
    path = tmp_path / "changing.gguf"
    hf_llama_to_gguf(tiny_factory("llama", seed=0), path)
    load_checkpoint(str(path))
    other = tiny_factory("llama", seed=0, tie=False)  # another layout under the same path
    hf_llama_to_gguf(other, path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ck = load_checkpoint(str(path))
    assert conversions == ["changing.gguf", "changing.gguf"]
    assert not ck.config.tie_word_embeddings and "lm_head.weight" in ck.state_dict
    _assert_same_checkpoint(ck, _reference(path))


@pytest.mark.parametrize("damage", ["config.json", "tokenizer/tokenizer.json", "manifest.json", "layout.json"])
def test_a_damaged_cache_is_rebuilt(tiny_llama, tmp_path, conversions, _private_cache, caplog, damage):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "damaged.gguf")
    ref = load_checkpoint(str(path))
    entry = _private_cache / next(os.walk(_private_cache))[1][0]
    (entry / damage).write_text("{ not json", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="engine.gguf_native"):
        ck = load_checkpoint(str(path))
    assert conversions == ["damaged.gguf", "damaged.gguf"]
    assert any("damaged" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    _assert_same_checkpoint(ck, ref)
    load_checkpoint(str(path))
    assert len(conversions) == 2  # the rebuilt entry serves the next load


def test_a_file_where_the_cache_entry_belongs_is_replaced(tiny_llama, tmp_path, conversions, _private_cache):
    """rmtree leaves a file: every load said the entry was damaged, converted, and could not write it."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "filed.gguf")
    ref = load_checkpoint(str(path))
    entry = _private_cache / next(os.walk(_private_cache))[1][0]
    shutil.rmtree(entry)
    entry.write_text("x")
    _assert_same_checkpoint(load_checkpoint(str(path)), ref)
    assert entry.is_dir()
    load_checkpoint(str(path))
    assert conversions == ["filed.gguf", "filed.gguf"]  # the third load read the entry the second wrote


@pytest.mark.parametrize("keep", ["no plan", "one layer"])
def test_a_cache_damaged_into_valid_json_is_rebuilt(tiny_llama, tmp_path, conversions, _private_cache, keep):
    """A layout that still parses but lost its plan, or a layer of it, failed every load with 'missing weights'
    (blaming the model) until the entry was deleted by hand."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "edited.gguf")
    ref = load_checkpoint(str(path))
    entry = _private_cache / next(os.walk(_private_cache))[1][0]
    layout = json.loads((entry / "layout.json").read_text())
    layout["plan"] = [] if keep == "no plan" else [p for p in layout["plan"] if not p[0].startswith("blk.1.")]
    (entry / "layout.json").write_text(json.dumps(layout))
    _assert_same_checkpoint(load_checkpoint(str(path)), ref)
    assert conversions == ["edited.gguf", "edited.gguf"]


def test_an_unwritable_cache_still_loads(tiny_llama, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setattr(gguf_native, "cache_root", lambda: blocked / "converted")
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "nocache.gguf")
    with caplog.at_level(logging.WARNING, logger="engine.gguf_native"):
        ck = load_checkpoint(str(path))
    assert "model.embed_tokens.weight" in ck.state_dict
    assert any("cannot write the converted cache" in r.getMessage() for r in caplog.records)


def test_a_read_only_cache_is_read_as_it_is(tiny_llama, tmp_path, monkeypatch, conversions):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "ro.gguf")
    load_checkpoint(str(path))

    def refuse(*_a, **_k):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(gguf_native.os, "utime", refuse)  # the recency mark a read-only cache cannot take
    ck = load_checkpoint(str(path))
    assert conversions == ["ro.gguf"] and "model.embed_tokens.weight" in ck.state_dict


def test_the_cache_folders_are_not_needed_to_load(tiny_llama, tmp_path, monkeypatch):
    """A cache folder that cannot be made (read-only parent, another user's): the model still loads and answers."""
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "nocache.gguf")
    engine = Engine.load(str(path), EngineOptions(device="cpu", profile_window=False))
    try:
        r = engine.generate([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_new_tokens=4))
        assert r.metrics.new_tokens_total == 4
    finally:
        engine.close()


# ---- the engine holds no second copy -----------------------------------------------------------------------


def test_engine_releases_the_state_dict_and_reloads_from_the_file(tiny_llama, tmp_path):
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "engine.gguf")
    params = SamplingParams(temperature=0.0, max_new_tokens=8, seed=0)
    msgs = [{"role": "user", "content": "hello"}]
    engine = Engine.load(str(path), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        assert engine.checkpoint.state_dict == {}
        assert engine.info.load_seconds is not None and engine.info.load_seconds > 0
        assert engine.info.load_seconds_source
        before = engine.generate(msgs, params).token_ids
        engine.reconfigure(engine.options.with_(dtype="bf16"))
        assert engine.model.output.weight.dtype == torch.bfloat16
        engine.reconfigure(engine.options.with_(dtype="fp32"))
        exact = load_checkpoint(str(path)).state_dict["model.embed_tokens.weight"]
        assert torch.equal(engine.model.tok_embeddings.weight, exact)  # fp32 again from the file, not from bf16
        assert engine.generate(msgs, params).token_ids == before
    finally:
        engine.close()


@pytest.mark.parametrize("change", ["touched", "deleted"])
def test_a_switch_after_the_file_changed_keeps_the_model_answering(tiny_llama, tmp_path, change):
    """The weights come again from the file at a switch of dtype or weight format: where it changed or went away
    since the load, the switch is refused with the reason and the model in use keeps answering."""
    from engine.engine import Engine
    from engine.errors import ModelLoadError
    from engine.types import EngineOptions, SamplingParams

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "moving.gguf")
    params = SamplingParams(temperature=0.0, max_new_tokens=8, seed=0)
    msgs = [{"role": "user", "content": "hello"}]
    engine = Engine.load(str(path), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        before = engine.generate(msgs, params).token_ids
        if change == "touched":
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        else:
            path.unlink()
        words = "changed since it was loaded" if change == "touched" else "was moved or deleted"
        for switch in ({"weights": "int8"}, {"dtype": "bf16"}):
            with pytest.raises(ModelLoadError, match=words):
                engine.reconfigure(engine.options.with_(**switch))
            assert engine.options.dtype == "fp32" and engine.options.weights == "native"
            assert engine.generate(msgs, params).token_ids == before
    finally:
        engine.close()


# ---- the default model -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_matches_transformers_path(default_model_path):
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    ck = load_checkpoint(str(default_model_path))
    ref = _reference(Path(default_model_path))
    _assert_same_checkpoint(ck, ref)
    options = EngineOptions(device="cpu", dtype="fp32", profile_window=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    tokens = []
    for checkpoint in (ck, ref):
        engine = Engine(checkpoint, options, lambda p: None)
        try:
            tokens.append(engine.generate(msgs, params).token_ids)
        finally:
            engine.close()
    assert tokens[0] == tokens[1]


# ---- a cached load without transformers --------------------------------------------------------------------

_CHILD = """
import json, sys
from engine.loader import load_checkpoint
ck = load_checkpoint(sys.argv[1])
tok = ck.tokenizer
ids = tok(sys.argv[2])["input_ids"]
print(json.dumps({
    "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
    "tokenizer": type(tok).__name__,
    "config": type(ck.config).__name__,
    "ids": ids,
    "text": tok.decode(ids, skip_special_tokens=True),
    "chat": tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False),
    "eos": ck.eos_token_ids,
    "tensors": sorted(ck.state_dict),
}))
"""


def test_a_cached_load_imports_no_transformers(tiny_llama, tmp_path):
    import json
    import subprocess
    import sys

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "fresh.gguf")
    env = {**os.environ, "GAPLESS_CACHE_DIR": str(tmp_path / "cache")}
    root = Path(__file__).resolve().parents[2]

    def child() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), TEXT], env=env, cwd=root, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    first, second = child(), child()
    assert first["transformers"] and first["tokenizer"] != "FastTokenizer"
    assert second["transformers"] == [], second["transformers"]
    assert (second["tokenizer"], second["config"]) == ("FastTokenizer", "CachedConfig")
    for key in ("ids", "text", "chat", "eos", "tensors"):
        assert second[key] == first[key], key


def test_the_fast_tokenizer_stands_in_only_where_it_agrees(tiny_llama, tmp_path):
    from engine.fast_tokenizer import disagreement, tokenizer_facts

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "probe.gguf")
    ref = _reference(path).tokenizer
    folder = tmp_path / "saved"
    ref.save_pretrained(str(folder))
    facts = tokenizer_facts(ref)
    assert facts is not None and disagreement(FastTokenizer(folder / "tokenizer.json", facts), ref) is None
    other = {**facts, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    assert "chat template" in disagreement(FastTokenizer(folder / "tokenizer.json", other), ref)
    changed = {**facts, "special_tokens_map": {}}
    assert disagreement(FastTokenizer(folder / "tokenizer.json", changed), ref) == "the special tokens"
    ref.clean_up_tokenization_spaces = True  # a decoding step the fast one does not have
    assert tokenizer_facts(ref) is None


@pytest.mark.parametrize(
    "family, changes",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True, "head_dim": 24}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"attention_bias": True, "head_dim": 12}),
        ("gemma3_text", {}),
        ("gemma3_text", {"tie_word_embeddings": False, "attention_bias": True, "head_dim": 16}),
    ],
)
def test_the_native_layout_is_the_model_classs(family, changes):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from engine.loader import _Layout

    settings = dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    config = CONFIG_MAPPING[family](**{**settings, **changes})
    layout = _Layout.of(config, "layout")
    shapes, tied = gguf_native.native_layout(config)
    assert list(shapes.items()) == list(layout.shapes.items())  # the same names, shapes and order
    assert tied == layout.tied
    # the gguf package has no table of its own for Mistral, and names Gemma-3's architecture gemma3
    names = {"mistral": "llama", "gemma3_text": "gemma3"}.get(family, family)
    assert gguf_native.name_map(list(shapes), names, 2) == gguf_native.tensor_name_map(layout.model, names, 2)


# ---- peak memory of a large load ---------------------------------------------------------------------------

_MEASURE = """
import json, os, resource, sys
import numpy as np, torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from engine.loader import load_checkpoint

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

CONFIG_MAPPING["llama"]  # the imports a conversion makes, in the baseline: the bound is about the load's data
before = resident()
ck = load_checkpoint(sys.argv[1], dtype=torch.bfloat16)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = sum(t.numel() * t.element_size() for t in ck.state_dict.values())

import gguf
from engine.gguf_header import read_gguf_header
header = read_gguf_header(ck.source)
t = next(t for t in header.tensors if t.name == "blk.3.attn_v.weight")
raw = np.fromfile(ck.source, dtype=np.uint8, count=t.nbytes, offset=header.data_start + t.offset)
ref = torch.from_numpy(gguf.quants.dequantize(raw.reshape(t.shape[0], -1), gguf.GGMLQuantizationType.Q8_0))
print(json.dumps({
    "growth": peak - before, "weights": weights, "file": os.path.getsize(ck.source), "tensors": len(ck.state_dict),
    "params": sum(t.numel() for t in ck.state_dict.values()),
    "same": torch.equal(ck.state_dict["model.layers.3.self_attn.v_proj.weight"], ref.to(torch.bfloat16)),
}))
"""


@pytest.mark.slow
def test_a_1b_q8_0_gguf_loads_within_the_peak_memory_bound(tiny_llama, tmp_path):
    """Peak RSS of a load, measured in a child process from just before it: at most the final weights + 25 %
    + the mapped file, on a first launch (converting) and a cached one."""
    import json
    import subprocess
    import sys

    from gguf_fixtures import write_large_llama_q8_0

    path = write_large_llama_q8_0(tmp_path / "large.Q8_0.gguf", tiny_llama)
    env = {**os.environ, "GAPLESS_CACHE_DIR": str(tmp_path / "cache")}
    for launch in ("first", "cached"):
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(path)],
            env=env,
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.splitlines()[-1])
        assert got["tensors"] == 2 + 16 * 9 and 1.0e9 < got["params"] < 1.1e9
        assert got["same"], "blk.3.attn_v.weight differs from the gguf package's de-quantisation"
        bound = got["weights"] * 1.25 + got["file"]
        assert got["growth"] <= bound, (
            f"{launch} launch: peak RSS grew {got['growth'] / 2**20:.0f} MiB (bound {bound / 2**20:.0f})"
        )


def test_transformers_model_builds_from_a_cached_config(tiny_llama, tmp_path):
    from engine.fallback import build_hf_model

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "hf.gguf")
    first, second = load_checkpoint(str(path)), load_checkpoint(str(path))
    assert type(second.config).__name__ == "CachedConfig"
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        want = build_hf_model(first.config, first.state_dict, torch.float32, torch.device("cpu"))(ids).logits
        got = build_hf_model(second.config, second.state_dict, torch.float32, torch.device("cpu"))(ids).logits
    assert torch.equal(got, want)


def test_a_file_cut_short_while_it_is_read_is_a_load_error_not_a_bus_error(tiny_llama, tmp_path):
    """A GGUF overwritten in place (cut short) while the app read it, at a load or a switch of precision that
    reads it again: the missing pages of the mapping ended the process with SIGBUS, draft and settings lost.
    Each tensor is read only while the file is as it was. In a child process, which a SIGBUS would end."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "cut.gguf", quant="Q8_0")
    script = f"""
import os
from engine import gguf_native
from engine.errors import ModelLoadError
from engine.loader import load_checkpoint

gguf_native.PROGRESS_EVERY = 1
path = {str(path)!r}

def cut(p):
    if p.stage == "dequantise" and p.fraction and p.fraction < 1:
        os.truncate(path, os.path.getsize(path) // 2)

load_checkpoint(path, cut)
"""
    assert _refusal_in_a_child(script) == "cut.gguf changed while it was read; open it again"


def _refusal_in_a_child(script: str) -> str:
    """Run `script`, which loads a model, in a child process (a SIGBUS would end it): the load error it raised."""
    import subprocess
    import sys

    script = "try:\n" + "".join(f"    {line}\n" for line in script.strip().splitlines())
    script += "except ModelLoadError as exc:\n    print('refused:', exc)\n"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("refused: "), r.stdout
    return r.stdout.removeprefix("refused: ").strip()


@pytest.mark.parametrize("when", ["load", "switch"])
def test_a_gguf_moved_over_its_path_after_its_header_was_read_is_not_read_for_weights(
    tiny_llama, tmp_path, monkeypatch, when
):
    """Another GGUF renamed over the path after the header was read (during a first load's conversion of the
    settings and tokenizer, which takes seconds), or after a switch's check found the file as loaded: its tensors
    were read at the first file's offsets, without a word."""
    from tiny_models import make_tiny_model

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "m.gguf")
    other = hf_llama_to_gguf(make_tiny_model(tmp_path / "other", "llama", seed=1), tmp_path / "other.gguf")
    refused = pytest.raises(ModelLoadError, match="m.gguf: the file changed while it was read; open it again")
    if when == "switch":
        ck = load_checkpoint(str(path))
        ck.release()
        ck.can_read_again()  # the switch's check: as loaded

        def renamed_then_opened(file, *args, **kwargs):
            if Path(file) == path and other.exists():
                os.replace(other, path)  # after the check the switch makes as it reads
            return open(file, *args, **kwargs)

        monkeypatch.setattr(gguf_native, "open", renamed_then_opened, raising=False)
        with refused:
            ck.weights(torch.float32, torch.device("cpu"))
        return
    convert = gguf_native.load_converted

    def renamed_meanwhile(*args, **kwargs):
        converted = convert(*args, **kwargs)
        os.replace(other, path)
        return converted

    monkeypatch.setattr(gguf_native, "load_converted", renamed_meanwhile)
    with refused:
        load_checkpoint(str(path))


def test_a_gguf_that_cannot_be_read_for_its_weights_is_a_load_error(tiny_llama, tmp_path, monkeypatch):
    """A read error once the header was read (a disk's, a file made unreadable meanwhile) escaped the load as a bare
    OSError, where every other fault of a load is a one-line ModelLoadError."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "m.gguf")

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(gguf_native, "read_into", failing)  # a disk's read error in the middle of the weights
    with pytest.raises(ModelLoadError, match=r"^m\.gguf: cannot read the weights: Input/output error$"):
        load_checkpoint(str(path))
    monkeypatch.setattr(gguf_native, "open", failing, raising=False)  # the file unreadable once its header was read
    with pytest.raises(ModelLoadError, match=r"^m\.gguf: cannot read it again: Input/output error$"):
        load_checkpoint(str(path))


def test_a_file_cut_short_between_the_check_and_the_read_of_a_tensor_is_no_bus_error(tiny_llama, tmp_path):
    """Each tensor was read from a mapping after a check that the file was as it was: a file cut short in between
    ended the process with SIGBUS. The bytes are read through the descriptor: a short read, said as such."""
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "cut.gguf", quant="Q8_0")
    script = f"""
import os
from engine import gguf_native
from engine.errors import ModelLoadError
from engine.loader import load_checkpoint

path = {str(path)!r}
checked = gguf_native.unchanged_while_read

def then_cut(f, name):
    check, calls = checked(f, name), []

    def after_the_check():
        check()
        calls.append(1)
        if len(calls) == 3:  # the file is cut once it was found unchanged (to nothing: the tensor's bytes gone)
            os.truncate(path, 0)

    return after_the_check

gguf_native.unchanged_while_read = then_cut
load_checkpoint(path)
"""
    assert _refusal_in_a_child(script) == "cut.gguf changed while it was read (it ends early); open it again"
