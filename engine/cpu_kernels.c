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
 * gapless_rms_norm: y[i, :] = w * (x[i, :] / sqrt(mean(x[i, :]^2) + eps)) in fp32, one call where torch dispatches
 * six ops (pow, mean, add, rsqrt, mul, mul), each with its own fixed cost, sixty-one times a token.
 * gapless_silu_mul: the gated MLP's silu(gate) * up from the fused gate/up projection's rows, one call for three.
 * gapless_rope: rotary embedding of the fused projection's q and k heads straight into [B, H, T, D], one call for
 * the view, transpose, roll, two multiplies and the add, with the same roundings (no contraction into FMAs).
 *
 * Built on first use with the machine's C compiler (-O3 -march=native -fopenmp) and loaded with ctypes; the
 * OpenMP runtime is the one torch has loaded (same soname), so the threads are torch's. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GAPLESS_VECTOR "avx2+fma"
#else
#define GAPLESS_VECTOR "portable"
#endif

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#define QBLOCK 64      /* activations share one int16 scale per block of this many inputs */
#define QMAX 32767.0f

const char *gapless_int8_vector(void) { return GAPLESS_VECTOR; }

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

void gapless_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t d, float eps)
{
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * d;
        float *yi = y + i * d;
        float a[8] = {0};
        int64_t j = 0;
        for (; j + 8 <= d; j += 8)
            for (int l = 0; l < 8; l++) a[l] += xi[j + l] * xi[j + l];
        float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        for (; j < d; j++) s += xi[j] * xi[j];
        float r = 1.0f / sqrtf(s / (float)d + eps);
        for (j = 0; j < d; j++) yi[j] = w[j] * (xi[j] * r);
    }
}

void gapless_silu_mul(const float *x, int64_t ldx, float *y, int64_t m, int64_t inter)
{
    for (int64_t i = 0; i < m; i++) {
        const float *g = x + i * ldx, *u = g + inter;
        float *yi = y + i * inter;
        for (int64_t j = 0; j < inter; j++) yi[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* x: rows b * T + t of the projection (row stride ldx), head h at columns h * D .. h * D + D; cos and sin_signed:
 * [T, D] (sin with its first half negated); out: [B, H, T, D]. out = x * cos + roll(x, D / 2) * sin_signed. */
void gapless_rope(const float *x, int64_t ldx, const float *cos, const float *sin_signed, float *out, int64_t b_n,
                  int64_t t_n, int64_t h_n, int64_t d)
{
    int64_t half = d / 2;
    for (int64_t b = 0; b < b_n; b++)
        for (int64_t h = 0; h < h_n; h++)
            for (int64_t t = 0; t < t_n; t++) {
                const float *src = x + (b * t_n + t) * ldx + h * d, *c = cos + t * d, *s = sin_signed + t * d;
                float *o = out + ((b * h_n + h) * t_n + t) * d;
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
}
