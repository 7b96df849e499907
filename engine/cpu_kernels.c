/* The engine's own CPU kernels, for the eager decode step where torch's are slow for its shapes.
 *
 * gapless_int8_linear: weight-only int8 linear, y[i, r] = scale[r] * sum_k w[r, k] * x[i, k] (+ bias[r]).
 * The weights are read as int8, one scale per output row. Each activation row is first rounded to int16 in blocks
 * of QBLOCK inputs, one fp32 scale per block (the block's largest magnitude maps to 32767, so a value moves by at
 * most 2^-16 of its block's largest), and a block's products are summed exactly in int32 (vpmaddwd), the blocks
 * then in fp32. Against widening every weight to fp32 this is a third of the instructions per weight, which is
 * what bound the loop (it streamed at about half the rate plain loads reach). A decode step (one activation row)
 * is a GEMV that streams the weights once: one weight row at a time, a software prefetch PREFETCH_BYTES ahead in
 * the weight stream (the rows are contiguous, so it runs on into the next rows). With several activation rows
 * (candidates, a speculative verify, a prefill chunk) each activation row is summed by the same loop while the
 * weight row stays in cache, so a row's result does not depend on how many rows run. An inf or NaN in a block
 * makes the sums it enters NaN, as in fp32.
 *
 * gapless_int4_linear: the same for group-wise int4 weights (32 inputs a group, w = q * scale + min with q in
 * 0..15 and the scale and the minimum in fp16: GGUF's Q4_1 layout, 5 bits a weight), the nibbles widened to int16
 * and summed with the same int16 activations.
 *
 * gapless_f32_linear: the fp32 linear the same way (torch's M=1 fp32 GEMV streamed at about 10 GB/s here).
 * gapless_int8_dequant, gapless_int4_dequant: rows of those weights in fp32, for a prefill chunk's GEMM.
 *
 * gapless_rms_norm: y[i, :] = w * (x[i, :] / sqrt(mean(x[i, :]^2) + eps)) in fp32, one call where torch dispatches
 * six ops (pow, mean, add, rsqrt, mul, mul), each with its own fixed cost, sixty-one times a token.
 * gapless_silu_mul: the gated MLP's silu(gate) * up from the fused gate/up projection's rows, one call for three.
 * gapless_rope: rotary embedding of the fused projection's q and k heads straight into [B, H, T, D], one call for
 * the view, transpose, roll, two multiplies and the add, with the same roundings (no contraction into FMAs).
 * gapless_decoder_layer: a whole decoder layer (Llama's shape, with Qwen3's q/k norms and Gemma-3's norms, GELU and
 * sliding windows where a layer has them) with int8, int4 or fp32 weights over a static KV cache, one call (these
 * kernels, the cache writes and the attention) where the eager step made about thirty.
 *
 * Built on first use with the machine's C compiler (-O3 -march=native -fopenmp) and loaded with ctypes; the
 * OpenMP runtime is the one torch has loaded (same soname), so the threads are torch's. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GAPLESS_VECTOR "avx2+fma"
#else
#define GAPLESS_VECTOR "portable"
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#define QBLOCK 64      /* activations share one int16 scale per block of this many inputs */
#define QMAX 32767.0f

const char *gapless_int8_vector(void) { return GAPLESS_VECTOR; }

