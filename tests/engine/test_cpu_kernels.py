"""The project's CPU int8 GEMV (engine/cpu_kernels.c): results against an fp64 reference, each row's result the same
whatever the number of rows, the build cached and rebuilt when it must be, and clear reasons where it cannot run,
with torch's packed kernel taking over."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from int8_bounds import int8_kernel_tolerance as _tolerance
from int8_bounds import within as _within

import engine.cpu_kernels as cpu_kernels
from engine.quant import Int8Linear, quantize_int8

KERNEL = cpu_kernels.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"the int8 kernel did not build: {cpu_kernels._reason}")


def _reference(x, q, scales, bias):
    y = (x.double() @ q.double().T) * scales.double()
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 100), (8, 31), (3, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_an_fp64_reference(n, k, with_bias):
    torch.manual_seed(n * 7 + k)
    q, scales = quantize_int8(torch.randn(n, k))
    bias = torch.randn(n) if with_bias else None
    x = torch.randn(3, k)
    got = KERNEL.linear(x, q, scales, bias)
    assert got.dtype == torch.float32 and got.shape == (3, n)
    want = _reference(x, q, scales, bias)
    assert _within(got, want, _tolerance(x, q, scales))


@needs_kernel
def test_a_large_activation_coarsens_only_its_own_block():
    """One outlier 10^4 times the rest: the blocks without it keep their fine int16 steps."""
    torch.manual_seed(5)
    q, scales = quantize_int8(torch.randn(64, 256))
    x = torch.randn(1, 256) * 1e-2
    x[0, 3] = 100.0
    got = KERNEL.linear(x, q, scales, None)
    want = _reference(x, q, scales, None)
    tol = _tolerance(x, q, scales)
    assert _within(got, want, tol)
    # the bound that a single scale for the whole row would give is about 4x wider here: the blocks matter
    whole_row = (x.abs().max().double() / 32767 / 2 * q.abs().double().sum(1) * scales.double()).unsqueeze(0)
    assert (tol < whole_row / 3).all()


@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_gives_nan_as_fp32_would(bad):
    torch.manual_seed(6)
    q, scales = quantize_int8(torch.randn(16, 192))
    x = torch.randn(2, 192)
    x[1, 70] = bad  # in the second block of the second row
    got = KERNEL.linear(x, q, scales, None)
    assert torch.isnan(got[1]).all()
    assert torch.isfinite(got[0]).all() and _within(
        got[:1], _reference(x[:1], q, scales, None), _tolerance(x[:1], q, scales)
    )


@needs_kernel
def test_zero_and_tiny_blocks_give_their_exact_small_sums():
    q, scales = quantize_int8(torch.randn(8, 128))
    x = torch.zeros(1, 128)
    x[0, 64:] = 1e-38  # a block whose largest magnitude is below any safe reciprocal
    got = KERNEL.linear(x, q, scales, None)
    assert torch.isfinite(got).all() and got.abs().max().item() < 1e-30


@needs_kernel
def test_arguments_it_cannot_read_safely_are_refused():
    q, scales = quantize_int8(torch.randn(16, 64))
    x = torch.randn(2, 64)
    bad = {
        "bf16 activations": (x.bfloat16(), q, scales, None),
        "a transposed input": (torch.randn(64, 2).t(), q, scales, None),
        "too few inputs": (torch.randn(2, 32), q, scales, None),
        "bf16 scales": (x, q, scales.bfloat16(), None),
        "a short bias": (x, q, scales, torch.randn(8)),
        "fp32 weights": (x, q.float(), scales, None),
    }
    for what, args in bad.items():
        with pytest.raises(ValueError, match="int8 kernel arguments"):
            KERNEL.linear(*args)
            pytest.fail(f"{what} was accepted")
    from engine.quant import quantize_int4_min

    q4, s4, z4 = quantize_int4_min(torch.randn(16, 64))
    packed = cpu_kernels.pack_int4(q4)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8
    bad4 = {
        "int8 weights": (x, packed.to(torch.int8), s4, z4, None),
        "short mins": (x, packed, s4, z4[:, :1], None),
        "fp32 scales": (x, packed, s4.float(), z4, None),
        "bf16 mins": (x, packed, s4, z4.bfloat16(), None),
        "inputs not in groups of 32": (torch.randn(2, 48), packed[:, :24].contiguous(), s4, z4, None),
        "too few inputs": (torch.randn(2, 32), packed, s4, z4, None),
    }
    for what, args in bad4.items():
        with pytest.raises(ValueError, match="int4 kernel arguments"):
            KERNEL.linear4(*args)
            pytest.fail(f"{what} was accepted")


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m", [2, 4, 17, cpu_kernels.GEMM_ROWS])
def test_each_rows_result_does_not_depend_on_how_many_rows_run(m, fmt):
    """A verify step or candidates run several rows (up to GEMM_ROWS); greedy answers must not change with their
    number."""
    torch.manual_seed(m)
    bound, _, _ = _bound(fmt, 202, 576, True)
    x = torch.randn(m, 576)
    together = bound.run(x)
    alone = torch.cat([bound.run(x[i : i + 1].contiguous()) for i in range(m)])
    assert torch.equal(together, alone)


def _bound(fmt: str, n: int, k: int, with_bias: bool):
    """(a bound int8, int4 or fp32 linear of random weights, the weight it multiplies in fp32, its bias)"""
    from engine.quant import dequantize_int4_min, quantize_int4_min

    w = torch.randn(n, k) * 0.05
    bias = torch.randn(n) if with_bias else None
    if fmt == "int8":
        q, scales = quantize_int8(w)
        return KERNEL.bind(q, scales, bias), q.float() * scales[:, None], bias
    if fmt == "int4":
        q4, s4, m4 = quantize_int4_min(w)
        return KERNEL.bind(cpu_kernels.pack_int4(q4), s4, bias, m4), dequantize_int4_min(q4, s4, m4), bias
    return KERNEL.bind_f32(w, bias), w, bias


def _int4_with_edge_halves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, fp16 scales and minimums with the halves a conversion can get wrong: subnormal, smallest normal, zeros of
    both signs, negative, the largest."""
    special = [2.0**-24, 3 * 2.0**-20, 2.0**-14, 0.0, -0.0, -1.5, 65504.0, -65504.0, 0.1, 1e-3]
    v = torch.tensor(special, dtype=torch.float16)
    n = len(special)  # every scale (a group each) beside every minimum (a row each)
    scales, mins = v.abs().expand(n, n).contiguous(), v[:, None].expand(n, n).contiguous()
    q = torch.randint(0, 16, (n, n * 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    return q, scales, mins


@needs_kernel
def test_int4_reads_every_kind_of_fp16_scale_and_minimum():
    """The layout's fp16 scales and minimums are read as torch converts them (F16C where the CPU has it, C
    elsewhere: see the portable build's test), subnormals and signed zeros included."""
    from engine.quant import dequantize_int4_min

    q, scales, mins = _int4_with_edge_halves()
    bound = KERNEL.bind(cpu_kernels.pack_int4(q), scales, None, mins)
    assert torch.equal(bound.dequantized(), dequantize_int4_min(q, scales, mins))


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dequantized_rows_are_the_weights_the_gemv_multiplies(fmt):
    """Bit for bit the reference de-quantisation (q * scale; q * scale + min), whole or a range of rows, with
    and without the CPU's vector loop."""
    torch.manual_seed(11)
    bound, want, _ = _bound(fmt, 70, 192, False)
    assert torch.equal(bound.dequantized(), want)
    assert torch.equal(bound.dequantized(13, 41), want[13:41])
    out = torch.full((5, 192), float("nan"))
    assert bound.dequantized(65, 70, out) is out and torch.equal(out, want[65:])
    for bad in ((-1, 3), (10, 5), (0, 71)):
        with pytest.raises(ValueError, match="rows"):
            bound.dequantized(*bad)
    with pytest.raises(ValueError, match="de-quantised tile"):
        bound.dequantized(0, 4, torch.empty(5, 192))


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp32"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_more_rows_than_a_gemv_serves_run_as_a_gemm_of_the_same_weights(fmt, with_bias, monkeypatch):
    """A prefill chunk (more than GEMM_ROWS rows) is torch's fp32 GEMM on the de-quantised weights: what
    F.linear gives on them, whether the weight is de-quantised whole or a few rows at a time (here 7-row tiles and a
    2-row last one; the GEMM's order of summing may differ with the tile), and within the GEMV's int16 rounding of
    what the GEMV gives row by row."""
    torch.manual_seed(12)
    bound, w, bias = _bound(fmt, 37, 128, with_bias)
    x = torch.randn(cpu_kernels.GEMM_ROWS + 5, 128)
    whole = bound.run(x)
    assert whole.shape == (x.shape[0], 37) and whole.is_contiguous()
    want = torch.nn.functional.linear(x, w, bias)
    assert torch.allclose(whole, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cpu_kernels, "DEQUANT_TILE_FLOATS", 7 * 128)
    assert torch.allclose(bound.run(x), want, rtol=1e-5, atol=1e-5)
    by_gemv = torch.cat([bound.run(x[i : i + 8].contiguous()) for i in range(0, x.shape[0], 8)])
    assert torch.allclose(by_gemv, whole, rtol=1e-3, atol=1e-3)
    assert not torch.equal(by_gemv, whole) or fmt == "fp32"  # two sums, not one path taken twice


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_count_does_not_change_the_result(threads):
    torch.manual_seed(0)
    q, scales = quantize_int8(torch.randn(301, 640))
    x = torch.randn(2, 640)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.linear(x, q, scales, None)
        torch.set_num_threads(threads)
        many = KERNEL.linear(x, q, scales, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@needs_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_in_the_process():
    """The library's OpenMP is the runtime torch loaded, so its threads are torch's and not a second pool."""
    maps = open("/proc/self/maps", encoding="utf-8").read()
    assert str(KERNEL.path) in maps
    runtimes = set(re.findall(r"\S*lib[gi]omp[\w.-]*\.so[\w.]*", maps))
    assert len(runtimes) <= 1, runtimes


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_uses_it_with_fp32_scales(dtype):
    torch.manual_seed(1)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = Int8Linear(w.to(dtype), b.to(dtype), dtype)
    assert lin.own_kernel and lin.scales.dtype == torch.float32
    x = torch.randn(2, 5, 64, dtype=dtype)
    got = lin(x)
    assert got.dtype == dtype and got.shape == (2, 5, 96)
    q, scales = quantize_int8(w.to(dtype))
    want = _reference(x.reshape(-1, 64).float(), q, scales, b.to(dtype).float()).reshape(2, 5, 96)
    atol = 0 if dtype == torch.float32 else 2**-7 * want.abs().max().item()
    assert _within(got.reshape(-1, 96), want.reshape(-1, 96), atol + _tolerance(x.reshape(-1, 64).float(), q, scales))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel module state that has not tried to build yet, building into an empty cache dir."""
    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_reason", None)
    return tmp_path


def test_switched_off_uses_torchs_kernel(fresh, monkeypatch):
    monkeypatch.setenv(cpu_kernels.SWITCH_ENV, "0")
    assert cpu_kernels.kernel() is None
    assert cpu_kernels.unavailable_reason() == "switched off (GAPLESS_CPU_KERNELS=0)"
    assert cpu_kernels.describe() == "aten._weight_int8pack_mm (switched off (GAPLESS_CPU_KERNELS=0))"
    torch.manual_seed(2)
    w = torch.randn(64, 32)
    lin = Int8Linear(w, None, torch.float32)
    assert not lin.own_kernel and lin.scales.dtype == torch.bfloat16
    x = torch.randn(3, 32)
    q, scales = quantize_int8(w)
    want = x @ (q.float() * scales.bfloat16().float()[:, None]).T
    torch.testing.assert_close(lin(x), want, atol=0.05, rtol=0.02)


def test_no_compiler_says_so(fresh, monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert cpu_kernels.kernel() is None
    assert cpu_kernels.unavailable_reason() == "no C compiler on PATH (cc, gcc or clang) to build it"


def test_a_compiler_that_fails_says_why(fresh, monkeypatch, tmp_path):
    cc = tmp_path / "broken-cc"
    cc.write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\necho 'fatal: no space' >&2\nexit 1\n"
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert cpu_kernels.kernel() is None
    reason = cpu_kernels.unavailable_reason()
    assert reason.startswith("broken-cc could not build engine/cpu_kernels.c") and "fatal: no space" in reason
    assert not list((fresh / "cpu-kernels").glob("*.so"))  # nothing half-built left behind


@pytest.mark.skipif(KERNEL is None, reason="needs a working C compiler")
def test_the_build_is_cached_and_keyed_by_its_source(fresh, monkeypatch, tmp_path):
    builds = []
    real_build = cpu_kernels._build
    monkeypatch.setattr(cpu_kernels, "_build", lambda *a: builds.append(a[2]) or real_build(*a))

    def load_again():
        monkeypatch.setattr(cpu_kernels, "_tried", False)
        monkeypatch.setattr(cpu_kernels, "_loaded", None)
        return cpu_kernels.kernel()

    built = cpu_kernels.kernel()
    assert built is not None and built.path.parent == fresh / "cpu-kernels" and builds == [built.path]
    again = load_again()
    assert again is not None and again.path == built.path and len(builds) == 1  # not rebuilt
    edited = tmp_path / "cpu_kernels.c"
    edited.write_text(cpu_kernels.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", edited)
    rebuilt = load_again()
    assert rebuilt is not None and rebuilt.path != built.path and builds == [built.path, rebuilt.path]


@pytest.mark.skipif(KERNEL is None, reason="needs a working C compiler")
def test_a_damaged_cached_build_is_built_again(fresh, monkeypatch, tmp_path):
    """A cached library cut short (a full disk, a power cut before its bytes reached the disk, a partial copy of the
    cache) is built again: an empty one had every later start run the next flags' slower loop, a truncated one
    crashed the process as it loaded it."""
    import os
    import subprocess

    built = cpu_kernels.kernel()
    assert built is not None
    good = built.path.read_bytes()

    def cached(name: str, data: bytes):
        """a cache dir whose library for these flags holds `data`, with the digest the build recorded"""
        folder = tmp_path / name / "cpu-kernels"
        folder.mkdir(parents=True)
        (folder / built.path.name).write_bytes(data)
        digest = built.path.with_suffix(".sha256")
        if digest.exists():
            (folder / digest.name).write_bytes(digest.read_bytes())
        return folder.parent

    # a path this process has not loaded (a loaded one is not opened again)
    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(cached("empty", b"")))
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    again = cpu_kernels.kernel()
    assert again is not None and again.flags == built.flags and again.vector == built.vector
    assert again.path.read_bytes() == good
    # loading a truncated library is a SIGBUS, so it is tried in a process of its own
    env = {**os.environ, "GAPLESS_CACHE_DIR": str(cached("cut", good[:1000]))}
    probe = "import engine.cpu_kernels as c; k = c.kernel(); print(k.flags if k else c.unavailable_reason())"
    root = cpu_kernels.SOURCE.parents[1]
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.strip() == str(built.flags)


@pytest.mark.skipif(KERNEL is None, reason="needs a working C compiler")
def test_a_damaged_digest_or_one_that_cannot_be_written_does_not_stop_the_kernels(fresh, monkeypatch):
    """A digest file holding bytes that are not text (damaged as the library can be) ended every CPU load in an
    internal UnicodeDecodeError; a digest whose temporary file could not be made, in an OSError out of the build."""
    import tempfile

    built = cpu_kernels.kernel()
    assert built is not None
    digest = built.path.with_suffix(".sha256")
    digest.write_bytes(b"\xff\xfe\x00 damaged")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    real_mkstemp = tempfile.mkstemp

    def no_room_for_the_digest(*args, suffix=None, **kwargs):
        if suffix == ".sha256":
            raise OSError(28, "No space left on device")
        return real_mkstemp(*args, suffix=suffix, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", no_room_for_the_digest)
    again = cpu_kernels.kernel()  # built again, as the digest does not match
    assert again is not None and again.flags == built.flags
    assert cpu_kernels._intact(again.path) is False  # no digest recorded: built again at the next start


def test_a_cache_that_cannot_be_written_builds_for_this_run_only(fresh, monkeypatch, tmp_path):
    """A read-only cache (or one that cannot be made) still gives the kernels: built in a temporary folder."""
    if cpu_kernels.kernel() is None:
        pytest.skip(f"no CPU kernels on this machine: {cpu_kernels.unavailable_reason()}")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(blocked / "cache"))  # mkdir fails under a file, even for root
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    built = cpu_kernels.kernel()
    assert built is not None and not str(built.path).startswith(str(blocked))
    assert built.path.parent.name.startswith("gapless-cpu-kernels-") and built.path.is_file()


@pytest.mark.skipif(KERNEL is None, reason="needs a working C compiler")
def test_a_cache_folder_that_is_a_file_builds_for_this_run_only(fresh, monkeypatch):
    """A file where the kernels' cache folder should be: the build's temporary file could not be made there, an
    OSError ended the model's load, and every later load ran torch's kernels saying no reason."""
    (fresh / "cpu-kernels").write_text("not a folder")
    (fresh / "cpu-kernels").chmod(0o755)
    built = cpu_kernels.kernel()
    assert built is not None and built.path.parent.name.startswith("gapless-cpu-kernels-")
    assert (fresh / "cpu-kernels").read_text() == "not a folder"


@pytest.mark.skipif(KERNEL is None, reason="needs a working C compiler")
def test_a_cache_on_a_noexec_file_system_builds_where_libraries_load(fresh, monkeypatch):
    """A cache folder on a file system mounted noexec: each flag set was built there and failed to load ("failed
    to map segment"), and the kernels never ran, the reason blaming the build."""
    cache = fresh / "cpu-kernels"
    monkeypatch.setattr(cpu_kernels, "_loads_libraries", lambda folder: folder != cache)
    built = cpu_kernels.kernel()
    assert built is not None and built.path.parent.name.startswith("gapless-cpu-kernels-")
    assert not list(cache.glob("*.so"))
    # and where the temporary folder is noexec too: torch's kernels, saying why
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_loads_libraries", lambda folder: False)
    assert cpu_kernels.kernel() is None
    assert cpu_kernels.unavailable_reason() == (
        f"the cache folder {cache} is on a file system that does not load programs (mounted noexec), and the "
        f"temporary folder {Path(tempfile.gettempdir())} is on a file system mounted noexec: no library built can "
        "be loaded"
    )


def test_a_build_that_fails_unforeseen_says_why_and_torchs_kernels_run(fresh, monkeypatch):
    def broken(cc):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "cc")
    monkeypatch.setattr(cpu_kernels, "_compiler_version", broken)
    assert cpu_kernels.kernel() is None
    assert cpu_kernels.unavailable_reason() == (
        "building them failed: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: "
        "invalid start byte"
    )
    assert cpu_kernels.describe().startswith("aten._weight_int8pack_mm (building them failed: UnicodeDecodeError")


@pytest.mark.skipif(KERNEL is None or KERNEL.vector != "avx2+fma", reason="needs an x86 CPU with AVX2 and a compiler")
def test_the_portable_loop_a_cpu_without_avx2_builds(tmp_path):
    """The same source without AVX2/FMA takes its portable C loop; it must give the same sums in its own order."""
    import ctypes

    path = tmp_path / "portable.so"
    flags = ("-O3", "-mno-avx2", "-mno-fma", "-fopenmp")
    assert cpu_kernels._build(cpu_kernels._compiler(), flags, path) is None
    portable = cpu_kernels.CpuKernels(ctypes.CDLL(str(path)), path, flags)
    assert portable.vector == "portable"
    torch.manual_seed(3)
    q, scales = quantize_int8(torch.randn(130, 200))
    bias, x = torch.randn(130), torch.randn(4, 200)
    got = portable.linear(x, q, scales, bias)
    assert _within(got, _reference(x, q, scales, bias), _tolerance(x, q, scales))
    alone = torch.cat([portable.linear(x[i : i + 1].contiguous(), q, scales, bias) for i in range(4)])
    assert torch.equal(got, alone)
    from int8_bounds import int4_kernel_tolerance

    from engine.quant import dequantize_int4_min, quantize_int4_min

    for k in (96, 128):  # 96: a group past the last whole activation block
        q4, s4, z4 = quantize_int4_min(torch.randn(40, k) * 0.05)
        x4 = torch.randn(3, k)
        got4 = portable.linear4(x4, cpu_kernels.pack_int4(q4), s4, z4, None)
        want4 = x4.double() @ dequantize_int4_min(q4, s4, z4).double().T
        assert _within(got4, want4, int4_kernel_tolerance(x4, q4, s4, z4))
        rows = [portable.linear4(x4[i : i + 1].contiguous(), cpu_kernels.pack_int4(q4), s4, z4, None) for i in range(3)]
        assert torch.equal(got4, torch.cat(rows))
        dequantized = portable.bind(cpu_kernels.pack_int4(q4), s4, None, z4).dequantized()
        assert torch.equal(dequantized, dequantize_int4_min(q4, s4, z4))
    q4, s4, z4 = _int4_with_edge_halves()  # the C conversion of fp16, without F16C
    assert torch.equal(
        portable.bind(cpu_kernels.pack_int4(q4), s4, None, z4).dequantized(), dequantize_int4_min(q4, s4, z4)
    )
    assert torch.equal(portable.bind(q, scales, None).dequantized(), q.float() * scales[:, None])


@needs_kernel
@pytest.mark.parametrize("m,d", [(1, 576), (5, 64), (3, 7), (2, 1536)])
def test_rms_norm_matches_torchs(m, d):
    torch.manual_seed(m * d)
    x, w = torch.randn(m, d) * 3, torch.randn(d)
    got = KERNEL.rms_norm(x, w, 1e-5)
    want = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=2e-6)


@needs_kernel
def test_the_models_rms_norm_takes_the_kernel_only_where_it_can(monkeypatch):
    from engine.model import RMSNorm

    calls = []
    real = KERNEL.rms_norm
    monkeypatch.setattr(KERNEL, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 64)
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), want, atol=1e-6, rtol=1e-6)
    assert calls == [(4, 64)]
    norm(torch.randn(64, 4).t())  # a strided view: torch's ops
    norm.to(torch.bfloat16)(x.bfloat16())  # bf16: torch's ops, with its casts
    assert calls == [(4, 64)]


