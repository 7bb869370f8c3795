/*
 * SIMD pieces shared by the fused prefill (prefill.c) and decode (decode.c) kernels.
 *
 * exp is e^x = 2^n e^r with n = round(x / ln 2), r reduced exactly (Cody-Waite) and e^r a
 * degree-7 polynomial: relative error below 5e-7. Inputs are clamped to [-87.3, 88.3] so
 * results stay normal floats (denormals are slow in the BLAS that follows).
 */
#ifndef LMSP_SIMD_H
#define LMSP_SIMD_H

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