/* An IEEE half (the int4 layout's scales and minimums) in fp32, exactly: normal, subnormal, zero, inf, NaN. */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in fp32 */
        const float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 0x1Fu ? 0x7F800000u : (exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n halves in fp32 (eight at a time with F16C where the CPU has it) */
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

/* A row of the int4 layout's fp16 scales and minimums as fp32 scales s and zeros z = min + 8 * scale (the value
 * q = 8 stands for; 8 * scale is exact, so the add is the one rounding, FMA or not). */
static inline void row_scales_zeros(const uint16_t *scale, const uint16_t *mins, float *s, float *z, int64_t ng)
{
    halves_to_floats(scale, s, ng);
    halves_to_floats(mins, z, ng);
    for (int64_t g = 0; g < ng; g++) z[g] += 8.0f * s[g];
}

/* one half in fp32: F16C's conversion where the CPU has it, else the C one (the same value) */
static inline float h2f(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
}

/* Where a block holds an inf or a NaN its scale is NaN, so the sums it enters are NaN as in fp32. */
static inline float block_scale(float largest, float poison) { return poison == 0.0f ? largest / QMAX : NAN; }

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x[0 .. nb * QBLOCK) -> q (int16, rounded to nearest even) and one scale per block, d[b] = max |x| / 32767 */
static void quantize_row(const float *x, int64_t nb, int16_t *q, float *d)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QBLOCK;
        __m256 m = zero, poison = zero;
        for (int j = 0; j < QBLOCK; j += 8) {
            __m256 v = _mm256_loadu_ps(xb + j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
            poison = _mm256_add_ps(poison, _mm256_mul_ps(v, zero)); /* 0 unless an inf or a NaN */
        }
        float largest = hmax(m);
        d[b] = block_scale(largest, hsum(poison));
        __m256 inv = _mm256_set1_ps(largest > 1e-30f && d[b] == d[b] ? QMAX / largest : 0.0f);
        for (int j = 0; j < QBLOCK; j += 16) {
            __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), inv));
            __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), inv));
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256((__m256i *)(q + b * QBLOCK + j), packed);
        }
    }
}

/* 32 int8 weights times 32 int16 activations, as eight int32 lane sums (exact) */
static inline __m256i madd32(const int8_t *w, const int16_t *q)
{
    __m256i wb = _mm256_loadu_si256((const __m256i *)w);
    __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wb));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wb, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)q)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(q + 16))));
}

/* sum over the blocks of (exact integer block sum) * d[b], in fp32 */
static inline float dot_q16(const int8_t *w, const int16_t *q, const float *d, int64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = w + b * QBLOCK;
        _mm_prefetch((const char *)(wb + PREFETCH_BYTES), _MM_HINT_T0);
        __m256i s = _mm256_add_epi32(madd32(wb, q + b * QBLOCK), madd32(wb + 32, q + b * QBLOCK + 32));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d[b]), acc);
    }
    return hsum(acc);
}

/* one group's 16 bytes widened to 16-bit lanes (lane j holds byte j): its low nibble is input j, its high one
 * input 16 + j, so a mask and a shift give both halves in order, times the group's 32 int16 activations */
static inline __m256i madd_q4(const uint8_t *w, const int16_t *q)
{
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));
    __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(v, 4);
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)q)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 16))));
}

