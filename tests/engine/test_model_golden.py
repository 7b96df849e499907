"""Golden tests: our decoder's logits equal transformers' on tiny random models of every fast-path family,
on prefill and on 8 decode steps, for every kv_cache mode; candidate rows equal the single row under greedy."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import make_config

from engine.decode import DynamicRunner, NoCacheRunner, StaticRunner
from engine.model import build_transformer
from engine.sampling import SamplerKind

TOL = 1e-4
GREEDY = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False)

FAMILIES = {
    "llama": dict(family="llama"),
    "llama-untied-rope-scaled": dict(
        family="llama",
        tie=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-attention-bias": dict(family="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(family="mistral", sliding_window=None),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3"),
    "llama-mha": dict(family="llama", num_key_value_heads=4),
    # bias flags transformers does not read for these families: no biases, as there
    "mistral-bias-flags": dict(family="mistral", sliding_window=None, attention_bias=True, mlp_bias=True),
    "qwen2-mlp-bias-flag": dict(family="qwen2", mlp_bias=True),
    "qwen3-bias": dict(family="qwen3", attention_bias=True, mlp_bias=True),
    # sliding-window layers (window 8) with a rope base of their own beside a full layer; the prompts run past
    # the window, so its mask is what is checked
    "gemma3": dict(family="gemma3_text", rope_theta=1000000.0),
    "gemma3-softcap-bias": dict(family="gemma3_text", final_logit_softcapping=3.0, attention_bias=True),
    # the larger Gemma-3 models scale the global layers' rope linearly; the sliding layers keep theirs
    "gemma3-rope-linear": dict(family="gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0}),
}


def hf_model(name: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    kw = {**FAMILIES[name], **overrides}
    family = kw.pop("family")
    tie = kw.pop("tie", True)
    cfg = make_config(family, vocab_size=300, tie=tie, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else (p.uniform_(0.8, 1.2) if "norm" in n else p.normal_(0, 0.02))
    return cfg, model


def hf_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_logits_match_transformers(name):
    cfg, ref = hf_model(name)
    ours = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        got = ours(ids, torch.arange(19), None, None, last_only=False)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def _reference_decode(ref, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode with transformers' forward and its own cache: tokens and the logits of every step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=ref.config)
    cache_arg = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    ids = prompt[None, :]
    tokens, logits_seq = [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = ref(input_ids=ids, use_cache=True, **{cache_arg: cache})
            logits = out.logits[:, -1].float()
            logits_seq.append(logits[0])
            nxt = int(torch.argmax(logits, -1))
            tokens.append(nxt)
            ids = torch.tensor([[nxt]])
    return tokens, logits_seq


class _Tap:
    """Records the logits our model returns at each call (prefill, then one per decode step)."""

    def __init__(self, model):
        self.model, self.seen = model, []
        self.args = model.args

    def __call__(self, *a, **k):
        out = self.model(*a, **k)
        self.seen.append(out[:, -1].clone())
        return out

    def weight_bytes(self):
        return self.model.weight_bytes()

    def cover_positions(self, n: int) -> None:
        self.model.cover_positions(n)


@pytest.mark.parametrize("kv", ["static", "dynamic", "none"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-untied-rope-scaled", "gemma3"])
def test_decode_steps_match_transformers(name, kv):
    cfg, ref = hf_model(name)
    ours = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(2))
    want_tokens, want_logits = _reference_decode(ref, prompt, steps=8)
    tap = _Tap(ours)
    runner = _make_runner(kv, tap, batch=1)
    with torch.no_grad():
        runner.prefill(prompt, GREEDY)
        for s in range(1, 9):
            runner.step(s)
    got_tokens = runner.out[0, :9].tolist()
    assert got_tokens == want_tokens
    assert len(tap.seen) == 9
    for got, want in zip(tap.seen, want_logits):
        torch.testing.assert_close(got[0], want, atol=TOL, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-mha", "gemma3"])
def test_masked_decode_step_matches_transformers(name, attention, monkeypatch):
    """The step that is compiled and captured attends the whole context bucket under a position mask, two rows
    at once. Logits equal transformers' at every step; also with the FlexAttention variant the GPU check
    measures in place of SDPA."""
    if attention == "flex":
        from gpu.gpu_check import flex_masked_attention

        monkeypatch.setattr("engine.model.masked_attention", flex_masked_attention)
    cfg, ref = hf_model(name)
    ours = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(5))
    want_tokens, want_logits = _reference_decode(ref, prompt, steps=8)
    tap = _Tap(ours)
    runner = StaticRunner(tap, 2, 256, [], torch.device("cpu"), torch.float32)
    runner.set_compiled(runner.masked_step)  # the step as compile and capture see it: masked, whole bucket
    with torch.no_grad():
        runner.prefill(prompt, GREEDY)
        for s in range(1, 9):
            runner.step(s)
    for row in range(2):
        assert runner.out[row, :9].tolist() == want_tokens
    for got, want in zip(tap.seen[1:], want_logits[1:]):
        for row in range(2):
            torch.testing.assert_close(got[row], want, atol=TOL, rtol=0)


def _make_runner(kv: str, model, batch: int):
    cpu = torch.device("cpu")
    if kv == "static":
        return StaticRunner(model, batch, 256, [], cpu, torch.float32)
    if kv == "dynamic":
        return DynamicRunner(model, batch, 256, [], cpu)
    return NoCacheRunner(model, batch, 256, [], cpu)


@pytest.mark.parametrize("kv", ["static", "dynamic", "none"])
def test_candidate_rows_equal_single_row_under_greedy(kv):
    cfg, ref = hf_model("qwen2")
    ours = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(3))
    single = _make_runner(kv, ours, 1)
    multi = _make_runner(kv, ours, 4)
    with torch.no_grad():
        for r in (single, multi):
            r.prefill(prompt, GREEDY)
            for s in range(1, 12):
                r.step(s)
    want = single.out[0, :12].tolist()
    for row in range(4):
        assert multi.out[row, :12].tolist() == want


def test_static_cache_crosses_a_context_bucket():
    """Decoding past 256 positions switches the attended length; tokens still match transformers."""
    cfg, ref = hf_model("llama", max_position_embeddings=1024)
    ours = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, 300, (250,), generator=torch.Generator().manual_seed(4))
    want_tokens, _ = _reference_decode(ref, prompt, steps=12)
    runner = StaticRunner(ours, 1, 512, [], torch.device("cpu"), torch.float32)
    with torch.no_grad():
        runner.prefill(prompt, GREEDY)
        for s in range(1, 13):
            runner.step(s)
    assert runner.out[0, :13].tolist() == want_tokens


@pytest.mark.parametrize("name", ["llama-untied-rope-scaled", "gemma3"])
@pytest.mark.parametrize("kv", ["static", "dynamic"])
def test_rope_tables_grow_to_what_a_runner_needs(name, kv, monkeypatch):
    """A model is built with rope tables for the first positions only; a runner for a longer context grows them
    (the sliding-window layers' own tables too) to the values the whole context's tables have there, and the
    tokens past the first tables still match transformers."""
    import engine.model

    cfg, ref = hf_model(name, max_position_embeddings=1024)
    full = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    assert full.rope_positions == 1024
    monkeypatch.setattr(engine.model, "ROPE_POSITIONS_AT_LOAD", 16)
    ours = build_transformer(cfg, hf_state(ref), torch.float32, torch.device("cpu"))
    assert ours.rope_positions == 16
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5))
    want_tokens, _ = _reference_decode(ref, prompt, steps=10)
    runner = _make_runner(kv, ours, 1)
    assert ours.rope_positions == 257  # the runner's length and one spare position (a static cache's)
    for a, b in [(ours.rope_cos, full.rope_cos), (ours.rope_sin, full.rope_sin)]:
        assert torch.equal(a, b[: a.shape[0]])
    if name == "gemma3":
        assert ours.rope_cos_local is not None and full.rope_cos_local is not None
        assert ours.rope_cos_local.shape[0] == ours.rope_positions
        assert torch.equal(ours.rope_cos_local, full.rope_cos_local[: ours.rope_positions])
    with torch.no_grad():
        runner.prefill(prompt, GREEDY)
        for s in range(1, 11):
            runner.step(s)
    assert runner.out[0, :11].tolist() == want_tokens
    ours.cover_positions(300)  # at least doubled, within the context
    assert ours.rope_positions == 2 * 257
    ours.cover_positions(5000)  # never past the context
    assert ours.rope_positions == 1024 and torch.equal(ours.rope_sin, full.rope_sin)


def test_rope_tables_given_by_hand_are_not_grown():
    from engine.model import ModelArgs, Transformer, rope_tables

    cfg, _ = hf_model("llama", max_position_embeddings=1024)
    args = ModelArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = Transformer(args, *rope_tables(cfg, args.head_dim, 64))
    model.cover_positions(64)
    with pytest.raises(ValueError, match="hold 64 positions and cannot be extended to 65"):
        model.cover_positions(65)


def test_missing_weight_is_named():
    from engine.errors import ModelLoadError

    cfg, ref = hf_model("llama")
    sd = hf_state(ref)
    del sd["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ModelLoadError, match="down_proj"):
        build_transformer(cfg, sd, torch.float32, torch.device("cpu"))


def test_partial_rotary_embedding_is_not_on_the_fast_path():
    from engine.model import ModelArgs

    cfg, _ = hf_model("llama")
    cfg.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        ModelArgs.from_hf_config(cfg)
