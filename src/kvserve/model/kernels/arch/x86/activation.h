/* activation.h's gelu and silu, 8 lanes (AVX2 with FMA) and 16 lanes (AVX-512) at a time: its operations
 * in its order, each fmaf a vector fused multiply-add and each clamp a min or max whose second operand is
 * the bound, so every lane has the portable path's bits. */
#ifndef KVSERVE_X86_ACTIVATION_H
#define KVSERVE_X86_ACTIVATION_H

#include "../../activation.h"
#include "../../common.h"

#if HAVE_AVX2
/* x / (1 + exp(t)), lane by lane. */
static ALWAYS_INLINE __m256 x_over_one_plus_exp8(__m256 x, __m256 t)
{
    t = _mm256_min_ps(t, _mm256_set1_ps(EXP_T_MAX));
    t = _mm256_max_ps(t, _mm256_set1_ps(EXP_T_MIN));
    const __m256 k = _mm256_fmadd_ps(t, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(EXP_ROUND));
    const __m256 n = _mm256_sub_ps(k, _mm256_set1_ps(EXP_ROUND));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), t);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(EXP_P6), r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(k), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

static ALWAYS_INLINE __m256 gelu_tanh8(__m256 x)
{
    const __m256 t = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(GELU_C3), _mm256_mul_ps(x, x),
                                                _mm256_set1_ps(GELU_C1)));
    return x_over_one_plus_exp8(x, t);
}

static ALWAYS_INLINE __m256 silu8(__m256 x)
{
    return x_over_one_plus_exp8(x, _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
}
#endif

#if HAVE_AVX512
/* x / (1 + exp(t)), lane by lane. */
static ALWAYS_INLINE __m512 x_over_one_plus_exp16(__m512 x, __m512 t)
{
    t = _mm512_min_ps(t, _mm512_set1_ps(EXP_T_MAX));
    t = _mm512_max_ps(t, _mm512_set1_ps(EXP_T_MIN));
    const __m512 k = _mm512_fmadd_ps(t, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(EXP_ROUND));
    const __m512 n = _mm512_sub_ps(k, _mm512_set1_ps(EXP_ROUND));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP_P6), r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(k), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static ALWAYS_INLINE __m512 gelu_tanh16(__m512 x)
{
    const __m512 t = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(GELU_C3), _mm512_mul_ps(x, x),
                                                _mm512_set1_ps(GELU_C1)));
    return x_over_one_plus_exp16(x, t);
}

static ALWAYS_INLINE __m512 silu16(__m512 x)
{
    return x_over_one_plus_exp16(x, _mm512_xor_ps(x, _mm512_set1_ps(-0.0f)));
}
#endif

#endif
