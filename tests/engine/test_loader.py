"""Loading checkpoints: HF folders (single, sharded, base-model names), GGUF files (exact round trip of a tiny
Llama written the way llama.cpp writes it), progress, and the real default model (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_fixtures import hf_llama_to_gguf
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.loader import Checkpoint, load_checkpoint

TEXT = "hello world <|im_start|>user\nParis is the capital of France. 42"


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_weights(ck: Checkpoint, ref: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(ck.state_dict) == sorted(ref)
    for name, t in ref.items():
        got = ck.state_dict[name]
        assert got.device.type == "cpu" and got.shape == t.shape, name
        torch.testing.assert_close(got.float(), t.float(), atol=atol, rtol=0, msg=name)


def test_hf_folder_loads_config_weights_and_tokenizer(tiny_llama):
    events = []
    ck = load_checkpoint(str(tiny_llama), progress=events.append)
    assert ck.source_kind == "hf-folder"
    assert ck.source == str(tiny_llama.resolve()) and ck.name == tiny_llama.name
    assert ck.config.model_type == "llama" and ck.config.tie_word_embeddings
    ref = _stored(tiny_llama)
    assert "lm_head.weight" not in ref  # tied: the model shares the embedding, the file stores it once
    _assert_same_weights(ck, ref)
    assert all(t.dtype == ref[n].dtype for n, t in ck.state_dict.items())
    assert ck.tokenizer.chat_template and "<|im_start|>" in ck.tokenizer.chat_template
    assert ck.eos_token_ids == [ck.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert events[0].stage == "load" and events[-1].fraction == 1.0


def test_untied_folder_keeps_lm_head(tiny_factory):
    folder = tiny_factory("llama", tie=False)
    ck = load_checkpoint(str(folder))
    assert "lm_head.weight" in ck.state_dict and not ck.config.tie_word_embeddings
    _assert_same_weights(ck, _stored(folder))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma"])
def test_other_families_load(tiny_factory, family):
    folder = tiny_factory(family)
    ck = load_checkpoint(str(folder))
    assert ck.config.model_type == family
    _assert_same_weights(ck, _stored(folder))


def test_a_file_inside_the_folder_stands_for_the_folder(tiny_llama):
    assert load_checkpoint(str(tiny_llama / "model.safetensors")).source == str(tiny_llama.resolve())
    assert load_checkpoint(str(tiny_llama / "config.json")).source == str(tiny_llama.resolve())


def test_sharded_folder_with_index(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "sharded")
    ref = _stored(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(ref)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: ref[k] for k in keys}, str(folder / file))
        weight_map.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same_weights(load_checkpoint(str(folder)), ref)


def test_base_model_names_and_extra_tensors(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "bare")
    ref = _stored(folder)
    bare = {k.removeprefix("model."): v for k, v in ref.items()}
    bare["rotary_emb.inv_freq"] = torch.ones(8)  # saved by old transformers; not a parameter
    save_file(bare, str(folder / "model.safetensors"))
    ck = load_checkpoint(str(folder))
    _assert_same_weights(ck, ref)


def test_generation_config_eos_ids_are_merged(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "gen")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_checkpoint(str(folder)).eos_token_ids == [2, 0]


def test_a_folder_s_answers_end_at_the_turn_end_its_template_writes_where_its_eos_is_another(tiny_llama, tmp_path):
    """A ChatML model whose EOS is <|endoftext|> (Qwen base models, early Llama-3-Instruct's <|end_of_text|>) ran
    on past <|im_end|> into the next turns; the same model as a GGUF stopped there."""
    folder = shutil.copytree(tiny_llama, tmp_path / "eot")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "eos_token": "<|endoftext|>"}))
    assert sorted(load_checkpoint(str(folder)).eos_token_ids) == [0, 2]  # <|endoftext|>, <|im_end|>
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    plain = {k: v for k, v in tok_config.items() if k != "chat_template"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**plain, "eos_token": "<|endoftext|>"}))
    assert load_checkpoint(str(folder)).eos_token_ids == [0]  # no template, no turn to end


def test_the_hugging_face_hub_cache_s_linked_files_load_under_their_own_names(tiny_llama, tmp_path):
    """The hub cache keeps each file as a blob named by its hash, linked from snapshots/<commit>/<file name>: a
    link stands for what its name says, and the model is named by its repository, not by a hash."""
    gguf = hf_llama_to_gguf(tiny_llama, tmp_path / "tiny-llama.Q8.gguf")
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in [*tiny_llama.iterdir(), gguf]:
        if f.is_file():
            blob = repo / "blobs" / f"{abs(hash(f.name)):x}"
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    for given in (snapshot, snapshot / "model.safetensors", snapshot / "config.json"):
        ck = load_checkpoint(str(given))
        assert (ck.source_kind, ck.name, ck.source) == ("hf-folder", "someone/tiny-llama", str(snapshot)), given
    ck = load_checkpoint(str(snapshot / "tiny-llama.Q8.gguf"))
    assert (ck.source_kind, ck.name, ck.source) == ("gguf", "tiny-llama.Q8", str(snapshot / "tiny-llama.Q8.gguf"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    return hf_llama_to_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_gguf_round_trip_is_exact(tiny_gguf, tiny_llama):
    from transformers import AutoTokenizer

    events = []
    ck = load_checkpoint(str(tiny_gguf), progress=events.append)
    assert ck.source_kind == "gguf" and ck.name == "tiny-llama.F32" and ck.source == str(tiny_gguf.resolve())
    assert ck.config.model_type == "llama" and ck.config.tie_word_embeddings
    assert ck.config.num_key_value_heads == 2 and ck.config.max_position_embeddings == 256
    _assert_same_weights(ck, _stored(tiny_llama))  # q/k un-permuted back exactly
    assert all(t.dtype == torch.float32 for t in ck.state_dict.values())
    ref_tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert ck.tokenizer(TEXT)["input_ids"] == ref_tok(TEXT)["input_ids"]
    assert ck.tokenizer.chat_template == ref_tok.chat_template
    assert ck.eos_token_ids == [ref_tok.convert_tokens_to_ids("<|im_end|>")]
    stages = [e.stage for e in events]
    assert stages[0] == "load" and stages[-1] == "dequantise" and stages.index("dequantise") > stages.index("load")
    assert events[-1].fraction == 1.0


def test_gguf_quantised_and_untied(tiny_factory, tmp_path):
    folder = tiny_factory("llama", tie=False)
    path = hf_llama_to_gguf(folder, tmp_path / "untied.Q8_0.gguf", quant="Q8_0")
    ck = load_checkpoint(str(path))
    assert not ck.config.tie_word_embeddings and "lm_head.weight" in ck.state_dict
    _assert_same_weights(ck, _stored(folder), atol=3e-3)  # Q8_0: 8-bit blocks of 32 with a shared scale


def test_gguf_without_chat_template(tiny_llama, tmp_path):
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "plain.gguf", chat_template=False)
    assert not load_checkpoint(str(path)).tokenizer.chat_template


def test_gguf_recognised_by_its_magic_without_the_suffix(tiny_gguf, tmp_path):
    other = tmp_path / "model-file"
    shutil.copy(tiny_gguf, other)
    assert load_checkpoint(str(other)).source_kind == "gguf"


@pytest.mark.slow
def test_real_default_model(default_model_path):
    ck = load_checkpoint("default")
    assert ck.source_kind == "default" and ck.source == str(default_model_path.resolve())
    assert ck.name == "SmolLM2-135M-Instruct.Q4_1"
    assert ck.config.model_type == "llama" and ck.config.tie_word_embeddings
    assert len(ck.state_dict) == 272 and "lm_head.weight" not in ck.state_dict
    assert ck.state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert ck.tokenizer.chat_template and "<|im_start|>" in ck.tokenizer.chat_template
    assert ck.eos_token_ids == [2]


def _hf_with_rope(folder: Path, rope: dict):
    """transformers' own model for the weights in `folder`, with `rope` as its rope settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    cfg.rope_parameters = {"rope_theta": theta, **rope}
    return AutoModelForCausalLM.from_pretrained(str(folder), config=cfg, dtype=torch.float32).eval()


def _our_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from engine.model import build_transformer

    ck = load_checkpoint(str(path))
    model = build_transformer(ck.config, ck.state_dict, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]), None, None, last_only=False)