/* eight int32 vectors -> one vector of their eight lane sums, in order (integer adds: exact) */
static inline __m256i hsum8_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4, __m256i v5, __m256i v6,
                                  __m256i v7)
{
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
    /* ab holds v0..v3's sums of lanes 0..3 in its low half and of lanes 4..7 in its high half; cd v4..v7's */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

static inline int32_t hsum_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* eight halves in fp32 */
static inline __m256 load8h(const uint16_t *h)
{
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = half_to_float(h[i]);
    return _mm256_loadu_ps(f);
#endif
}

/* One int4 weight row against one activation row, over the groups of the whole activation blocks (`whole`), and
 * the zero terms of all `ng` groups. Each group's inputs 0..15 lie in the low nibbles of its 16 bytes and 16..31 in
 * the high ones; a group's products with its 32 int16 activations are summed exactly in int32 lanes, eight
 * groups' lane sums gathered into one vector by integer horizontal adds (exact), less 8 times the group's sum of
 * the int16 activations iq (the -8, exact too), then scaled in fp32 lanes by each group's activation scale dg and
 * its weight scale, converted from fp16 eight at a time; the zeros (min + 8 * scale) times the groups' fp32
 * activation sums xs join the same lanes, so eight groups cost one multiply-add chain and the row ends in one
 * horizontal sum (its rows are short: with the default model's 576 inputs, eighteen groups); then the groups past
 * a multiple of eight one by one. */
static inline float dot_q4(const uint8_t *w, const int16_t *q, const float *dg, const int32_t *iq, const float *xs,
                           const uint16_t *sh, const uint16_t *mh, int64_t whole, int64_t ng)
{
    __m256 acc = _mm256_setzero_ps();
    const __m256 eight = _mm256_set1_ps(8.0f);
    int64_t g = 0;
    for (; g + 8 <= whole; g += 8) {
        const uint8_t *wg = w + g * 16;
        const int16_t *qg = q + g * 32;
        _mm_prefetch((const char *)(wg + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(wg + 64 + PREFETCH_BYTES), _MM_HINT_T0);
        __m256i s = hsum8_epi32(madd_q4(wg, qg), madd_q4(wg + 16, qg + 32), madd_q4(wg + 32, qg + 64),
                                madd_q4(wg + 48, qg + 96), madd_q4(wg + 64, qg + 128), madd_q4(wg + 80, qg + 160),
                                madd_q4(wg + 96, qg + 192), madd_q4(wg + 112, qg + 224));
        s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(iq + g)), 3));
        const __m256 sc = load8h(sh + g);
        const __m256 z = _mm256_fmadd_ps(eight, sc, load8h(mh + g)); /* 8 * scale exact: one rounding */
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_loadu_ps(dg + g)), sc, acc);
        acc = _mm256_fmadd_ps(z, _mm256_loadu_ps(xs + g), acc);
    }
    float v = hsum(acc);
    for (; g < whole; g++) {
        const float sc = h2f(sh[g]), z = h2f(mh[g]) + 8.0f * sc;
        const int32_t s = hsum_epi32(madd_q4(w + g * 16, q + g * 32)) - 8 * iq[g];
        v += (float)s * dg[g] * sc + z * xs[g];
    }
    for (; g < ng; g++) v += (h2f(mh[g]) + 8.0f * h2f(sh[g])) * xs[g];
    return v;
}
#else
/* Portable C of the same arithmetic: the same quantisation, exact integer block sums, blocks summed in fp32. */
static void quantize_row(const float *x, int64_t nb, int16_t *q, float *d)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QBLOCK;
        float largest = 0.0f, poison = 0.0f;
        for (int j = 0; j < QBLOCK; j++) {
            float a = fabsf(xb[j]);
            largest = a > largest ? a : largest;
            poison += xb[j] * 0.0f;
        }
        d[b] = block_scale(largest, poison);
        float inv = largest > 1e-30f && d[b] == d[b] ? QMAX / largest : 0.0f;
        for (int j = 0; j < QBLOCK; j++) q[b * QBLOCK + j] = (int16_t)lrintf(xb[j] * inv);
    }
}

static inline float dot_q16(const int8_t *w, const int16_t *q, const float *d, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < QBLOCK; j++) s += (int32_t)w[b * QBLOCK + j] * q[b * QBLOCK + j];
        acc += (float)s * d[b];
    }
    return acc;
}

static inline float dot_q4(const uint8_t *w, const int16_t *q, const float *dg, const int32_t *iq, const float *xs,
                           const uint16_t *sh, const uint16_t *mh, int64_t whole, int64_t ng)
{
    float acc = 0.0f;
    int64_t g = 0;
    for (; g < whole; g++) {
        int32_t sum = 0;
        for (int j = 0; j < 16; j++)
            sum += (int32_t)(w[g * 16 + j] & 0x0F) * q[g * 32 + j] + (int32_t)(w[g * 16 + j] >> 4) * q[g * 32 + 16 + j];
        const float sc = h2f(sh[g]), z = h2f(mh[g]) + 8.0f * sc;
        acc += (float)(sum - 8 * iq[g]) * dg[g] * sc + z * xs[g];
    }
    for (; g < ng; g++) acc += (h2f(mh[g]) + 8.0f * h2f(sh[g])) * xs[g];
    return acc;
}
#endif

/* the inputs past the last whole block in fp32, then the row's scale and bias */
static inline float finish(float s, const int8_t *w, const float *x, int64_t k, float scale, const float *bias,
                           int64_t r)
{
    for (int64_t j = k - k % QBLOCK; j < k; j++) s += (float)w[j] * x[j];
    s *= scale;
    return bias ? s + bias[r] : s;
}