@needs_kernel
def test_rms_norm_refuses_what_it_cannot_read():
    x = torch.randn(2, 16)
    for args in [(x, torch.randn(8)), (x.bfloat16(), torch.randn(16)), (torch.randn(16, 2).t(), torch.randn(16))]:
        with pytest.raises(ValueError, match="RMSNorm kernel arguments"):
            KERNEL.rms_norm(args[0], args[1], 1e-5)


@needs_kernel
def test_the_kernels_calls_are_named_in_a_profile():
    from torch.profiler import ProfilerActivity, profile

    q, scales = quantize_int8(torch.randn(32, 64))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        KERNEL.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-5)
        KERNEL.linear(torch.randn(1, 64), q, scales, None)
    names = {e.name for e in prof.events()}
    assert {cpu_kernels.OP_NAME, cpu_kernels.NORM_OP_NAME} <= names


@needs_kernel
@pytest.mark.parametrize("b,t,heads,d", [(1, 1, 12, 64), (2, 3, 5, 8), (1, 7, 4, 16)])
def test_rope_is_bit_for_bit_torchs(b, t, heads, d):
    """The same multiplies and add, each rounded (the C is built without FMA contraction): bit for bit."""
    from engine.model import apply_rope_signed, signed_sin

    torch.manual_seed(b * t * heads)
    proj = torch.randn(b * t, heads * d + 24)  # q and k heads, then v's columns: rows strided as after the split
    x = proj[:, : heads * d]
    cos, sin = torch.randn(t, d), signed_sin(torch.randn(t, d))
    got = KERNEL.rope(x, b, t, heads, d, cos, sin)
    want = apply_rope_signed(x.reshape(b, t, heads, d).transpose(1, 2), cos, sin)
    assert got.shape == (b, heads, t, d) and torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("m,inter", [(1, 1536), (5, 48), (3, 7)])