LONG_IDS = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(3))


def test_gguf_rope_frequency_factors_are_applied_as_llama3_rope(tiny_llama, tmp_path):
    """llama.cpp stores Llama 3.1+'s rope as per-frequency factors (rope_freqs); the fast path divides the base
    frequencies by them, which is transformers' llama3 rope exactly."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    ref = _hf_with_rope(tiny_llama, rope)
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](ref.config, torch.device("cpu"))
    default = _hf_with_rope(tiny_llama, {"rope_type": "default"})
    head_dim = ref.config.hidden_size // ref.config.num_attention_heads
    plain = 1.0 / (ref.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    factors = (plain / llama3).numpy()
    assert factors.max() > 1.5  # the low frequencies really are scaled here
    path = hf_llama_to_gguf(tiny_llama, tmp_path / "llama31.gguf", rope_freqs=factors)
    with torch.no_grad():
        expected, unscaled = ref(input_ids=LONG_IDS).logits, default(input_ids=LONG_IDS).logits
    got = _our_logits(path, LONG_IDS)
    assert (expected - unscaled).abs().max() > 1e-2  # without the factors the answer would differ
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.equal(_our_logits(path, LONG_IDS), got)  # from the converted cache, the same


def test_gguf_linear_rope_scaling_is_read_and_other_kinds_refused(tiny_llama, tmp_path):
    from engine.errors import ModelLoadError

    path = hf_llama_to_gguf(tiny_llama, tmp_path / "linear.gguf", rope_scaling=("linear", 4.0))
    with torch.no_grad():
        expected = _hf_with_rope(tiny_llama, {"rope_type": "linear", "factor": 4.0})(input_ids=LONG_IDS).logits
    got = _our_logits(path, LONG_IDS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.equal(_our_logits(path, LONG_IDS), got)  # from the converted cache, the same
    yarn = hf_llama_to_gguf(tiny_llama, tmp_path / "yarn.gguf", rope_scaling=("yarn", 4.0))
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' in this GGUF is not supported"):
        load_checkpoint(str(yarn))


def test_gguf_linear_rope_scaling_of_a_gemma3_scales_its_global_layers_only(tmp_path):
    """Gemma-3's larger models scale the global layers' rope linearly; llama.cpp writes the scaling once, and it
    goes to the full-attention layers' settings, the sliding-window layers keeping their own base."""
    from tiny_models import make_tiny_model
    from transformers import AutoConfig, AutoModelForCausalLM

    # six layers, the last global: Gemma-3's pattern, which a GGUF does not store and its reading assumes
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3_text", num_hidden_layers=6, layer_types=layers)
    path = hf_llama_to_gguf(
        folder, tmp_path / "gemma3-linear.gguf", architecture="gemma3", rope_scaling=("linear", 8.0)
    )
    ids = LONG_IDS[:, :40]
    cfg = AutoConfig.from_pretrained(str(folder))
    cfg.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
    ref = AutoModelForCausalLM.from_pretrained(str(folder), config=cfg, dtype=torch.float32).eval()
    unscaled = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected, plain = ref(input_ids=ids).logits, unscaled(input_ids=ids).logits
    got = _our_logits(path, ids)
    assert (expected - plain).abs().max() > 1e-3  # without the scaling the answer would differ
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layers, scalar", [(6, 32), (62, 16)])
def test_a_gemma3_gguf_takes_llama_cpps_attention_scale(tmp_path, layers, scalar):
    """A GGUF does not store Gemma-3's attention scale: llama.cpp takes the head size, and for the 62-layer 27B
    hidden / heads; so does the loader, where transformers' GGUF reading would leave its default of 256."""
    from tiny_models import make_tiny_model

    folder = make_tiny_model(
        tmp_path / "gemma3",
        "gemma3_text",
        num_hidden_layers=layers,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6)
        + ["sliding_attention"] * (layers % 6),
        head_dim=32,
        query_pre_attn_scalar=scalar,
    )
    path = hf_llama_to_gguf(folder, tmp_path / "gemma3.gguf", architecture="gemma3")
    assert load_checkpoint(str(path)).config.query_pre_attn_scalar == scalar  # hidden 64 / 4 heads = 16
    assert load_checkpoint(str(path)).config.query_pre_attn_scalar == scalar  # from the converted cache too
    ids = LONG_IDS[:, :24]
    with torch.no_grad():
        expected = _hf_with_settings(folder)(input_ids=ids).logits
    torch.testing.assert_close(_our_logits(path, ids), expected, atol=1e-4, rtol=0)


