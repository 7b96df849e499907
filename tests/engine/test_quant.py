"""Weight-only int8/int4 linears against a de-quantised fp32 reference, the weights option through the engine
(validation, unavailable combinations, re-placing), and a tiny model's greedy tokens in int8 beside native."""

from __future__ import annotations

import pytest
import torch
from int8_bounds import int4_kernel_tolerance, int8_kernel_tolerance, within

from engine.errors import OptionsError
from engine.quant import (
    INT4_GRID_TYPES,
    INT4_GROUP,
    QUANTISED_LINEARS,
    Int4Linear,
    Int8Linear,
    QuantEmbedding,
    dequantize_int4,
    dequantize_int4_min,
    quantize_int4,
    quantize_int4_min,
    quantize_int8,
    quantize_linears,
    weight_bytes,
)
from engine.types import EngineOptions, SamplingParams

SHAPES = [(1536, 576), (576, 1536), (192, 64)]


def _bf16_matmul_tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    # The kernels take bf16 activations and round their output to bf16: the error is that of the rounded input
    # (2^-8 relative per element, summed over K with random signs) plus one output rounding.
    scale = (x.abs() @ w.abs().T).max().item()
    return 2 * 2**-8 * scale


@pytest.fixture(params=["own", "aten"])
def int8_kernel(request, monkeypatch):
    """Both CPU int8 paths: the project's kernel (where it builds) and torch's packed one that replaces it."""
    import engine.cpu_kernels as cpu_kernels

    if request.param == "own":
        if cpu_kernels.kernel() is None:
            pytest.skip(f"the int8 kernel did not build: {cpu_kernels.unavailable_reason()}")
    else:
        monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)
    return request.param


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5])
def test_int8_linear_matches_its_dequantised_weights(n, k, m, int8_kernel):
    torch.manual_seed(n + k + m)
    w, b, x = torch.randn(n, k) * 0.05, torch.randn(n) * 0.01, torch.randn(2, m, k)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    # per channel: the round trip is within half a step of each row's scale
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()
    lin = Int8Linear(w, b, torch.float32)
    assert lin.own_kernel == (int8_kernel == "own")
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (2, m, n)
    if int8_kernel == "own":  # int16 activations in blocks, fp32 scales
        want = x.double() @ (q.double() * scales.double()[:, None]).T + b.double()
        assert within(got, want, int8_kernel_tolerance(x, q, scales))
    else:
        ref_w = q.float() * scales.to(torch.bfloat16).float()[:, None]  # the kernel's bf16 scales
        want = x @ ref_w.T + b
        torch.testing.assert_close(got, want, atol=_bf16_matmul_tolerance(x.reshape(-1, k), ref_w), rtol=0)


@pytest.mark.parametrize("n,k", SHAPES + [(64, 96)])  # 96: a group past the last whole activation block
@pytest.mark.parametrize("m", [1, 3])
def test_int4_linear_matches_its_dequantised_weights(n, k, m, int8_kernel):
    """The own int4 kernel within its elementwise bound of the exact product with the de-quantised weights (each
    row alone: 3 rows give each row's 1-row result bit for bit); torch's packed kernel within bf16 rounding."""
    torch.manual_seed(n * k + m)
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    lin = Int4Linear(w, None, torch.float32)
    got = lin(x)
    assert lin.own_kernel is (int8_kernel == "own")
    if int8_kernel == "own":  # Q4_1's form: fp16 scales and minimums
        q, scales, mins = quantize_int4_min(w)
        assert int(q.max()) <= 15 and scales.shape == mins.shape == (n, k // INT4_GROUP)
        assert scales.dtype == mins.dtype == torch.float16
        deq = dequantize_int4_min(q, scales, mins)
        assert ((deq - w).abs() <= scales.float().repeat_interleave(INT4_GROUP, dim=1) / 2 + 1e-6).all()
        want = x.double() @ deq.double().T
        assert within(got, want, int4_kernel_tolerance(x, q, scales, mins))
        for i in range(m):
            assert torch.equal(lin(x[i : i + 1]), got[i : i + 1])
    else:
        q, scales, zeros = quantize_int4(w)
        assert int(q.max()) <= 15 and scales.shape == (n, k // INT4_GROUP)
        assert (
            (dequantize_int4(q, scales, zeros) - w).abs() <= scales.repeat_interleave(INT4_GROUP, dim=1) / 2 + 1e-6
        ).all()
        ref_w = dequantize_int4(q, scales.to(torch.bfloat16), zeros.to(torch.bfloat16))  # the kernel's bf16 pairs
        torch.testing.assert_close(got, x @ ref_w.T, atol=_bf16_matmul_tolerance(x, ref_w), rtol=0)


def test_the_int4_bound_is_tight_enough_to_fail():
    """The int4 kernel's bound catches a wrong weight: the bound is far below one int4 step of a weight."""
    import engine.cpu_kernels as cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(5)
    w, x = torch.randn(64, 128) * 0.05, torch.randn(2, 128)
    q, scales, mins = quantize_int4_min(w)
    got = Int4Linear(w, None, torch.float32)(x)
    assert within(
        got, x.double() @ dequantize_int4_min(q, scales, mins).double().T, int4_kernel_tolerance(x, q, scales, mins)
    )
    q_off = q.clone()
    q_off[7, 40] = (q_off[7, 40] + 1) % 16  # one nibble of one weight
    wrong = x.double() @ dequantize_int4_min(q_off, scales, mins).double().T
    assert not within(got, wrong, int4_kernel_tolerance(x, q, scales, mins))


def test_quantised_model_holds_fewer_bytes(int8_kernel):
    lin = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False))
    full = weight_bytes(lin)
    assert quantize_linears(lin, "int8", torch.float32) == 2
    scale_bytes = 4 if int8_kernel == "own" else 2  # fp32 scales for the own kernel, bf16 for torch's
    assert weight_bytes(lin) == 2 * 256 * 512 + scale_bytes * (512 + 256)  # int8 weights and the scales
    assert weight_bytes(lin) < full / 3