/* Returns 0, or -1 when the quantised activations' buffer could not be allocated. */
int gapless_int8_linear(const float *x, int64_t m, const int8_t *w, const float *scale, const float *bias, float *y,
                        int64_t n, int64_t k, int threads)
{
    int64_t nb = k / QBLOCK;
    int16_t *q = (int16_t *)malloc((size_t)(m * nb * QBLOCK) * sizeof(int16_t) + 1);
    float *d = (float *)malloc((size_t)(m * nb) * sizeof(float) + 1);
    if (!q || !d) {
        free(q);
        free(d);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) quantize_row(x + i * k, nb, q + i * nb * QBLOCK, d + i * nb);
    if (m == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < n; r++) y[r] = finish(dot_q16(w + r * k, q, d, nb), w + r * k, x, k, scale[r], bias, r);
    } else {
        /* the same per-row sum as above for each activation row, the weight row staying in cache across them */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const int8_t *wr = w + r * k;
            for (int64_t i = 0; i < m; i++)
                y[i * n + r] = finish(dot_q16(wr, q + i * nb * QBLOCK, d + i * nb, nb), wr, x + i * k, k, scale[r],
                                      bias, r);
        }
    }
    free(q);
    free(d);
    return 0;
}

/* sum_j a[j] * b[j] in eight independent lanes (which the compiler vectorises) */
static inline float dot8(const float *a, const float *b, int64_t d)
{
    float acc[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[j + l] * b[j + l];
    float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; j < d; j++) s += a[j] * b[j];
    return s;
}

/* sum_j w[j] * x[j] in fp32: four vectors of eight lanes with FMAs where the CPU has them, a prefetch ahead in the
 * weight stream as in the int8 GEMV */
static inline float dot_f32(const float *w, const float *x, int64_t k)
{
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        _mm_prefetch((const char *)(w + j) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + j + 16) + PREFETCH_BYTES, _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 16), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 24), _mm256_loadu_ps(x + j + 24), a3);
    }
    for (; j + 8 <= k; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; j < k; j++) s += w[j] * x[j];
    return s;
#else
    return dot8(w, x, k);
#endif
}

/* fp32 linear, y[i, r] = sum_k w[r, k] * x[i, k] (+ bias[r]): the weights streamed once, each activation row summed
 * alone against a weight row while it is in cache, so a row's result does not depend on how many rows run. */
int gapless_f32_linear(const float *x, int64_t m, const float *w, const float *bias, float *y, int64_t n, int64_t k,
                       int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < m; i++) {
            float v = dot_f32(w + r * k, x + i * k, k);
            y[i * n + r] = bias ? v + bias[r] : v;
        }
    return 0;
}

/* Weight-only int4 linear, group-wise: w[r, k'] = q * scale[r, g] + min[r, g] for the group g = k' / 32, q in
 * 0..15 stored two to a byte (a group's 16 bytes hold its inputs 0..15 in the low nibbles and 16..31 in the high
 * ones), the scales and minimums fp16 (GGUF's Q4_1 form: its d and m are these). Summed as (q - 8) * scale +
 * zero with zero = min + 8 * scale in fp32 (exact unless their magnitudes are over 2^13 apart, and then the
 * weight's one rounding): y[i, r] = sum_g scale[r, g] * sum_j (q - 8) x[i, j] + zero[r, g] * sum_j x[i, j]
 * (+ bias[r]), so the rounded activations meet the centred q - 8 rather than q (summing q * scale + min put the
 * layer kernel 2-3 times further from the exact product).
 * The activations are rounded to int16 as for the int8 linear (a group lies inside one block of 64) and a group's
 * products q * xq summed exactly in int32; the -8 and the zero use each group's sums of the rounded and of the
 * fp32 activations. A group past the last whole block is summed in fp32. k must be a multiple of 32. Each row is
 * summed alone, so its result does not depend on how many rows run. */