def test_silu_mul_matches_torchs(m, inter):
    torch.manual_seed(m + inter)
    h = torch.randn(m, 2 * inter + 3)[:, : 2 * inter] * 4  # strided rows
    got = KERNEL.silu_mul(h)
    want = torch.nn.functional.silu(h[:, :inter].double()) * h[:, inter:].double()
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


@needs_kernel
def test_rope_and_silu_mul_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="RoPE kernel arguments"):
        KERNEL.rope(torch.randn(3, 16), 1, 3, 2, 8, torch.randn(2, 8), torch.randn(2, 8))  # tables for 2 positions
    with pytest.raises(ValueError, match="RoPE kernel arguments"):
        KERNEL.rope(torch.randn(16, 3).t(), 1, 3, 2, 8, torch.randn(3, 8), torch.randn(3, 8))  # strided columns
    with pytest.raises(ValueError, match="SiLU-mul kernel arguments"):
        KERNEL.silu_mul(torch.randn(2, 8).bfloat16())


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_a_model_step_with_and_without_the_kernels(tiny_factory, family, monkeypatch):
    """The eager step with the own kernels against torch's ops: logits within fp32 rounding for each family (the
    layers op by op: the layer kernel would take the whole step)."""
    from engine.loader import load_checkpoint
    from engine.model import StaticKVCache, build_transformer

    monkeypatch.setenv(cpu_kernels.LAYER_SWITCH_ENV, "0")

    cpu = torch.device("cpu")
    ck = load_checkpoint(str(tiny_factory(family)))
    model = build_transformer(ck.config, ck.weights(torch.float32, cpu), torch.float32, cpu)
    ids = torch.randint(0, model.args.vocab_size, (1, 9))

    def run():
        cache = StaticKVCache.allocate(model.args, 1, 16, torch.float32, cpu)
        with torch.inference_mode():
            cache.attn_len = 8
            first = model(ids[:, :8], torch.arange(8), cache, None)
            cache.attn_len = 9
            return first, model(ids[:, 8:], torch.tensor([8]), cache, None)

    used = set()
    for name in ("rms_norm", "rope", "silu_mul"):
        real = getattr(KERNEL, name)
        monkeypatch.setattr(KERNEL, name, lambda *a, _n=name, _f=real: used.add(_n) or _f(*a))
    with_kernels = run()
    # Qwen3's and Gemma's q/k norms take their own rope path; Gemma's norms and GELU are its own
    expected = {"qwen3": {"rms_norm", "silu_mul"}, "gemma3_text": set()}.get(family, {"rms_norm", "rope", "silu_mul"})
    assert used == expected
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: None)
    without = run()
    for a, b in zip(with_kernels, without):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_cpu_load_prepares_the_kernels_before_the_first_answer(fresh, tiny_factory):
    from engine.engine import Engine
    from engine.types import EngineOptions

    messages = []
    e = Engine.load(
        str(tiny_factory("llama")),
        EngineOptions(device="cpu", dtype="fp32", profile_window=False),
        progress=lambda p: messages.append(p.message),
    )
    try:
        assert "preparing the CPU kernels" in messages and cpu_kernels.tried()
        assert (cpu_kernels.kernel() is None) == (cpu_kernels.unavailable_reason() is not None)
    finally:
        e.close()


