/* The engine's own CPU kernels, for the eager decode step where torch's are slow for its shapes.
 *
 * gapless_int8_linear: weight-only int8 linear, y[i, r] = scale[r] * sum_k w[r, k] * x[i, k] (+ bias[r]).
 * Activations and accumulation stay fp32; the weights are read as int8, one scale per output row. A decode step
 * (one row of activations) is a GEMV that streams the weights once, so the loop is written for the memory: one
 * weight row at a time, 32 inputs a step into four accumulators, and a software prefetch PREFETCH_BYTES ahead in
 * the weight stream (the rows are contiguous, so it runs on into the next rows). With several activation rows
 * (candidates, a speculative verify, a prefill chunk) each weight row is widened to fp32 once and every
 * activation row is dotted with it in the same order as the one-row loop, so a row's result does not depend on
 * how many rows run.
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
#define STEP 32

const char *gapless_int8_vector(void) { return GAPLESS_VECTOR; }

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 widen8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* sum_k w[k] * x[k] over the first k - k % STEP inputs, reading int8 weights */
static inline float dot_i8(const int8_t *w, const float *x, int64_t k)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j + STEP <= k; j += STEP) {
        _mm_prefetch((const char *)(w + j + PREFETCH_BYTES), _MM_HINT_T0);
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + j));
        __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        a0 = _mm256_fmadd_ps(widen8(lo), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(hi), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + j + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* the same sum in the same order, reading weights already widened to fp32 */
static inline float dot_f32(const float *w, const float *x, int64_t k)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j + STEP <= k; j += STEP) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 16), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 24), _mm256_loadu_ps(x + j + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#else
/* Portable C with the same structure (32 lanes in four groups of eight), which compilers vectorise. */
static inline float reduce(float a[4][8])
{
    float s[8];
    for (int l = 0; l < 8; l++) s[l] = (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]);
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static inline float dot_i8(const int8_t *w, const float *x, int64_t k)
{
    float a[4][8] = {{0}};
    for (int64_t j = 0; j + STEP <= k; j += STEP)
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 8; l++) a[g][l] += (float)w[j + 8 * g + l] * x[j + 8 * g + l];
    return reduce(a);
}

static inline float dot_f32(const float *w, const float *x, int64_t k)
{
    float a[4][8] = {{0}};
    for (int64_t j = 0; j + STEP <= k; j += STEP)
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 8; l++) a[g][l] += w[j + 8 * g + l] * x[j + 8 * g + l];
    return reduce(a);
}
#endif

static inline float finish(float s, const int8_t *w, const float *x, int64_t k, float scale, const float *bias,
                           int64_t r)
{
    for (int64_t j = k - k % STEP; j < k; j++) s += (float)w[j] * x[j];
    s *= scale;
    return bias ? s + bias[r] : s;
}

/* Returns 0, or -1 when a row's fp32 buffer could not be allocated. */
int gapless_int8_linear(const float *x, int64_t m, const int8_t *w, const float *scale, const float *bias, float *y,
                        int64_t n, int64_t k, int threads)
{
    int failed = 0;
    if (m == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < n; r++)
            y[r] = finish(dot_i8(w + r * k, x, k), w + r * k, x, k, scale[r], bias, r);
        return 0;
    }
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *wf = (float *)malloc((size_t)k * sizeof(float));
        if (!wf)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!wf)
                continue;
            const int8_t *wr = w + r * k;
            for (int64_t j = 0; j < k; j++) wf[j] = (float)wr[j];
            for (int64_t i = 0; i < m; i++) {
                const float *xi = x + i * k;
                y[i * n + r] = finish(dot_f32(wf, xi, k), wr, xi, k, scale[r], bias, r);
            }
        }
        free(wf);
    }
    return failed ? -1 : 0;
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