int gapless_int4_linear(const float *x, int64_t m, const uint8_t *w, const uint16_t *scale, const uint16_t *mins,
                        const float *bias, float *y, int64_t n, int64_t k, int threads)
{
    int64_t nb = k / QBLOCK, ng = k / 32, whole = nb * 2;
    int16_t *q = (int16_t *)malloc((size_t)(m * nb * QBLOCK) * sizeof(int16_t) + 1);
    float *d = (float *)malloc((size_t)(m * nb) * sizeof(float) + 1);
    float *dg = (float *)malloc((size_t)(m * ng) * sizeof(float) + 1);       /* a group's activation scale */
    int32_t *iq = (int32_t *)malloc((size_t)(m * ng) * sizeof(int32_t) + 1); /* a group's sum of int16 xq */
    float *xs = (float *)malloc((size_t)(m * ng) * sizeof(float) + 1);       /* a group's sum of x (times its zero) */
    if (!q || !d || !dg || !iq || !xs) {
        free(q);
        free(d);
        free(dg);
        free(iq);
        free(xs);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * k;
        int16_t *qi = q + i * nb * QBLOCK;
        quantize_row(xi, nb, qi, d + i * nb);
        for (int64_t g = 0; g < ng; g++) {
            int32_t s = 0;
            float fx = 0.0f;
            for (int j = 0; j < 32; j++) {
                if (g < whole)
                    s += qi[g * 32 + j];
                fx += xi[g * 32 + j];
            }
            iq[i * ng + g] = s;
            dg[i * ng + g] = g < whole ? d[i * nb + g / 2] : 0.0f;
            xs[i * ng + g] = fx;
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *wr = w + r * (k / 2);
        const uint16_t *sr = scale + r * ng, *mr = mins + r * ng;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            const int64_t at = i * ng;
            float v = dot_q4(wr, q + i * nb * QBLOCK, dg + at, iq + at, xs + at, sr, mr, whole, ng);
            for (int64_t g = whole; g < ng; g++) { /* the part block: de-quantised, in fp32 */
                const float sc = h2f(sr[g]);
                for (int j = 0; j < 16; j++) {
                    const uint8_t b = wr[g * 16 + j];
                    v += ((float)(b & 0x0F) - 8.0f) * sc * xi[g * 32 + j] +
                         ((float)(b >> 4) - 8.0f) * sc * xi[g * 32 + 16 + j];
                }
            }
            y[i * n + r] = bias ? v + bias[r] : v;
        }
    }
    free(q);
    free(d);
    free(dg);
    free(iq);
    free(xs);
    return 0;
}

/* Rows of a quantised linear de-quantised to fp32, out[r, :] = w[r, :] * scale[r] (int8) or, in the int4 layout,
 * (q - 8) * scale[r, g] + zero[r, g] over each group g of 32 inputs, zero = min + 8 * scale (the value the own
 * GEMVs multiply): a prefill chunk of many rows is a GEMM, which the caller runs with torch's fp32 GEMM on these
 * rows. */
void gapless_int8_dequant(const int8_t *w, const float *scale, float *out, int64_t n, int64_t k, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const int8_t *wr = w + r * k;
        float *o = out + r * k;
        const float s = scale[r];
        for (int64_t j = 0; j < k; j++) o[j] = (float)wr[j] * s;
    }
}

void gapless_int4_dequant(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, float *out, int64_t n,
                          int64_t k, int threads)
{
    const int64_t ng = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *wr = w + r * (k / 2);
        float *o = out + r * k;
        float sr[ng], zr[ng];
        row_scales_zeros(scale + r * ng, mins + r * ng, sr, zr, ng);
        for (int64_t g = 0; g < ng; g++) {
            const float s = sr[g], z = zr[g];
            const uint8_t *b = wr + g * 16;
            float *og = o + g * 32;
#if defined(__AVX2__) && defined(__FMA__)
            /* the same roundings as below: a subtract, a multiply and an add, no FMA */
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z), eight = _mm256_set1_ps(8.0f);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)b), mask = _mm_set1_epi8(0x0F);
            const __m128i halves[2] = {_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
            for (int h = 0; h < 2; h++) {
                const __m128i eights[2] = {halves[h], _mm_srli_si128(halves[h], 8)}; /* bytes 0..7, 8..15 */
                for (int e = 0; e < 2; e++) {
                    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[e]));
                    _mm256_storeu_ps(og + 16 * h + 8 * e,
                                     _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, eight), vs), vz));
                }
            }
