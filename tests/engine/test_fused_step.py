"""The whole fused decode step against the eager model, through Triton's interpreter on CPU tensors: logits on the
prompt (fed one token a step through the kernels) and over 8 greedy decode steps, for a tiny random model of each
family; per-row results that do not depend on how many rows run; the engine's option, fallbacks and notices."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_model_golden import hf_model, hf_state  # noqa: E402
from tiny_models import SMOLLM2  # noqa: E402

from engine.decode import StaticRunner  # noqa: E402
from engine.kernels import interpreting, launch  # noqa: E402
from engine.kernels.runner import FusedRunner  # noqa: E402
from engine.model import StaticKVCache, build_transformer  # noqa: E402
from engine.sampling import SamplerKind  # noqa: E402

pytestmark = pytest.mark.skipif(
    not interpreting(),
    reason="these run the kernels through Triton's interpreter "
    "(GAPLESS_TRITON_INTERPRET=1, set by conftest on a machine without CUDA)",
)

GREEDY = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False)
CPU = torch.device("cpu")
# fp32: the kernels sum in another order than MKL's GEMMs, nothing else differs
LOGIT_TOL = 1e-4
FAMILIES = {
    "llama": dict(),
    "llama-untied": dict(tie=False),
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(),  # q/k RMSNorm
}


def model_of(name: str, dtype=torch.float32):
    base = "llama" if name.startswith("llama") else name
    cfg, ref = hf_model(base, **FAMILIES[name])
    return build_transformer(cfg, hf_state(ref), dtype, CPU)


def eager_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V]: the eager model's logits at every position of `ids`, one forward over them all."""
    cache = StaticKVCache.allocate(model.args, 1, 64, torch.float32, CPU)
    cache.attn_len = len(ids)
    return model(torch.tensor([ids]), torch.arange(len(ids)), cache, None, last_only=False)[0]


def feed(runner: FusedRunner, tokens: torch.Tensor, pos: int) -> torch.Tensor:
    """One fused step with `tokens` [B] at `pos`: returns the logits [B, V] of the step."""
    runner.tok.copy_(tokens[:, None])
    runner.pos.fill_(pos)
    runner.fused_step(GREEDY)
    return runner.logits.clone()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_step_logits_match_eager_on_the_prompt_and_8_decode_steps(name):
    model = model_of(name)
    prompt = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        runner = FusedRunner(model, 1, 64, [], CPU, torch.float32)
        ids = list(prompt)
        for p, t in enumerate(prompt):  # the prompt through the kernels, one position a step
            got = feed(runner, torch.tensor([t]), p)
        ref = eager_logits(model, ids)
        for _ in range(8):
            nxt = int(runner.tok[0, 0])
            assert nxt == int(ref[-1].argmax()), "the fused greedy pick is the eager argmax"
            ids.append(nxt)
            got = feed(runner, torch.tensor([nxt]), len(ids) - 1)
            ref = eager_logits(model, ids)
            torch.testing.assert_close(got[0], ref[-1], atol=LOGIT_TOL, rtol=LOGIT_TOL)
        # and every position of the prompt, compared after the fact from the cache the kernels wrote
        k_ref = StaticKVCache.allocate(model.args, 1, 64, torch.float32, CPU)
        k_ref.attn_len = len(ids)
        model(torch.tensor([ids]), torch.arange(len(ids)), k_ref, None)
        for layer in range(model.args.n_layers):
            torch.testing.assert_close(
                runner.cache.k[layer][:, :, : len(ids)],
                k_ref.k[layer][:, :, : len(ids)],
                atol=LOGIT_TOL,
                rtol=LOGIT_TOL,
            )
            torch.testing.assert_close(
                runner.cache.v[layer][:, :, : len(ids)],
                k_ref.v[layer][:, :, : len(ids)],
                atol=LOGIT_TOL,
                rtol=LOGIT_TOL,
            )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_step_half_precision_logits_near_eager(dtype):
    """Half precision: the same first-step logits within 0.05 (fp16) / 0.3 (bf16, truncating interpreter; see
    test_fused_kernels) of the eager model in that dtype, whose rounding points the kernels follow."""
    model = model_of("qwen2", dtype)
    prompt = torch.randint(0, 300, (5,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        runner = FusedRunner(model, 1, 64, [], CPU, dtype)
        for p, t in enumerate(prompt):
            got = feed(runner, torch.tensor([t]), p)
        cache = StaticKVCache.allocate(model.args, 1, 64, dtype, CPU)
        cache.attn_len = len(prompt)
        ref = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, None)[0, -1]
    tol = 0.05 if dtype == torch.float16 else 0.3
    assert (got[0] - ref).abs().max() < tol


@pytest.mark.parametrize("profile", [pytest.param("gpu", marks=pytest.mark.slow), "interpreter"])
def test_rows_give_the_same_result_whatever_their_number(profile, monkeypatch):
    """1 row and 4 (and 6: two row blocks) rows: each row's logits and tokens bit for bit the same."""
    monkeypatch.setattr(launch, "forced_profile", profile)
    model = model_of("qwen3")
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 300, (6, 4), generator=g)
    with torch.inference_mode():
        many = {}
        for rows in (4, 6):
            r = FusedRunner(model, rows, 64, [], CPU, torch.float32)
            many[rows] = [feed(r, prompts[:rows, p], p) for p in range(4)]
            many[rows].append(r.tok[:, 0].clone())
        for row in range(6):
            one = FusedRunner(model, 1, 64, [], CPU, torch.float32)
            single = [feed(one, prompts[row : row + 1, p], p) for p in range(4)] + [one.tok[:, 0].clone()]
            for rows in (4, 6):
                if row < rows:
                    for a, b in zip(single, many[rows]):
                        assert torch.equal(a[0], b[row]), f"row {row} differs between 1 and {rows} rows"