def _int8_model(tiny_factory, family, fmt="int8", **config):
    """A tiny model's fp32 decoder with its linears in `fmt` (int8, int4, or fp32 as they are)."""
    from engine.loader import load_checkpoint
    from engine.model import build_transformer
    from engine.quant import quantize_linears

    cpu = torch.device("cpu")
    ck = load_checkpoint(str(tiny_factory(family, **config)))
    model = build_transformer(ck.config, ck.weights(torch.float32, cpu), torch.float32, cpu)
    if fmt != "fp32":
        quantize_linears(model, fmt, torch.float32)
    return model


def _prefill_step_verify(model, ids):
    """A prefill of 8, one decode step and a masked verify of 3 on a static cache: logits and the caches."""
    from engine.model import StaticKVCache

    cache = StaticKVCache.allocate(model.args, 1, 24, torch.float32, torch.device("cpu"))
    out = []
    with torch.inference_mode():
        cache.attn_len = 8
        out.append(model(ids[:, :8], torch.arange(8), cache, None))
        cache.attn_len = 9
        out.append(model(ids[:, 8:9], torch.tensor([8]), cache, None))
        pos = torch.arange(9, 12)
        cache.attn_len = 12
        mask = torch.arange(12)[None, :] <= pos[:, None]
        out.append(model(ids[:, 9:12], pos, cache, mask, last_only=False))
    return out, cache


