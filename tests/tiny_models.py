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


def make_tokenizer(vocab_size: int = 320, corpus: Optional[list[str]] = None):
    """A byte-level BPE tokenizer with ChatML's special tokens, trained on `corpus` (the tiny models' own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator((corpus or CORPUS) * 20, trainer)
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


def make_bigram_model(
    path: Path, steps: dict[str, str], added: tuple[str, ...] = (), chat_template: Optional[str] = None
) -> Path:
    """A tiny llama whose greedy next token depends on the current token alone, as `steps` says (a token's text ->
    the next token's text, each one token of the tiny tokenizer with the `added` tokens): every layer adds nothing
    to the residual stream (its attention and MLP outputs are zero), and the untied head scores the next token by
    the current one's normalised embedding."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.add_tokens(list(added))
    if chat_template is not None:
        tok.chat_template = chat_template
    cfg = make_config(vocab_size=len(tok), tie=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)

    def one(text: str) -> int:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, f"{text!r} is {len(ids)} tokens of the tiny tokenizer"
        return ids[0]

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for now, after in steps.items():
            h = emb[one(now)]
            head[one(after)] += 10 * h / h.norm()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def make_sentencepiece_tokenizer(corpus: str = "The capital of France is Paris, and Paris is in France."):
    """SentencePiece-style BPE as Llama 2's and Mistral's tokenizer.json have it: spaces as "▁", one put before
    the text, byte fallback to the <0xNN> tokens of its vocabulary (ordinary tokens, as theirs are: a text of
    them is not left out as special tokens are), and a decoder that strips the space the text starts with;
    trained on `corpus`."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator([corpus] * 20, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.decoder = decoders.Sequence(
        [decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