def test_runner_prefill_and_steps_give_the_static_runners_tokens():
    """The runner as the engine drives it: eager prefill into the static cache, then fused steps; candidates."""
    model = model_of("llama")
    prompt = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        for rows in (1, 2):
            ref = StaticRunner(model, rows, 64, [7], CPU, torch.float32)
            fused = FusedRunner(model, rows, 64, [7], CPU, torch.float32)
            for r in (ref, fused):
                r.prefill(prompt, GREEDY)
                for s in range(1, 9):
                    r.step(s)
            assert torch.equal(fused.out[:, :9], ref.out[:, :9])
            assert torch.equal(fused.done, ref.done)
            assert int(fused.pos) == int(ref.pos) == 7 + 8 and int(fused.counter) == 9


@pytest.mark.slow
@pytest.mark.heavy  # through the interpreter a SmolLM2-shaped step takes about a minute on 2 cores: `make test-heavy`
@pytest.mark.timeout(7200)
def test_greedy_tokens_equal_eager_over_32_steps_on_smollm2_shape():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**dict(SMOLLM2, max_position_embeddings=2048))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg)
    model = build_transformer(cfg, hf_state(hf), torch.float32, CPU)
    del hf
    prompt = torch.randint(0, 49152, (8,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = StaticRunner(model, 1, 64, [], CPU, torch.float32)
        fused = FusedRunner(model, 1, 64, [], CPU, torch.float32)
        for r in (ref, fused):
            r.prefill(prompt, GREEDY)
            for s in range(1, 33):
                r.step(s)
    assert fused.out[0, :33].tolist() == ref.out[0, :33].tolist()


def test_what_the_graph_captures_is_the_fused_step(monkeypatch):
    """StaticRunner._capture runs bucket_step on a side stream and under capture; for the fused runner that must be
    the fused step (a CUDA graph cannot be captured here, so this checks the call it would capture)."""
    model = model_of("llama")
    runner = FusedRunner(model, 1, 64, [], CPU, torch.float32)
    ran = []
    monkeypatch.setattr(runner, "fused_step", ran.append)
    monkeypatch.setattr(StaticRunner, "masked_step", lambda *a: pytest.fail("the torch step was run"))
    runner.bucket_step(64, GREEDY)
    assert ran == [GREEDY] and runner.buckets_for(10, 20) == [64]