@needs_kernel
@pytest.mark.parametrize(
    "family",
    [
        "llama", "qwen2", "qwen3", "gemma3_text", "llama-odd", "qwen2-int4", "llama-odd-int4", "gemma3_text-int4",
        "llama-fp32", "qwen2-fp32", "gemma3_text-fp32", "llama-odd-fp32",
    ],
)  # fmt: skip
def test_the_whole_layer_kernel_against_the_modules(tiny_factory, family, monkeypatch):
    """Int8, int4 or fp32 layers run as one call each; the logits agree with the layer's ops run one by one within
    fp32 rounding, and the first layer's cache (before any attention) is written bit for bit alike where no q/k
    norm stands before it. Qwen3: q/k norms. Gemma-3: q/k norms, norms scaling by 1 + weight, post norms, tanh
    GELU, two sliding-window layers of 8 positions (with their own rope base) that the 12 positions run past, and
    a global layer. "llama-odd": the heads wider than the model (q size 128 against 64) and an MLP of 96, so no
    width is the one the scratch rows were sized by and the down projection's inputs end in a part block."""
    odd = family.startswith("llama-odd")
    fmt = family.rsplit("-", 1)[1] if family.endswith(("-int4", "-fp32")) else "int8"
    if odd:
        model = _int8_model(tiny_factory, "llama", fmt, head_dim=32, intermediate_size=96)
    elif family.startswith("gemma3_text"):  # a local rope base of its own, as Gemma-3 has
        model = _int8_model(tiny_factory, "gemma3_text", fmt, rope_local_base_freq=100.0)
    else:  # int4 or fp32 linears (Qwen2 with its q/k/v biases) in the same layer kernel
        model = _int8_model(tiny_factory, family.removesuffix(f"-{fmt}"), fmt)
    if family.startswith("gemma3_text"):
        assert model.args.sliding_layers == (True, True, False) and model.args.sliding_window == 8
        assert model.rope_cos_local is not None and not torch.equal(model.rope_cos_local, model.rope_cos)
    if odd:
        assert model.args.n_heads * model.args.head_dim > model.args.dim > model.args.intermediate_size % 64
    ids = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    calls = []
    real = cpu_kernels.run_layers

    def counted(layers, x, b, t, *a):
        calls.extend([t] * len(layers))
        return real(layers, x, b, t, *a)

    monkeypatch.setattr(cpu_kernels, "run_layers", counted)
    fused, fused_cache = _prefill_step_verify(model, ids)
    layers = model.args.n_layers
    assert calls == [8] * layers + [1] * layers + [3] * layers
    monkeypatch.setenv(cpu_kernels.LAYER_SWITCH_ENV, "0")
    ops, ops_cache = _prefill_step_verify(model, ids)
    assert len(calls) == 3 * layers
    # the attention's sums are ordered differently (last-bit differences), and the next int8 linear's int16
    # rounding of its input (2^-16 of a block's largest) can carry one such difference a step further
    for a, b in zip(fused, ops):
        torch.testing.assert_close(a, b, atol=5e-4, rtol=1e-3)
    # op by op, a plain RMSNorm and an int8/int4 GEMV are the same C loops; Gemma's norms, the q/k norms (on strided
    # heads) and an fp32 linear are torch's ops, whose sums are ordered differently
    same = not model.args.gemma and fmt != "fp32"
    if same:
        assert torch.equal(fused_cache.v[0], ops_cache.v[0])
    if same and model.layers[0].attention.q_norm is None:
        assert torch.equal(fused_cache.k[0], ops_cache.k[0])
    for got, want in ((fused_cache.k[0], ops_cache.k[0]), (fused_cache.v[0], ops_cache.v[0])):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Gemma scales the embedding by sqrt(dim) (8 here): the stream's values, and their rounding differences, with it
    scale = model.args.dim**0.5 if model.args.gemma else 1.0
    torch.testing.assert_close(fused_cache.k[-1], ops_cache.k[-1], atol=5e-4 * scale, rtol=1e-3)


