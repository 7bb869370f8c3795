/*
 * SIMD pieces shared by the fused prefill (prefill.c) and decode (decode.c) kernels.
 *
 * exp is e^x = 2^n e^r with n = round(x / ln 2), r reduced exactly (Cody-Waite) and e^r a
 * degree-7 polynomial: relative error below 5e-7. Inputs are clamped to [-87.3, 88.3] so
 * results stay normal floats (denormals are slow in the BLAS that follows).
 */
#ifndef LMSP_SIMD_H
#define LMSP_SIMD_H

#include <stdint.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define EXP_LO (-87.3f)
#define EXP_HI (88.3f)

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Quantized rows of 2, 4 or 8 bits, widened by bytes (experts.c, attention.c): a chunk of 32
 * codes is BITS words, whose bytes widen to 8 codes at a time (vpmovzxbd, widen8). That
 * leaves the codes in "chunk order", not their own: 4-bit: byte b holds codes 2b (low
 * nibble) and 2b+1 (high), so the low nibbles of the 16 bytes come first (codes 0, 2, ..,
 * 30), then the high ones; 2-bit: byte b holds codes 4b .. 4b+3, so bits 2s of the 8 bytes
 * give codes s, 4+s, .., 28+s, for s = 0 .. 3; 8-bit: code order. The vectors the codes
 * meet are kept in chunk order too (to_chunk_order), so no shuffle runs per row. */
static inline void to_chunk_order(const float *x, float *xp, int64_t n, int bits) {
    const int per_byte = 8 / bits, bytes = 32 / per_byte;
    for (int64_t c = 0; c < n / 32; c++)
        for (int s = 0; s < per_byte; s++)
            for (int b = 0; b < bytes; b++) xp[c * 32 + s * bytes + b] = x[c * 32 + b * per_byte + s];
}

static inline void from_chunk_order(const float *xp, float *x, int64_t n, int bits) {
    const int per_byte = 8 / bits, bytes = 32 / per_byte;
    for (int64_t c = 0; c < n / 32; c++)
        for (int s = 0; s < per_byte; s++)
            for (int b = 0; b < bytes; b++) x[c * 32 + b * per_byte + s] = xp[c * 32 + s * bytes + b];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline __m256 widen8(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); /* the low 8 bytes, as floats */
}
#endif

/* AVX2 and FMA, checked once at run time (the scalar paths serve everything else; a build
 * with -DLMSP_PORTABLE takes them everywhere, which is how the tests reach them here). */
static inline int has_avx2(void) {
#ifdef LMSP_PORTABLE
    return 0;
#endif
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return cached;
}
#else
static inline int has_avx2(void) { return 0; }
#endif

#endif
