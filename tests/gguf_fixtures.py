"""Tiny GGUF files for tests, written from a tiny HF Llama folder (tests/tiny_models.py) the way llama.cpp's
converter writes them: GGUF tensor names, q/k rows permuted for its rotary layout, a byte-level BPE vocabulary
with merges, and the chat template. Built in well under a second."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",  # Qwen2
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",  # Gemma-3: a norm before and after each block
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GEMMA3_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight"}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# where each block keeps its fp16 scales (and mins): random bytes there could be inf or nan
_HALF_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    # types only the gguf package de-quantises here (engine.gguf_dequant)
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
}


def random_blocks(type_name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """`n_blocks` blocks of random bytes in ggml type `type_name`, with small finite fp16 scales: for the types
    the gguf package cannot quantise (the K types), and to reach every bit pattern of the others."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at in _HALF_FIELDS.get(type_name, ()):
        raw[:, at : at + 2] = (rng.standard_normal(n_blocks) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def gguf_name(hf_name: str, architecture: str = "llama") -> str:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    names = {**_LAYER_NAMES, **_GEMMA3_NAMES} if architecture == "gemma3" else _LAYER_NAMES
    return f"blk.{layer}.{names[rest]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head's rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_llama_to_gguf(
    hf_folder: Path,
    out: Path,
    quant: str = "F32",
    architecture: str = "llama",
    tensor_types: Optional[dict[str, str]] = None,
    chat_template: bool = True,
    rope_freqs: Optional[np.ndarray] = None,
    rope_scaling: Optional[tuple[str, float]] = None,
    omit: tuple[str, ...] = (),
    edit: Optional[Callable[[Any], None]] = None,
) -> Path:
    """Write the tiny Llama in `hf_folder` as the GGUF `out`. `omit`: metadata keys left out, as converters do;
    `edit(writer)` changes the metadata further; `quant` applies to 2-D weights (F32, F16, Q8_0, …);
    `tensor_types` forces a ggml type on single GGUF tensors (random blocks for the types de-quantised here,
    raw zero bytes for others gguf cannot quantise);
    `rope_freqs` adds llama.cpp's per-frequency rope factors, `rope_scaling` its (type, factor) metadata."""
    import gguf
    from safetensors.numpy import load_file

    hf_folder, out = Path(hf_folder), Path(out)
    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), architecture)
    _add_settings(w, cfg, architecture, rope_scaling)
    _add_tokenizer(w, hf_folder, cfg["vocab_size"], chat_template)
    for key in omit:
        w.kv_data[0].pop(key)
    if edit is not None:
        edit(w)

    forced = tensor_types or {}
    for hf, arr in state.items():
        name = gguf_name(hf, architecture)
        arr = arr.astype(np.float32)
        if architecture == "gemma3" and hf.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp stores Gemma's norms as the factor they scale by (1 + weight)
        if architecture == "llama" and hf.endswith("q_proj.weight"):  # llama.cpp permutes Llama's only
            arr = _permute(arr, n_head)
        elif architecture == "llama" and hf.endswith("k_proj.weight"):
            arr = _permute(arr, n_kv)
        if name in forced:
            qtype = gguf.GGMLQuantizationType[forced[name]]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if forced[name] in _HALF_FIELDS:
                n = arr.size // block
                raw = random_blocks(forced[name], n, seed=len(name)).reshape(*arr.shape[:-1], -1)
            else:
                raw = np.zeros((*arr.shape[:-1], arr.shape[-1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif arr.ndim == 2 and quant != "F32":
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_to_gguf(
    hf_folder: Path,
    out: Path,
    architecture: str,
    metadata: Optional[dict[str, Any]] = None,
    tensors: Optional[dict[str, np.ndarray]] = None,
) -> Path:
    """Write the tiny model in `hf_folder` as a GGUF of `architecture` (one transformers reads through its own
    GGUF path: phi3, gemma2, ...), its settings under the keys transformers maps, F32 weights named by
    transformers' own map, Gemma's norms stored as llama.cpp stores them; `metadata` adds keys (ints as
    uint32, floats as float32), `tensors` adds F32 tensors (llama.cpp's rope factors)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    hf_folder, out = Path(hf_folder), Path(out)
    cfg = AutoConfig.from_pretrained(hf_folder)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    w = gguf.GGUFWriter(str(out), architecture)
    w.add_name(f"tiny {architecture}")
    values = {}
    for key, attr in GGUF_CONFIG_MAPPING[architecture].items():
        value = getattr(cfg, attr, None) if attr else None
        if attr == "rope_theta" and value is None:
            value = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        if value is not None and not isinstance(value, (list, dict)):
            values[f"{architecture}.{key}"] = value
    for key, value in {**values, **(metadata or {})}.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    _add_tokenizer(w, hf_folder, cfg.vocab_size)
    names = get_gguf_hf_weights_map(model, TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={}))
    gguf_of = {}
    for g, h in names.items():
        gguf_of.setdefault(h, g)
    written = set()
    for hf, t in model.state_dict().items():
        name = gguf_of.get(hf)
        if name is None or name in written:  # a tied head is the embedding's
            continue
        written.add(name)
        arr = t.detach().float().numpy()
        if architecture.startswith("gemma") and hf.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp stores Gemma's norms as the factor they scale by (1 + weight)
        w.add_tensor(name, np.ascontiguousarray(arr))
    for name, values_ in (tensors or {}).items():
        w.add_tensor(name, np.asarray(values_, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_settings(w, cfg: dict, architecture: str = "llama", rope_scaling: Optional[tuple[str, float]] = None) -> None:
    import gguf

    n_head = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w.add_name("tiny llama")
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if architecture in ("qwen3", "gemma3"):  # llama.cpp writes the head size where it may differ from hidden / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if architecture == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(cfg["vocab_size"])
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])


def _add_tokenizer(w, hf_folder: Path, vocab_size: int, chat_template: bool = True) -> None:
    """The tiny model's byte-level BPE, its ids past the tiny vocabulary filled with unused tokens."""
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [f"<unused{i}>" for i in range(vocab_size)]
    for text, i in {**vocab, **specials}.items():
        tokens[i] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(specials["<|im_end|>"])
    w.add_pad_token_id(specials["<|endoftext|>"])
    tok_cfg = json.loads((hf_folder / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None and (hf_folder / "chat_template.jinja").exists():
        template = (hf_folder / "chat_template.jinja").read_text()
    if chat_template and template:
        w.add_chat_template(template)


def write_large_llama_q8_0(
    out: Path,
    tokenizer_folder: Path,
    hidden: int = 2048,
    layers: int = 16,
    intermediate: int = 8192,
    heads: int = 32,
    kv_heads: int = 8,
    vocab: int = 32000,
) -> Path:
    """A Llama-shaped GGUF of random Q8_0 weights (about 1.04B parameters at the defaults: Llama-3.2-1B's
    shapes with a 32k vocabulary), written tensor by tensor so the writer never holds more than one: random
    bytes for the quants, small finite fp16 scales. The tokenizer is the tiny model's, padded to `vocab`."""
    import gguf

    cfg = dict(
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate, rms_norm_eps=1e-5,
        rope_theta=500000.0, vocab_size=vocab,
    )  # fmt: skip
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (hidden,), p + "attn_q.weight": (heads * head_dim, hidden),
            p + "attn_k.weight": (kv_heads * head_dim, hidden), p + "attn_v.weight": (kv_heads * head_dim, hidden),
            p + "attn_output.weight": (hidden, heads * head_dim), p + "ffn_norm.weight": (hidden,),
            p + "ffn_gate.weight": (intermediate, hidden), p + "ffn_up.weight": (intermediate, hidden),
            p + "ffn_down.weight": (hidden, intermediate),
        })  # fmt: skip
    shapes["output_norm.weight"] = (hidden,)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w = gguf.GGUFWriter(str(out), "llama")
    _add_settings(w, cfg)
    _add_tokenizer(w, Path(tokenizer_folder), vocab)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            row = shape[1] // 32 * 34  # the writer takes a quantised tensor's shape in bytes
            w.add_tensor_info(name, (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    for shape in shapes.values():
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        raw = rng.integers(0, 256, (shape[0], shape[1] // 32, 34), dtype=np.uint8)
        raw[:, :, 0:2] = scale
        w.write_tensor_data(raw.reshape(shape[0], -1))
    w.close()
    return out


def write_gemma3_270m_shaped(out: Path, vocab: int = 262144) -> Path:
    """A GGUF in Gemma-3-270M's shapes (18 layers, 640 wide, 4 query heads of 256 and one KV head, a
    262,144-piece vocabulary) with random weights, typed as llama.cpp's Q4_K_M types that model (its 640-wide
    rows fall back from the K types to Q5_0 and Q8_0; the norms F32, stored as 1 + weight) and a sentencepiece
    vocabulary built by joining pieces, as large as the real one: for timing a load (docs/benchmarks.md)."""
    import gguf

    hidden, inter, layers, heads, kv_heads, head_dim = 640, 2048, 18, 4, 1, 256
    rng = np.random.default_rng(0)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(specials) + [6] * 256
    first = len(tokens)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()-_/") + ["\u2581"]
    alphabet += [chr(c) for c in range(0xE0, 0x17F)]
    seen = set(tokens)
    for piece in alphabet:
        seen.add(piece)
        tokens.append(piece)
        types.append(1)
    while len(tokens) < vocab:  # join two earlier pieces, the commoner short ones more often
        made = len(tokens) - first
        a = tokens[first + int(rng.integers(0, min(made, 20000)))]
        b = tokens[first + int(rng.integers(0, min(made, 5000)))]
        piece = ("\u2581" + a if rng.random() < 0.3 and not a.startswith("\u2581") else a) + b.lstrip("\u2581")
        if piece not in seen and len(piece) < 24:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_name("gemma-3-270m-shaped random")
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(512)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_chat_template(
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}"
        "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        if kind == "F32":
            w.add_tensor(name, (1 + 0.05 * rng.standard_normal(shape)).astype(np.float32))
            return
        qtype = gguf.GGMLQuantizationType[kind]
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        raw = random_blocks(kind, shape[0] * shape[1] // block, seed=len(name)).reshape(shape[0], -1)
        w.add_tensor(name, raw, raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), "Q8_0")
    add("output_norm.weight", (hidden,), "F32")
    for i in range(layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(p + norm + ".weight", (hidden,), "F32")
        add(p + "attn_q_norm.weight", (head_dim,), "F32")
        add(p + "attn_k_norm.weight", (head_dim,), "F32")
        add(p + "attn_q.weight", (heads * head_dim, hidden), "Q5_0")
        add(p + "attn_k.weight", (kv_heads * head_dim, hidden), "Q5_0")
        add(p + "attn_v.weight", (kv_heads * head_dim, hidden), "Q8_0")
        add(p + "attn_output.weight", (hidden, heads * head_dim), "Q4_K")
        add(p + "ffn_gate.weight", (inter, hidden), "Q5_0")
        add(p + "ffn_up.weight", (inter, hidden), "Q5_0")
        add(p + "ffn_down.weight", (hidden, inter), "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