@needs_kernel
def test_the_layer_kernel_refuses_what_it_cannot_read(tiny_factory):
    from engine.model import StaticKVCache

    model = _int8_model(tiny_factory, "llama")
    layer = model.layers[0].cpu_layer(KERNEL)
    assert layer is not None
    args = model.args
    cache = StaticKVCache.allocate(args, 1, 8, torch.float32, torch.device("cpu"))
    x = torch.randn(1, args.dim)
    cos, sin = torch.ones(1, args.head_dim), torch.zeros(1, args.head_dim)
    k, v = cache.k[0], cache.v[0]
    with pytest.raises(ValueError, match="outside the 8-position cache"):
        cpu_kernels.run_layers([layer], x, 1, 1, torch.tensor([8]), 8, cos, sin, [k], [v])
    with pytest.raises(ValueError, match="outside the 8-position cache"):
        cpu_kernels.run_layers([layer], x, 1, 1, torch.tensor([-1]), 8, cos, sin, [k], [v])
    bad = {
        "bf16 activations": (x.bfloat16(), 1, 1, torch.tensor([0]), 1, cos, sin, k, v),
        "int32 positions": (x, 1, 1, torch.tensor([0], dtype=torch.int32), 1, cos, sin, k, v),
        "attn_len past the cache": (x, 1, 1, torch.tensor([0]), 9, cos, sin, k, v),
        "two rows for one": (torch.randn(2, args.dim), 1, 1, torch.tensor([0]), 1, cos, sin, k, v),
        "a cache of the wrong batch": (x, 1, 1, torch.tensor([0]), 1, cos, sin, k.expand(2, -1, -1, -1), v),
    }
    for what, a in bad.items():
        with pytest.raises(ValueError, match="decoder layer kernel arguments"):
            cpu_kernels.run_layers([layer], *a[:-2], [a[-2]], [a[-1]])
            pytest.fail(f"{what} was accepted")
    assert torch.equal(cache.k[0], torch.zeros_like(cache.k[0]))  # nothing was written