def test_an_own_kernel_int4_linear_holds_five_bits_a_weight():
    """The own CPU int4 layout: two weights a byte, one fp16 scale and one fp16 minimum a group of 32 (GGUF Q4_1's
    20 bytes a block), where fp32 pairs held 6 bits a weight."""
    import engine.cpu_kernels as cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    lin = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False))
    assert quantize_linears(lin, "int4", torch.float32) == 2
    weights = 2 * 256 * 512
    assert weight_bytes(lin) == weights // 2 + 2 * 2 * weights // INT4_GROUP
    assert weight_bytes(lin) * 8 == weights * 5
    layer = lin[0]
    assert isinstance(layer, Int4Linear) and layer.scales.dtype == layer.mins.dtype == torch.float16


def test_q4_1_groups_come_back_exactly():
    """A tensor written as GGUF Q4_1 and de-quantised as the loader does: quantize_int4_min finds each block's
    own d and m (as scale and minimum) and q, so the own kernel's int4 multiplies the file's values bit for bit."""
    import gguf
    import numpy as np

    from engine.gguf_dequant import dequantize

    rng = np.random.default_rng(4)
    data = (rng.standard_normal((48, 256)) * rng.uniform(0.001, 3, (48, 1))).astype(np.float32)
    data[3, 32:64] = 0.25  # a constant block: d = 0, any q
    raw = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)))
    w = dequantize(raw.view(torch.uint8).reshape(-1), "Q4_1", (48, 256), torch.float32)
    q, scales, mins = quantize_int4_min(w)
    assert torch.equal(dequantize_int4_min(q, scales, mins), w)
    blocks = raw.view(torch.uint8).reshape(48 * 8, 20)
    d, m = blocks[:, 0:2].contiguous().view(torch.float16), blocks[:, 2:4].contiguous().view(torch.float16)
    spans = q.view(48 * 8, 32).amax(-1) - q.view(48 * 8, 32).amin(-1) == 15
    assert int(spans.sum()) >= 48 * 8 - 1  # every block but the constant one spans 0..15
    assert torch.equal(scales.reshape(-1)[spans], d.reshape(-1)[spans])
    assert torch.equal(mins.reshape(-1), m.reshape(-1))