#else
            for (int j = 0; j < 16; j++) { /* separate statements: no compiler may contract them into an FMA */
                const float lo = ((float)(b[j] & 0x0F) - 8.0f) * s, hi = ((float)(b[j] >> 4) - 8.0f) * s;
                og[j] = lo + z;
                og[16 + j] = hi + z;
            }
#endif
        }
    }
}

/* y[i, :] = (w + offset) * (x[i, :] * r), r = 1 / sqrt(mean(x[i, :]^2) + eps); y may be x. offset is 0, or 1 for
 * Gemma's norms, whose weight is stored as an offset from 1 (w + 0 is w, so the plain norm's roundings stay). */
static void rms_norm_rows(const float *x, const float *w, float offset, float *y, int64_t m, int64_t d, float eps)
{
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * d;
        float *yi = y + i * d;
        float r = 1.0f / sqrtf(dot8(xi, xi, d) / (float)d + eps);
        for (int64_t j = 0; j < d; j++) yi[j] = (w[j] + offset) * (xi[j] * r);
    }
}

void gapless_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t d, float eps)
{
    rms_norm_rows(x, w, 0.0f, y, m, d, eps);
}

void gapless_silu_mul(const float *x, int64_t ldx, float *y, int64_t m, int64_t inter)
{
    for (int64_t i = 0; i < m; i++) {
        const float *g = x + i * ldx, *u = g + inter;
        float *yi = y + i * inter;
        for (int64_t j = 0; j < inter; j++) yi[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* gelu(gate) * up with the tanh approximation (Gemma's gelu_pytorch_tanh), as gapless_silu_mul lays out its rows */
static void gelu_tanh_mul(const float *x, int64_t ldx, float *y, int64_t m, int64_t inter)
{
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < m; i++) {
        const float *g = x + i * ldx, *u = g + inter;
        float *yi = y + i * inter;
        for (int64_t j = 0; j < inter; j++) {
            float a = g[j];
            yi[j] = 0.5f * a * (1.0f + tanhf(beta * (a + kappa * a * a * a))) * u[j];
        }
    }
}

/* one head of D: out = src * cos + roll(src, D / 2) * sin_signed, without contraction into FMAs (torch's roundings) */
static inline void rope_head(const float *src, const float *c, const float *s, float *o, int64_t d)
{
    int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        float a = src[j] * c[j];
        float r = src[j + half] * s[j];
        o[j] = a + r;
    }
    for (int64_t j = half; j < d; j++) {
        float a = src[j] * c[j];
        float r = src[j - half] * s[j];
        o[j] = a + r;
    }
}

/* x: rows b * T + t of the projection (row stride ldx), head h at columns h * D .. h * D + D; cos and sin_signed:
 * [T, D] (sin with its first half negated); out: [B, H, T, D]. out = x * cos + roll(x, D / 2) * sin_signed. */
void gapless_rope(const float *x, int64_t ldx, const float *cos, const float *sin_signed, float *out, int64_t b_n,
                  int64_t t_n, int64_t h_n, int64_t d)
{
    for (int64_t b = 0; b < b_n; b++)
        for (int64_t h = 0; h < h_n; h++)
            for (int64_t t = 0; t < t_n; t++)
                rope_head(x + (b * t_n + t) * ldx + h * d, cos + t * d, sin_signed + t * d,
                          out + ((b * h_n + h) * t_n + t) * d, d);
}

/* One decoder layer of a Llama-shaped model (RMSNorm, fused QKV with optional bias, RoPE, grouped-query attention
 * over a static KV cache, O projection, RMSNorm, fused gate/up, SiLU-mul, down projection, both residual adds) on
 * fp32 activations with int8, int4 or fp32 weights, in one call where the eager step dispatched about twenty ops and nine
 * module calls a layer; with `ex`, Qwen3's and Gemma-3's layers too (struct gapless_layer_extra). x [B * T, dim]
 * is the residual stream, updated in place. The new keys and values are written into the cache k, v
 * [B, Hkv, L, D] at pos[t]; query t attends to the cache positions s <= pos[t] with s < attn_len (and
 * s > pos[t] - window in a sliding-window layer), which is what every caller's mask (or causal prefill) says.
 * Each row's result is computed alone (the GEMVs as gapless_int8_linear, attention per query), so it does not
 * depend on how many rows run. */
struct gapless_q8 {
    const void *w;        /* int8 [n, k], or int4 [n, k / 2] where mins is set, or fp32 [n, k] where scale is NULL */
    const void *scale;    /* fp32 [n] for int8, fp16 [n, k / 32] for int4, NULL for fp32 */
    const uint16_t *mins; /* NULL for int8, fp16 [n, k / 32] for int4 */
    const float *bias;    /* [n] or NULL */
};

/* What a layer has beyond Llama's: Qwen3's and Gemma-3's RMSNorm over each head of q and k before RoPE, Gemma-3's
 * norms on the attention's and the MLP's outputs before each joins the residual stream, its norms scaling by
 * 1 + weight, its tanh GELU, and its sliding-window layers (a query sees the last `window` positions). */
struct gapless_layer_extra {
    const float *q_norm;        /* [D] or NULL */
    const float *k_norm;        /* [D] or NULL (set with q_norm) */
    const float *post_attn_norm; /* [dim] or NULL */
    const float *post_ffn_norm;  /* [dim] or NULL */
    float norm_offset;           /* 0, or 1 (Gemma) */
    int gelu;                    /* 0: SiLU, 1: tanh GELU */
    int64_t window;              /* 0: every earlier position */
};

static int qlinear(const struct gapless_q8 *l, const float *x, int64_t m, float *y, int64_t n, int64_t k, int threads)
{
    if (!l->scale)
        return gapless_f32_linear(x, m, (const float *)l->w, l->bias, y, n, k, threads);
    if (l->mins)
        return gapless_int4_linear(x, m, (const uint8_t *)l->w, (const uint16_t *)l->scale, l->mins, l->bias, y, n, k,
                                   threads);
    return gapless_int8_linear(x, m, (const int8_t *)l->w, (const float *)l->scale, l->bias, y, n, k, threads);
}

int gapless_decoder_layer(float *x, int64_t b_n, int64_t t_n, const int64_t *pos, int64_t attn_len, int64_t dim,
                          int64_t h_n, int64_t hkv_n, int64_t d, int64_t inter, const float *norm1,
                          const float *norm2, float eps, const struct gapless_q8 *qkv, const struct gapless_q8 *o,
                          const struct gapless_q8 *gate_up, const struct gapless_q8 *down,
                          const struct gapless_layer_extra *ex, const float *cos, const float *sin_signed, float *kc,
                          float *vc, int64_t cache_len, float scale, int threads)
{
    int64_t m = b_n * t_n, qs = h_n * d, kvs = hkv_n * d, nqkv = qs + 2 * kvs;
    int64_t big = nqkv > 2 * inter ? nqkv : 2 * inter;
    float off = ex->norm_offset;
    float *h = (float *)malloc((size_t)(m * (dim > qs ? dim : qs)) * sizeof(float));
    float *proj = (float *)malloc((size_t)(m * big) * sizeof(float));
    float *att = (float *)malloc((size_t)(m * (qs > inter ? qs : inter)) * sizeof(float));
    float *out = (float *)malloc((size_t)(m * dim) * sizeof(float));
    int failed = !h || !proj || !att || !out;
    for (int64_t t = 0; t < t_n && !failed; t++)
        if (pos[t] < 0 || pos[t] >= cache_len)
            failed = 2;
    if (!failed) {
        rms_norm_rows(x, norm1, off, h, m, dim, eps);
        failed = qlinear(qkv, h, m, proj, nqkv, dim, threads);
    }
    if (!failed) {
        /* q heads rotated into att as [B * T, H * D] scratch, k rotated and v copied into the cache; with q/k
         * norms, each head of q and k is normalised in place in the projection's row first */
        for (int64_t b = 0; b < b_n; b++)
            for (int64_t t = 0; t < t_n; t++) {
                float *row = proj + (b * t_n + t) * nqkv;
                const float *c = cos + t * d, *sn = sin_signed + t * d;
                if (ex->q_norm) {
                    rms_norm_rows(row, ex->q_norm, off, row, h_n, d, eps);
                    rms_norm_rows(row + qs, ex->k_norm, off, row + qs, hkv_n, d, eps);
                }
                for (int64_t hh = 0; hh < h_n; hh++) rope_head(row + hh * d, c, sn, att + (b * t_n + t) * qs + hh * d, d);
                for (int64_t g = 0; g < hkv_n; g++) {
                    float *kd = kc + ((b * hkv_n + g) * cache_len + pos[t]) * d;
                    float *vd = vc + ((b * hkv_n + g) * cache_len + pos[t]) * d;
                    rope_head(row + qs + g * d, c, sn, kd, d);
                    for (int64_t j = 0; j < d; j++) vd[j] = row[qs + kvs + g * d + j];
                }
            }
        /* attention, one (row, head) at a time; the output goes to h as [B * T, H * D] */
        int64_t group = h_n / hkv_n;
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            float *p = (float *)malloc((size_t)(attn_len > 0 ? attn_len : 1) * sizeof(float));
            if (!p)
                failed = 1;
#pragma omp for schedule(static) collapse(2)
            for (int64_t r = 0; r < m; r++)
                for (int64_t hh = 0; hh < h_n; hh++) {
                    if (!p)
                        continue;
                    int64_t b = r / t_n, t = r % t_n, g = hh / group;
                    int64_t keys = pos[t] + 1 < attn_len ? pos[t] + 1 : attn_len;
                    int64_t first = ex->window > 0 && pos[t] - ex->window + 1 > 0 ? pos[t] - ex->window + 1 : 0;
                    const float *q = att + r * qs + hh * d;
                    const float *kb = kc + (b * hkv_n + g) * cache_len * d, *vb = vc + (b * hkv_n + g) * cache_len * d;
                    float *y = h + r * qs + hh * d;
                    float top = -INFINITY, total = 0.0f;
                    for (int64_t s = first; s < keys; s++) {
                        p[s] = dot8(q, kb + s * d, d) * scale;
                        top = p[s] > top ? p[s] : top;
                    }
                    for (int64_t j = 0; j < d; j++) y[j] = 0.0f;
                    for (int64_t s = first; s < keys; s++) {
                        float e = expf(p[s] - top);
                        total += e;
                        const float *v = vb + s * d;
                        for (int64_t j = 0; j < d; j++) y[j] += e * v[j];
                    }
                    float inv = keys > first ? 1.0f / total : 0.0f;
                    for (int64_t j = 0; j < d; j++) y[j] *= inv;
                }
            free(p);
        }
    }
    if (!failed)
        failed = qlinear(o, h, m, out, dim, qs, threads);
    if (!failed) {
        if (ex->post_attn_norm)
            rms_norm_rows(out, ex->post_attn_norm, off, out, m, dim, eps);
        for (int64_t i = 0; i < m * dim; i++) x[i] += out[i];
        rms_norm_rows(x, norm2, off, h, m, dim, eps);
        failed = qlinear(gate_up, h, m, proj, 2 * inter, dim, threads);
    }
    if (!failed) {
        if (ex->gelu)
            gelu_tanh_mul(proj, 2 * inter, att, m, inter);
        else
            gapless_silu_mul(proj, 2 * inter, att, m, inter);
        failed = qlinear(down, att, m, out, dim, inter, threads);
    }
    if (!failed) {
        if (ex->post_ffn_norm)
            rms_norm_rows(out, ex->post_ffn_norm, off, out, m, dim, eps);
        for (int64_t i = 0; i < m * dim; i++) x[i] += out[i];
    }
    free(h);
    free(proj);
    free(att);
    free(out);
    return failed ? (failed == 2 ? -2 : -1) : 0;
}