def _hf_with_settings(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def test_quantised_folder_is_refused_with_its_method(tiny_llama, tmp_path):
    from engine.errors import ModelLoadError

    folder = tmp_path / "fp8"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"fp8: the weights are quantised \(fp8\)"):
        load_checkpoint(str(folder))


# ---- GGUF settings transformers' GGUF reading leaves out -----------------------------------------------------


def _wide_weights(folder: Path, std: float = 0.25) -> Path:
    """The tiny model's matrices drawn wider, so that a wrong rope or attention scale changes its answer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _answers(folder: Path, gguf_path: Path, words: int) -> tuple[list[int], list[int], list[int]]:
    """(Gapless on the GGUF, the Hugging Face model it was written from, transformers' own GGUF reading): the
    greedy tokens each gives after a prompt of `words` words."""
    from tiny_models import greedy_continuation
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.engine import Engine
    from engine.prompt import build_prompt
    from engine.types import EngineOptions, SamplingParams

    messages = [{"role": "user", "content": " ".join(["hello world the quick"] * (words // 4))}]
    engine = Engine.load(str(gguf_path), EngineOptions(device="cpu"))
    try:
        ours = engine.generate(messages, SamplingParams(temperature=0.0, max_new_tokens=8)).token_ids[0]
        prompt = build_prompt(engine.tokenizer, messages, engine.context_length, 8).ids
    finally:
        engine.close()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    theirs.load_state_dict(
        load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=theirs)["tensors"], strict=False
    )
    theirs.tie_weights()
    return ours, greedy_continuation(reference, prompt, 8, None), greedy_continuation(theirs.eval(), prompt, 8, None)


@pytest.mark.parametrize("words", [8, 120])  # within the original context (short factors), past it (long)
def test_a_phi3_gguf_takes_its_long_context_rope(tmp_path, words):
    """Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini: llama.cpp stores the longrope factors as two tensors and their
    scale as metadata, which transformers' GGUF reading drops: the answers were those of a model without them."""
    import math

    from gguf_fixtures import hf_to_gguf
    from tiny_models import make_tiny_model

    short = [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.5, 5.0]
    long = [1.2, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
    folder = _wide_weights(
        make_tiny_model(
            tmp_path / "phi3",
            "phi3",
            max_position_embeddings=1024,
            original_max_position_embeddings=64,
            rope_parameters={**rope, "original_max_position_embeddings": 64},
        )
    )
    scale = math.sqrt(1 + math.log(1024 / 64) / math.log(64))
    path = hf_to_gguf(
        folder,
        tmp_path / "phi3.gguf",
        "phi3",
        metadata={"phi3.rope.scaling.attn_factor": scale, "phi3.rope.scaling.original_context_length": 64},
        tensors={"rope_factors_long.weight": long, "rope_factors_short.weight": short},
    )
    ours, model, without = _answers(folder, path, words)
    assert ours == model and without != model


def test_a_phi3_gguf_rotates_the_part_of_each_head_it_says(tmp_path):
    """Phi-4-mini rotates three quarters of each head (rope.dimension_count); transformers' GGUF reading of
    Phi-3 rotated all of it."""
    from gguf_fixtures import hf_to_gguf
    from tiny_models import make_tiny_model

    folder = _wide_weights(make_tiny_model(tmp_path / "phi3", "phi3", partial_rotary_factor=0.5))
    path = hf_to_gguf(folder, tmp_path / "phi3.gguf", "phi3", metadata={"phi3.rope.dimension_count": 8})
    ours, model, without = _answers(folder, path, 8)
    assert ours == model and without != model


def test_a_gemma2_gguf_takes_llama_cpps_attention_scale(tmp_path):
    """Gemma-2 27B's scale is 1/sqrt(hidden / heads), not its head size's (as Gemma-3 27B's): transformers' GGUF
    reading leaves 256 whatever the head size."""
    from gguf_fixtures import hf_to_gguf
    from tiny_models import make_tiny_model

    folder = _wide_weights(
        make_tiny_model(tmp_path / "gemma2", "gemma2", head_dim=16, query_pre_attn_scalar=16), std=0.1
    )
    path = hf_to_gguf(folder, tmp_path / "gemma2.gguf", "gemma2")
    assert load_checkpoint(str(path)).config.query_pre_attn_scalar == 16
    ours, model, without = _answers(folder, path, 8)
    assert ours == model and without != model


def test_long_context_rope_factors_of_a_model_without_longrope_are_refused(tiny_factory, tmp_path):
    """transformers' GGUF reading drops tensors its model does not take: answers without the factors would be
    wrong. A clear refusal, as for a rope scaling the loader does not know (the native path refuses any tensor
    its model does not have)."""
    from gguf_fixtures import hf_to_gguf

    from engine.errors import ModelLoadError

    factors = {"rope_factors_long.weight": [2.0] * 8, "rope_factors_short.weight": [1.0] * 8}
    path = hf_to_gguf(tiny_factory("gemma2", head_dim=16), tmp_path / "long.gguf", "gemma2", tensors=factors)
    with pytest.raises(ModelLoadError, match=r"long-context rope factors .* of this gemma2 GGUF are not supported"):
        load_checkpoint(str(path))


def _child(script: str) -> "subprocess.CompletedProcess[str]":
    """`script` in a child Python at the project's root: a SIGBUS would end the child, not the test run."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_folder_overwritten_while_its_model_runs_is_no_bus_error(tiny_llama, tmp_path, dtype):
    """A model folder's safetensors file overwritten in place (cut short) while the app runs its model: the held
    weights (and a model sharing them in the stored dtype) were the file's mapping, and the next answer ended the
    process with SIGBUS. The model answers on, and a switch that would read the file again is refused, the model
    kept."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    script = f"""
import os
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.types import EngineOptions, SamplingParams

folder = {str(folder)!r}
e = Engine.load(folder, EngineOptions(device="cpu", dtype={dtype!r}, profile_window=False))
greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
before = e.generate([{{"role": "user", "content": "hi"}}], greedy).token_ids
os.truncate(os.path.join(folder, "model.safetensors"), 100)
print("answered", e.generate([{{"role": "user", "content": "hi"}}], greedy).token_ids == before)
try:
    e.reconfigure(e.options.with_(dtype={"fp16" if dtype == "fp32" else "fp32"!r}))
except ModelLoadError as exc:
    print("refused:", exc)
print("still", e.generate([{{"role": "user", "content": "hi"}}], greedy).token_ids == before)
"""
    r = _child(script)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "answered True" in r.stdout and "still True" in r.stdout, r.stdout
    assert "refused: m: model.safetensors changed since it was loaded; open it again" in r.stdout, r.stdout


def test_a_folder_cut_short_while_it_is_read_is_a_load_error_not_a_bus_error(tiny_llama, tmp_path):
    """The file overwritten in place between two tensors of the read: each is read only while the file is as it
    was."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    script = f"""
import os
from engine.errors import ModelLoadError
from engine.loader import load_checkpoint

path = os.path.join({str(folder)!r}, "model.safetensors")

def cut(p):
    if p.message.startswith("read "):
        os.truncate(path, os.path.getsize(path) // 2)

try:
    load_checkpoint({str(folder)!r}, cut)
except ModelLoadError as exc:
    print("refused:", exc)
"""
    r = _child(script)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "refused: m: model.safetensors changed while it was read; open it again" in r.stdout, r.stdout


def test_a_file_moved_over_a_folders_weights_while_they_are_read_is_not_mixed_in(tiny_llama, tmp_path):
    """Each tensor was read by opening the path again: another file renamed over it between two tensors (a
    download finishing, a hub cache link pointed at a new blob) gave a model of two files' tensors without a word.
    One descriptor reads the whole file: the weights are the first file's, and a switch, which would read the
    path again, is refused. So is one after a file of the same size and time (`cp -p`, `rsync -a`) took its place."""
    import os

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    first = _stored(folder)
    other = tmp_path / "other.safetensors"
    save_file({k: v + 1 for k, v in first.items()}, str(other))

    def swap(p):
        if p.message.startswith("read ") and other.exists():
            os.replace(other, folder / "model.safetensors")

    ck = load_checkpoint(str(folder), swap)
    _assert_same_weights(ck, first)
    with pytest.raises(ModelLoadError, match=r"^m: model.safetensors changed since it was loaded; open it again$"):
        ck.materialise(torch.float32, torch.device("cpu"))
    ck = load_checkpoint(str(folder))
    twin = tmp_path / "twin.safetensors"
    save_file({k: v * 2 for k, v in _stored(folder).items()}, str(twin))
    st = (folder / "model.safetensors").stat()
    assert twin.stat().st_size == st.st_size
    os.utime(twin, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(twin, folder / "model.safetensors")
    ck.release()  # as the engine does once its model is built
    with pytest.raises(ModelLoadError, match="changed since it was loaded"):
        ck.can_read_again()


def test_a_folders_weights_come_in_the_dtype_asked_for(tiny_llama):
    """Copied out of the file straight into the model's dtype (and device): the stored fp32 tensors were copied
    whole first, so a bf16 load from an fp32 folder held both at its peak."""
    stored = _stored(tiny_llama)
    ck = load_checkpoint(str(tiny_llama), dtype=torch.bfloat16)
    assert {t.dtype for t in ck.state_dict.values()} == {torch.bfloat16}
    for name, t in stored.items():
        assert torch.equal(ck.state_dict[name], t.to(torch.bfloat16)), name


def test_a_folders_weights_are_given_up_once_built_and_read_again_for_a_switch(tiny_llama):
    """The checkpoint holds no second copy of a folder's weights beside the model (the fp32 state dict stayed
    beside a bf16 model: 1,191 MiB after a SmolLM2-sized load, now 678 MiB); a switch reads them again, to the
    same greedy tokens as a fresh load."""
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    messages = [{"role": "user", "content": "hi"}]
    fresh = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        want = fresh.generate(messages, greedy).token_ids
    finally:
        fresh.close()
    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="bf16", profile_window=False))
    try:
        assert e.checkpoint.state_dict == {}
        e.reconfigure(e.options.with_(dtype="fp32"))
        assert e.checkpoint.state_dict == {}
        assert e.generate(messages, greedy).token_ids == want
    finally:
        e.close()


def test_a_folder_the_user_can_no_longer_read_refuses_the_switch_and_keeps_the_model(tiny_llama, monkeypatch):
    """A shard made unreadable (chmod 000) after the load: the switch gave up the model, failed to read the file,
    failed to read it again for the model it had, and every answer after it failed ("the model is not on the
    device"); a switch back to the dtype it had then did nothing."""
    import builtins

    import engine.loader as loader
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    hi = [{"role": "user", "content": "hi"}]
    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        before = e.generate(hi, greedy).token_ids
        weights = str(Path(e.checkpoint.source) / "model.safetensors")
        real_open = builtins.open

        def no_read(file, *args, **kwargs):
            if str(file) == weights:
                raise PermissionError(13, "Permission denied", weights)
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(loader, "open", no_read, raising=False)
        with pytest.raises(ModelLoadError, match=r"cannot read model.safetensors again: Permission denied$"):
            e.reconfigure(e.options.with_(dtype="bf16"))
        assert e.generate(hi, greedy).token_ids == before
        # refused past that check (read again, then failing): the previous weights cannot be placed either
        monkeypatch.setattr(e.checkpoint, "unchanged", lambda: None)
        with pytest.raises(ModelLoadError, match="Permission denied"):
            e.reconfigure(e.options.with_(dtype="bf16"))
        assert e.model is None
        monkeypatch.setattr(loader, "open", real_open, raising=False)  # readable again
        e.reconfigure(e.options.with_(dtype="fp32"))  # the dtype it had: built again, not taken as in place
        assert e.generate(hi, greedy).token_ids == before
    finally:
        e.close()


def _two_shards(folder: Path, tmp_path: Path) -> tuple[Path, Path]:
    """`folder`'s weights as two shards with an index; the second shard and a new revision of it (each value + 1)."""
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(folder / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    second = folder / "model-00002-of-00002.safetensors"
    save_file({k: weights[k] + 1 for k in shards[second.name]}, str(tmp_path / "new.safetensors"))
    return second, tmp_path / "new.safetensors"


@pytest.mark.parametrize("when", ["load", "switch"])
def test_a_shard_replaced_while_an_earlier_one_is_read_is_not_mixed_in(tiny_llama, tmp_path, monkeypatch, when):
    """A download of a new revision renamed over the second shard while the first was read, at the load or at a
    switch that had found the files as loaded: the model was built of two revisions' tensors without a word."""
    import engine.loader as loader

    folder = shutil.copytree(tiny_llama, tmp_path / "sharded")
    second, new_revision = _two_shards(folder, tmp_path)
    if when == "switch":
        ck = load_checkpoint(str(folder))
        ck.release()
        ck.can_read_again()
    read = loader._read_tensor

    def renamed_meanwhile(f, data_start, table, key, name):
        if "00001" in name and new_revision.exists():
            os.replace(new_revision, second)
        return read(f, data_start, table, key, name)

    monkeypatch.setattr(loader, "_read_tensor", renamed_meanwhile)
    with pytest.raises(ModelLoadError, match=f"{second.name} changed while it was read; open it again"):
        load_checkpoint(str(folder)) if when == "load" else ck.weights(torch.float32, torch.device("cpu"))