@needs_kernel
def test_a_layer_the_kernel_does_not_cover_runs_as_modules(tiny_factory):
    """Mixtures the kernel has no setting for: a GELU MLP under Llama's norms, a Gemma norm among plain ones, a q
    norm without a k norm, norms of different eps. Each binds nothing, and the layer runs as modules."""
    from engine.model import GemmaRMSNorm, RMSNorm

    model = _int8_model(tiny_factory, "llama")
    block, args = model.layers[0], model.args
    assert block.cpu_layer(KERNEL) is not None
    changes = [
        (block.feed_forward, "gelu", True),
        (block, "ffn_norm", GemmaRMSNorm(args.dim, args.norm_eps)),
        (block.attention, "q_norm", RMSNorm(args.head_dim, args.norm_eps)),
        (block, "ffn_norm", RMSNorm(args.dim, args.norm_eps * 2)),
    ]
    for owner, name, value in changes:
        before = getattr(owner, name)
        setattr(owner, name, value)
        assert block.cpu_layer(KERNEL) is None, name
        with torch.inference_mode():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), torch.arange(3))).all()
        if before is None:
            del owner._modules[name]
        setattr(owner, name, before)
        assert block.cpu_layer(KERNEL) is not None, name


@needs_kernel
def test_the_description_says_whether_layers_run_as_one_call(monkeypatch):
    """The model panel and the bench JSON name the path: the layer kernel, or the layers op by op when it is off."""
    assert cpu_kernels.describe().endswith("each decoder layer as one call in eager fp32 steps on a static cache")
    monkeypatch.setenv(cpu_kernels.LAYER_SWITCH_ENV, "0")
    assert cpu_kernels.describe() == f"{KERNEL.description}; layers op by op (GAPLESS_CPU_LAYER=0)"