def test_q4_0_groups_are_held_as_the_file_has_them():
    """`grid`: a Q4_0 tensor (its groups rarely span 0..15, and half have a negative d) comes back bit for bit, with
    d itself as the scale, where the range over 15 re-quantised most groups onto another grid; weights on no such
    grid are quantised as without it; Q4_1 exactly either way."""
    import gguf
    import numpy as np

    from engine.gguf_dequant import dequantize

    rng = np.random.default_rng(7)
    data = (rng.standard_normal((48, 256)) * rng.uniform(0.001, 3, (48, 1))).astype(np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0))
    w = dequantize(torch.from_numpy(raw).view(torch.uint8).reshape(-1), "Q4_0", (48, 256), torch.float32)
    plain = dequantize_int4_min(*quantize_int4_min(w))
    assert (plain != w).float().mean() > 0.2  # the range over 15 is another grid than the file's
    q, scales, mins = quantize_int4_min(w, grid=True)
    assert torch.equal(dequantize_int4_min(q, scales, mins), w)
    d = torch.from_numpy(raw).view(torch.uint8).reshape(-1, 18)[:, :2].contiguous().view(torch.float16).reshape(-1)
    assert bool((d < 0).any()) and torch.equal(scales.reshape(-1), d)  # d itself: up from -8d, or down from it
    floats = torch.from_numpy(data)
    assert all(torch.equal(a, b) for a, b in zip(quantize_int4_min(floats, grid=True), quantize_int4_min(floats)))
    q1 = np.ascontiguousarray(gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1))
    w1 = dequantize(torch.from_numpy(q1).view(torch.uint8).reshape(-1), "Q4_1", (48, 256), torch.float32)
    assert torch.equal(dequantize_int4_min(*quantize_int4_min(w1, grid=True)), w1)


def test_weights_are_quantised_in_row_blocks_with_the_same_result(monkeypatch):
    """A block at a time, so that a large head's temporaries are a block's; bit for bit the whole tensor's result,
    whatever the block's size (one row, rows that do not divide the tensor), on and off Q4_0's grid."""
    import engine.quant as quant

    torch.manual_seed(11)
    w = torch.randn(37, 64) * torch.rand(37, 1) * 3
    w[5] = 0.25  # a row whose groups are all one value
    whole = {
        "int8": quantize_int8(w),
        "int4": quant.quantize_int4(w),
        "int4_min": quantize_int4_min(w),
        "int4_grid": quantize_int4_min(w, grid=True),
    }
    for rows in (1, 5, 36):
        monkeypatch.setattr(quant, "QUANT_CHUNK_FLOATS", rows * 64)
        blocked = {
            "int8": quantize_int8(w),
            "int4": quant.quantize_int4(w),
            "int4_min": quantize_int4_min(w),
            "int4_grid": quantize_int4_min(w, grid=True),
        }
        for name, parts in whole.items():
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, blocked[name])), (rows, name)
    monkeypatch.setattr(quant, "QUANT_CHUNK_FLOATS", 64)
    # the outputs are made where the weights are (a CUDA model is quantised on its device): they were on the CPU
    on_meta = w.to("meta")
    assert all(t.device.type == "meta" for t in (*quantize_int8(on_meta), *quant.quantize_int4(on_meta)))
    bad = w.clone()
    bad[30, 3] = float("nan")  # found in a later block: refused as before
    with pytest.raises(ValueError, match="int4 cannot hold these weights: they contain an inf or a NaN"):
        quantize_int4_min(bad)


@pytest.mark.parametrize("quant, grid", [("Q4_0", True), ("Q8_0", False)])
def test_a_4_bit_ggufs_linears_keep_the_files_values_in_int4(tiny_factory, tmp_path, quant, grid):
    """Loaded from a Q4_0 GGUF and switched to int4 on the own CPU kernel, every layer linear multiplies exactly
    the values the file de-quantises to (the native model's); from a Q8_0 file they are re-quantised (no grid)."""
    from gguf_fixtures import hf_llama_to_gguf

    import engine.cpu_kernels as cpu_kernels
    from engine.engine import Engine

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    path = hf_llama_to_gguf(tiny_factory("llama"), tmp_path / f"tiny.{quant}.gguf", quant=quant)
    e = Engine.load(str(path), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        assert bool(e.checkpoint.tensor_types & INT4_GRID_TYPES) is grid
        native = {
            n: m.weight.detach().clone()
            for n, m in e.model.named_modules()
            if n.startswith("layers.") and isinstance(m, torch.nn.Linear)
        }
        e.reconfigure(e.options.with_(weights="int4"))
        held = {n: m for n, m in e.model.named_modules() if isinstance(m, Int4Linear)}
        assert set(held) == set(native)
        for name, lin in held.items():
            rows = lin.rows(torch.arange(lin.out_features), torch.float32)
            assert torch.equal(rows, native[name]) is grid, name
    finally:
        e.close()


def test_int4_refuses_weights_beyond_fp16_and_names_the_linear():
    """The own CPU int4 keeps scales and minimums in fp16: a weight beyond its range is a clear error naming the
    linear (the engine reports it as a load error), not an inf in the model."""
    import engine.cpu_kernels as cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    lin = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 64, bias=False))
    with torch.no_grad():
        lin[1].weight[5, 7] = -1e6
    with pytest.raises(
        ValueError, match=r"^1: int4 keeps each group's scale and minimum in fp16; these weights reach 1e\+06"
    ):
        quantize_linears(lin, "int4", torch.float32)


