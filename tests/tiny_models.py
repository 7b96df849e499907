"""Tiny random models built in the test: an HF folder with config.json, model.safetensors and a byte-level BPE
tokenizer with a ChatML chat template. Built in well under a second; the same seed gives the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "Paris is the capital of France. Tokens per second, kernel gap, graphs.",
    "def main():\n    return 42  # code\n",
]

FAMILY_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"]),
    "gemma3_text": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"]),
}

# The layers of a tiny model: small enough that a test builds one in well under a second.
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)

# SmolLM2-135M's architecture (30 layers, 576 wide, GQA 9/3, 49152 vocab), for checks at the default model's shape
# with random weights.
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def greedy_continuation(model, prompt_ids: list[int], n: int, pad_token_id: Optional[int]) -> list[int]:
    """transformers generate(), greedy: the n token ids `model` appends to prompt_ids, the engine's reference."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    return tok


def make_config(family: str = "llama", vocab_size: int = 320, tie: bool = True, **overrides):
    from transformers import AutoConfig

    base = dict(
        TINY_SHAPE,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    fam = dict(FAMILY_CONFIGS.get(family, {}))
    model_type = fam.pop("model_type", family)
    base.update(fam)
    if family == "qwen3":
        base["head_dim"] = 16
    if family == "gemma3_text":  # five sliding-window layers to one global, as Gemma-3 has them
        base.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=3)
        base["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def make_tiny_model(
    path: Path,
    family: str = "llama",
    seed: int = 0,
    tie: bool = True,
    chat_template: Optional[str] = CHATML,
    vocab_size: int = 320,
    rows: Optional[int] = None,
    std: float = 0.08,
    **config_overrides,
) -> Path:
    """Write a tiny random causal LM of `family` (any transformers model_type) into `path` and return it; `rows`:
    its embedding padded past the tokenizer's `vocab_size` tokens, as real models' are; `std`: its matrices'."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    if chat_template is not None:
        tok.chat_template = chat_template
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = make_config(family, vocab_size=rows or len(tok), tie=tie, eos_token_id=eos, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger than default init so greedy decoding is not one repeated token
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()  # keep generate() defaults explicit in tests
    return path


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