@needs_kernel
def test_a_layers_binding_is_kept_until_what_it_read_changes(tiny_factory):
    """A step reuses a layer's binding without its checks; a replaced linear, a weight given new storage, a changed
    setting or a module added where there was none binds again (or finds the kernel does not cover it)."""
    from engine.model import RMSNorm
    from engine.quant import Int8Linear

    model = _int8_model(tiny_factory, "llama")
    block = model.layers[0]
    first = block.cpu_layer(KERNEL)
    assert first is not None and block.cpu_layer(KERNEL) is first
    att = block.attention
    att.wqkv = Int8Linear(torch.randn(att.wqkv.out_features, att.wqkv.in_features), None, torch.float32)
    second = block.cpu_layer(KERNEL)
    assert second is not None and second is not first and second.linears[0].weight is att.wqkv.weight
    att.wo.weight.data = att.wo.weight.data.clone()  # the same buffer on new storage
    third = block.cpu_layer(KERNEL)
    assert third is not second and third is not None and third.linears[1]._args[0] == att.wo.weight.data_ptr()
    assert block.cpu_layer(KERNEL) is third
    block.post_ffn_norm = RMSNorm(model.args.dim, 1e-6)  # one post norm without the other: not in the kernel
    assert block.cpu_layer(KERNEL) is None
    del block._modules["post_ffn_norm"]
    block.post_ffn_norm = None
    assert block.cpu_layer(KERNEL) is not None
    att.scale = 0.5
    assert block.cpu_layer(KERNEL).scale == 0.5
    att.wo.bias = torch.full((att.wo.out_features,), 0.25)  # where there was none: a plain attribute
    assert block.cpu_layer(KERNEL).linears[1].bias is att.wo.bias
    block.ffn_norm.weight = torch.nn.Parameter(torch.ones(2 * model.args.dim)[::2])  # strided: C cannot read it
    assert block.cpu_layer(KERNEL) is None
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        logits = model(ids, torch.arange(3))  # the modules run the layer; nothing raised
    assert torch.isfinite(logits).all()


@needs_kernel
def test_layers_run_as_one_call_only_for_a_steps_few_rows(tiny_factory, monkeypatch):
    """Layers take the layer kernel for decode, candidate and verify steps (up to GEMM_ROWS rows); a longer prefill
    chunk, a GEMM that torch's kernels run faster, runs the modules, whatever the weights' format."""
    from engine.model import StaticKVCache

    calls: list[int] = []
    real = cpu_kernels.run_layers
    monkeypatch.setattr(
        cpu_kernels, "run_layers", lambda layers, x, *a: calls.append(x.shape[0]) or real(layers, x, *a)
    )
    rows = cpu_kernels.GEMM_ROWS
    for fmt in ("fp32", "int8", "int4"):
        model = _int8_model(tiny_factory, "llama", fmt)
        cache = StaticKVCache.allocate(model.args, 1, 64, torch.float32, torch.device("cpu"))
        ids = torch.randint(0, model.args.vocab_size, (1, rows + 2))
        with torch.inference_mode():
            cache.attn_len = rows + 1
            model(ids[:, : rows + 1], torch.arange(rows + 1), cache, None)
            cache.attn_len = rows + 2
            model(ids[:, rows + 1 :], torch.tensor([rows + 1]), cache, None)
        assert calls == [1], fmt
        calls.clear()