def test_a_switch_the_weights_cannot_take_keeps_the_model_answering(tiny_factory, tmp_path, monkeypatch):
    """A model with one weight beyond fp16's range: switching it to int4 on the CPU is a load error naming the
    linear, and the engine keeps its native weights and answers as before; the failed attempt's model is freed
    before the previous weights are placed again (never both held: on a GPU the first may be why it failed)."""
    import shutil
    import weakref

    from safetensors.torch import load_file, save_file

    import engine.cpu_kernels as cpu_kernels
    import engine.engine as engine_module
    import engine.quant as quant
    from engine.engine import Engine
    from engine.errors import ModelLoadError

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    folder = tmp_path / "huge-weight"
    shutil.copytree(tiny_factory("llama"), folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = 1e6
    save_file(weights, folder / "model.safetensors")
    e = Engine.load(str(folder), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
        before = e.generate([{"role": "user", "content": "hi"}], sampling).token_ids
        quantised, alive_at_rebuild = [], []
        real_quantise, real_build = quant.quantize_linears, engine_module.build_transformer

        def quantise(model, *a):
            quantised.append(weakref.ref(model))
            return real_quantise(model, *a)

        def build(*a, **kw):
            alive_at_rebuild.extend(r() is not None for r in quantised)
            return real_build(*a, **kw)

        monkeypatch.setattr(quant, "quantize_linears", quantise)
        monkeypatch.setattr(engine_module, "build_transformer", build)
        with pytest.raises(ModelLoadError, match=r"int4: layers\.1\.feed_forward\.w2: .*beyond fp16's range"):
            e.reconfigure(e.options.with_(weights="int4"))
        assert len(quantised) == 1 and alive_at_rebuild == [False]  # the second build: the previous weights
        assert e.weights == "native" and e.options.weights == "native"
        assert not any(isinstance(m, QUANTISED_LINEARS) for m in e.model.modules())
        assert e.generate([{"role": "user", "content": "hi"}], sampling).token_ids == before
    finally:
        e.close()


def test_weights_option_is_validated():
    assert EngineOptions(weights="int4").validate().weights == "int4"
    with pytest.raises(OptionsError, match="weights must be one of native, int8, int4"):
        EngineOptions(weights="int3").validate()
    with pytest.raises(OptionsError):
        EngineOptions.from_dict({"weights": 8})


@pytest.fixture(scope="module")
def engine(tiny_factory):
    from engine.engine import Engine

    folder = tiny_factory("llama", hidden_size=64, intermediate_size=128)
    e = Engine.load(str(folder), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    yield e
    e.close()


def test_int8_and_native_greedy_tokens_on_a_tiny_model(engine):
    import engine.cpu_kernels as cpu_kernels

    msgs = [{"role": "user", "content": "Tell me about Paris"}]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    native = engine.generate(msgs, params).token_ids[0]
    native_bytes, parameters = engine.info.weight_bytes, engine.info.parameters
    assert engine.info.bytes_per_token == native_bytes  # tied: the head reads the whole embedding
    floor = engine.info.memory_floor_ms  # at this CPU's measured read bandwidth (tests/engine/test_bandwidth.py)
    assert floor is not None and "measured read bandwidth" in engine.info.memory_floor_source
    engine.reconfigure(engine.options.with_(weights="int8"))
    try:
        model = engine.model
        assert isinstance(model.tok_embeddings, QuantEmbedding) and model.tok_embeddings.weight is model.output.weight
        assert engine.info.weights == "int8" and engine.info.weight_bytes < 0.3 * native_bytes  # no fp32 table kept
        assert engine.info.weights_kernel == cpu_kernels.describe()  # the own kernel, or torch's with the reason
        assert engine.info.parameters == parameters  # the quantised linears' weights still count, the tied head once
        assert engine.info.bytes_per_token == engine.info.weight_bytes  # tied: the head reads the whole table
        assert engine.info.memory_floor_ms == pytest.approx(floor * engine.info.bytes_per_token / native_bytes)
        result = engine.generate(msgs, params)
        assert result.options.weights == "int8" and "weights" not in result.unavailable
        int8 = result.token_ids[0]
    finally:
        engine.reconfigure(engine.options.with_(weights="native"))
    agree = sum(a == b for a, b in zip(native, int8)) / max(len(native), 1)
    print(f"tiny llama, greedy, 24 tokens: int8 agrees with native on {agree:.0%} of positions")
    assert len(int8) == len(native) and int8[0] == native[0]  # the first token comes from the same prompt logits
    assert engine.info.weights == "native" and engine.info.weight_bytes == native_bytes
    assert engine.info.weights_kernel == ""


@pytest.mark.parametrize("family, keeps", [("llama", True), ("gemma3_text", False)])
def test_which_int8_linears_keep_the_kernels_bf16_output(tiny_factory, family, keeps, monkeypatch):
    """Llama's residual adds promote a bf16 output exactly as a cast would, so the linears before them keep it;
    Gemma's norms after the attention and the MLP give back their input's dtype, so there it is cast back. (Torch's
    packed kernel, which answers in bf16; the project's own one answers in fp32.)"""
    import engine.cpu_kernels as cpu_kernels
    from engine.loader import load_checkpoint

    monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)
    from engine.model import build_transformer

    cpu = torch.device("cpu")
    ck = load_checkpoint(str(tiny_factory(family)))
    model = build_transformer(ck.config, ck.weights(torch.float32, cpu), torch.float32, cpu)
    quantize_linears(model, "int8", torch.float32)
    block = model.layers[0]
    for lin in (block.attention.wo, block.feed_forward.w2):
        assert isinstance(lin, Int8Linear) and lin.keep_kernel_dtype is keeps
        out = lin(torch.randn(3, lin.in_features))
        assert out.dtype == (torch.bfloat16 if keeps else torch.float32)
    assert model.output.keep_kernel_dtype  # nothing rounds the logits before .float() without a soft cap


def test_unavailable_weights_are_reported_and_not_applied(engine, monkeypatch):
    import engine.cpu_kernels as cpu_kernels
    import engine.quant as quant

    monkeypatch.setattr(quant, "has_op", lambda name: name != "_weight_int4pack_mm_for_cpu")  # an older torch
    monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)  # and no compiler for the own kernels
    opts = engine.options.with_(weights="int4")
    reasons = engine.unavailable(opts)
    assert reasons["weights"] == "this torch has no aten._weight_int4pack_mm_for_cpu for the CPU"
    eff, _ = engine.effective(opts)
    assert eff.weights == "native"
    # int4's head is int8 (HEAD_FORMAT): without torch's int8 kernel either, int4 is unavailable for that
    monkeypatch.setattr(quant, "has_op", lambda name: name != "_weight_int8pack_mm")
    assert engine.unavailable(opts)["weights"] == "this torch has no aten._weight_int8pack_mm for the CPU"


def test_weights_unavailable_on_the_fallback(tiny_factory):
    from engine.engine import Engine

    e = Engine.load(str(tiny_factory("gpt2")), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        why = e.unavailable(e.options.with_(weights="int8"))["weights"]
        assert "fallback" in why and "transformers' own" in why
    finally:
        e.close()


def _top_level_aten_ops(model) -> int:
    """Top-level aten ops of one eager decode step (as the engine's launches/step counts them on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.model import StaticKVCache

    cache = StaticKVCache.allocate(model.args, 1, 16, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        cache.attn_len = 4
        model(torch.arange(1, 5)[None], torch.arange(4), cache, None)
        cache.attn_len = 5
        tok, pos = torch.tensor([[7]]), torch.tensor([4])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(tok, pos, cache, None)
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


@pytest.mark.parametrize("fmt", ["native", "int8", "int4"])
def test_decode_step_op_count_stays_bounded(engine, fmt):
    # The CPU step is bound by its op count as much as by its matmuls: 52 ops a layer in fp32 and 68 with the
    # quantised linears before they were cut to 38 and 44 (one rope over q and k, no reshapes around the linears,
    # no no-op casts), plus about 20 once a step (embedding, rope tables, final norm, head). A bound per layer
    # catches a change that adds ops to every layer.
    engine.reconfigure(engine.options.with_(weights=fmt))
    try:
        layers = engine.model.args.n_layers
        ops = _top_level_aten_ops(engine.model)
    finally:
        engine.reconfigure(engine.options.with_(weights="native"))
    per_layer = {"native": 38, "int8": 44, "int4": 44}[fmt]
    print(f"{fmt}: {ops} top-level aten ops a step over {layers} layers")
    assert ops <= per_layer * layers + 22


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_int8_greedy_tokens_do_not_change_with_rows_per_step(tiny_factory, int8_kernel, monkeypatch, family):
    """Candidates and a speculative verify run several rows through the int8 linears at once; with the own kernel
    each row's sums do not depend on how many run, so greedy answers equal plain decoding's (Qwen2: biases on
    q/k/v, added inside the kernel; Gemma-3: sliding-window layers of 8 positions, which the answer runs past).
    With the own kernel the layers run as the whole-layer kernel."""
    import engine.cpu_kernels as cpu_kernels
    from engine.engine import Engine

    rows_per_call: set[int] = set()
    real = cpu_kernels.run_layers
    monkeypatch.setattr(
        cpu_kernels, "run_layers", lambda layers, x, *a: rows_per_call.add(x.shape[0]) or real(layers, x, *a)
    )

    folder = tiny_factory(family, hidden_size=64, intermediate_size=128)
    e = Engine.load(str(folder), EngineOptions(device="cpu", dtype="fp32", weights="int8", profile_window=False))
    try:
        assert (e.model.layers[0].attention.wqkv.bias is not None) == (family == "qwen2")
        assert e.model.args.sliding_window == (8 if family == "gemma3_text" else None)
        msgs = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]
        params = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
        plain = e.generate(msgs, params).token_ids[0]
        e.reconfigure(e.options.with_(candidates=3))
        rows = e.generate(msgs, params).token_ids
        e.reconfigure(e.options.with_(candidates=1, speculation="ngram", draft_tokens=4))
        spec = e.generate(msgs, params)
    finally:
        e.close()
    if int8_kernel == "own":
        assert rows == [plain] * 3
        assert spec.token_ids[0] == plain and not spec.unavailable
        assert {1, 3} <= rows_per_call and max(rows_per_call) > 3  # decode, candidates, prefill and verify rows
    else:  # torch's packed kernel makes no such promise; the first token comes from the same prompt logits
        assert all(r[0] == plain[0] for r in rows)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_the_own_kernels_traced_call_gives_the_eager_result(cls, monkeypatch):
    """Where torch.compile traces, a quantised linear calls its own kernel as an opaque custom op; called as that op
    (outside a compile, which takes minutes on a CPU) it gives the direct call's result bit for bit, bias included."""
    import engine.cpu_kernels as cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(3)
    lin = cls(torch.randn(96, 128) * 0.05, torch.randn(96), torch.float32)
    x = torch.randn(3, 128)
    direct = lin(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    ops = []
    for name in ("_int8_linear_op", "_int4_linear_op"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _real=real, _name=name: ops.append(_name) or _real(*a))
    traced = lin(x)
    assert ops == ["_int8_linear_op" if cls is Int8Linear else "_int4_linear_op"]
    assert torch.equal(traced, direct)
    monkeypatch.undo()
    op, args = (
        (cpu_kernels._int8_linear_op, (x, lin.weight, lin.scales, lin.bias))
        if cls is Int8Linear
        else (cpu_kernels._int4_linear_op, (x, lin.weight, lin.scales, lin.mins, lin.bias))
    )
    torch.library.opcheck(op, args)  # its fake (what compile traces with) agrees with the op


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_embedding_reads_the_quantised_table(fmt):
    """A looked-up row is the quantised table's row de-quantised, bit for bit what the linear multiplies by (the
    int4 own-kernel layout's nibble order included), and in the activations' dtype."""
    import engine.cpu_kernels as cpu_kernels

    torch.manual_seed(0)
    w = torch.randn(40, 64)
    lin = (Int8Linear if fmt == "int8" else Int4Linear)(w, None, torch.float32)
    if fmt == "int4" and not lin.own_kernel:
        assert lin.rows(torch.tensor([0]), torch.float32) is None  # torch's packed layout: no rows to read
        return
    idx = torch.tensor([3, 0, 39, 3])
    got = QuantEmbedding(lin, torch.float32, tied=True)(idx)
    if fmt == "int8":
        want = lin.weight.float() * lin.scales.float()[:, None]
    else:
        want = dequantize_int4_min(*quantize_int4_min(w))
        assert lin.weight.dtype == torch.uint8 and cpu_kernels.kernel() is not None
    assert got.dtype == torch.float32 and torch.equal(got, want[idx])
    # what the linear computes is the product with those rows (within its own kernel's int16 activations)
    x = torch.randn(2, 64)
    torch.testing.assert_close(lin(x), x @ want.T, atol=0.05, rtol=0.01)


@pytest.mark.parametrize("tie", [True, False])
def test_an_int8_model_keeps_no_float_embedding(tiny_factory, tie):
    """Tied: the embedding reads the int8 head's table. Untied: the table is quantised on its own and read one row
    a token. Either way the parameters count as before and the logits stay near the native model's."""
    from engine.engine import Engine

    folder = tiny_factory("llama", tie=tie)
    e = Engine.load(str(folder), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        ids = torch.tensor([[5, 17, 33, 2, 90]])
        with torch.inference_mode():
            native = e.model(ids, torch.arange(5))
        parameters = e.info.parameters
        e.reconfigure(e.options.with_(weights="int8"))
        emb = e.model.tok_embeddings
        assert isinstance(emb, QuantEmbedding) and emb.tied == tie
        assert not any(isinstance(m, torch.nn.Embedding) for m in e.model.modules())
        assert e.info.parameters == parameters
        vocab, dim = emb.weight.shape
        if tie:
            assert emb.weight is e.model.output.weight and e.info.bytes_per_token == e.info.weight_bytes
        else:
            assert emb.weight is not e.model.output.weight
            assert e.info.bytes_per_token == e.info.weight_bytes - (vocab - 1) * (dim + 4)  # int8 rows, fp32 scales
        with torch.inference_mode():
            int8 = e.model(ids, torch.arange(5))
        torch.testing.assert_close(int8, native, atol=0.1, rtol=0.05)
        assert int8.argmax(-1).equal(native.argmax(-1))
    finally:
        e.close()


@pytest.mark.parametrize("tie", [True, False])
def test_int4_keeps_the_head_in_int8(tiny_factory, tie):
    """int4 quantises every layer's linears to int4 and the output head to int8 (a tied embedding reading that int8
    table, an untied one its own int4 table), and the model panel's kernel line says so."""
    from engine.engine import Engine

    folder = tiny_factory("llama", tie=tie)
    e = Engine.load(str(folder), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        e.reconfigure(e.options.with_(weights="int4"))
        model = e.model
        layers = [m for n, m in model.named_modules() if isinstance(m, QUANTISED_LINEARS) and n != "output"]
        assert layers and all(isinstance(m, Int4Linear) for m in layers)
        assert isinstance(model.output, Int8Linear)
        emb = model.tok_embeddings
        assert isinstance(emb, QuantEmbedding)
        assert isinstance(emb.source, Int8Linear if tie else Int4Linear) and (emb.source is model.output) == tie
        assert "the output head in int8" in e.info.weights_kernel
        e.reconfigure(e.options.with_(weights="int8"))
        assert "output head" not in e.info.weights_kernel
    finally:
        e.close()


@pytest.mark.parametrize("own", [True, False])
def test_int4_takes_a_vocabulary_of_any_size(tiny_factory, own, monkeypatch):
    """The head is int8 under int4, so the vocabulary's size is not int4's to check: 330 tokens, in neither eights
    nor sixteens, with an untied table, on the own kernels and on torch's packed one (which needs outputs in
    sixteens for its int4 linears: there the untied table stays float, as only that kernel reads the layout)."""
    import engine.cpu_kernels as cpu_kernels
    from engine.engine import Engine

    if own and cpu_kernels.kernel() is None:
        pytest.skip(f"the own CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")
    if not own:
        monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)
    folder = tiny_factory("llama", tie=False, vocab_size=330)
    e = Engine.load(str(folder), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        assert e.args.vocab_size == 330 and not e.args.tie_embeddings
        opts = e.options.with_(weights="int4")
        assert "weights" not in e.unavailable(opts)
        e.reconfigure(opts)
        assert e.info.weights == "int4" and isinstance(e.model.output, Int8Linear)
        emb = e.model.tok_embeddings
        assert isinstance(emb, QuantEmbedding) if own else isinstance(emb, torch.nn.Embedding)
        out = e.generate([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_new_tokens=6))
        assert out.metrics.new_tokens_total == 6
    finally:
        e.close()


def test_int4_shape_rules_name_the_linear_and_the_kernel(monkeypatch):
    import engine.cpu_kernels as cpu_kernels
    from engine.quant import why_not

    cpu = torch.device("cpu")
    shapes = {"wqkv": (24, 64), "output": (330, 64)}
    if cpu_kernels.kernel() is not None:  # the own kernel takes any output count; the head is int8
        assert why_not("int4", shapes, cpu) is None
    assert why_not("int4", {"w2": (64, 48), **shapes}, cpu) == "int4 needs inputs in groups of 32; w2 is 64x48"
    monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)
    why = why_not("int4", shapes, cpu)
    assert why is not None and why.endswith("needs outputs in multiples of 16; wqkv is 24x64")
    assert why_not("int4", {"wqkv": (32, 64), "output": (330, 64)}, cpu) is None


def test_torchs_int8_kernel_is_not_given_inputs_it_cannot_sum(monkeypatch):
    """Without the own kernels, int8 runs torch's packed kernel, which sums inputs 16 at a time and checks nothing:
    an MLP of 40 gave wrong logits or crashed the process. Such a model keeps its native weights, saying why."""
    import engine.cpu_kernels as cpu_kernels
    from engine.quant import why_not

    cpu = torch.device("cpu")
    shapes = {"wqkv": (96, 64), "w2": (64, 40), "output": (330, 64)}
    if cpu_kernels.kernel() is not None:  # the own kernel takes any input count
        assert why_not("int8", shapes, cpu) is None
    monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)
    why = why_not("int8", shapes, cpu)
    assert why is not None and why.endswith("needs inputs in multiples of 16; w2 is 64x40")
    assert why_not("int8", {**shapes, "w2": (64, 48)}, cpu) is None
    # int4 keeps its head in int8: the head's inputs too
    assert why_not("int4", {"wqkv": (96, 64), "output": (330, 72)}, cpu) == (
        "torch's packed int8 CPU kernel (the own kernels are not built here) needs inputs in multiples of 16; "
        "output is 330x72"
    )


@pytest.mark.parametrize("switch", [{"weights": "int8"}, {"dtype": "bf16"}])
def test_a_switch_after_an_answer_frees_the_weights_it_replaced(tiny_llama, switch):
    """After an answer on the CPU's own kernels, a switch of weight format or dtype kept the model it replaced:
    the load froze it for the collector (heap.settle), and a layer's kernel binding makes a cycle through its
    block's attributes, so nothing freed it until the engine closed (405 MiB of fp32 linears for the default
    model, beside the int8 ones)."""
    import gc
    import weakref

    import engine.cpu_kernels as cpu_kernels
    from engine.engine import Engine

    if cpu_kernels.kernel() is None:
        pytest.skip(f"the own kernels did not build: {cpu_kernels.unavailable_reason()}")
    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        sampling = SamplingParams(max_new_tokens=3, temperature=0.0)
        e.generate([{"role": "user", "content": "hi"}], sampling)
        assert e.model.layers[0]._cpu_refs is not None  # the binding, and its cycle, exist
        old = weakref.ref(e.model.layers[0].attention.wqkv.weight)
        e.reconfigure(e.options.with_(**switch))
        gc.collect()
        assert old() is None
        assert e.generate([{"role": "user", "content": "hi"}], sampling).metrics.new_tokens_total == 3
    finally:
        e.close()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_each_float_linear_is_freed_once_it_is_quantised(tiny_llama, fmt, monkeypatch):
    """The float weights go one linear at a time while the model is quantised: a list of the linears held every
    float weight until the last was replaced, so an int8 load of the default model peaked at the whole fp32
    model plus its int8 copy (960 MiB against 815 MiB for the native load)."""
    import weakref

    import engine.quant as quant
    from engine.engine import Engine

    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        model = e.model
        e.model = None  # the engine's runners play no part here: the model alone
        e._runners.clear()
        weights = [weakref.ref(m.weight) for _, m in quant._linears(model)]
        alive: list[int] = []
        real = quant._quantised

        def watching(fmt_, weight, bias, act_dtype, grid):
            alive.append(sum(1 for ref in weights if ref() is not None))
            return real(fmt_, weight, bias, act_dtype, grid)

        monkeypatch.setattr(quant, "_quantised", watching)
        assert quantize_linears(model, fmt, torch.float32) == len(weights) > 2
        # when the i-th linear is quantised, only it and those after it still hold float weights
        assert alive == [len(weights) - i for i in range(len(weights))]
    finally:
        e.close()
