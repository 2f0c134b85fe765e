/* Decoding one sub-block of 32 weights in AVX2 registers, per type: the x86 tiles' one per-type piece
 * (decode.h is the portable twin; both give the same integers). `x86_quants` returns the quants as int8,
 * each half in one vector; the scales are decode.h's `sub_scales`. */
#ifndef KVSERVE_X86_DECODE_H
#define KVSERVE_X86_DECODE_H

#include "../../decode.h"

#if HAVE_AVX2
/* Bits `shift` .. of 32 bytes, under `mask` (mask's width + shift <= 8, so no bit of a neighbour byte). */
static ALWAYS_INLINE __m256i bits(const uint8_t *p, int shift, int mask)
{
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* Bits 16h .. 16h + 15 of the 32-bit little-endian word at p as 0x10 or 0 in bytes 0..15 (Q5_0's and
 * Q5_1's fifth bits of half h). */
static ALWAYS_INLINE __m128i fifth_bits(const uint8_t *p, int h)
{
    uint32_t qh;
    memcpy(&qh, p, sizeof qh);
    const long long first = h ? 0x0202020202020202LL : 0, second = h ? 0x0303030303030303LL : 0x0101010101010101LL;
    const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi32((int)qh), _mm_set_epi64x(second, first));
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(0x10));
}

/* The quants of sub-block s as int8: elements 0..15 in lo, 16..31 in hi. The types with blocks of 32 hold
 * each half in 16 bytes (nibbles, or Q8_0's bytes); the super-block types' sub-blocks are 32 bytes under
 * one shift. */
static ALWAYS_INLINE void x86_quants(int type, const uint8_t *row, int64_t s, __m128i *lo, __m128i *hi)
{
    int j;
    const uint8_t *b = sub_block(type, row, s, &j);
    const __m128i mask = _mm_set1_epi8(0x0f);
    if (type == TYPE_Q8_0) {
        *lo = _mm_loadu_si128((const __m128i *)(b + 2));
        *hi = _mm_loadu_si128((const __m128i *)(b + 18));
        return;
    }
    if (type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q5_0 || type == TYPE_Q5_1 || type == TYPE_IQ4_NL ||
        type == TYPE_IQ4_XS) {
        const int at = type == TYPE_Q4_0 || type == TYPE_IQ4_NL ? 2
                       : type == TYPE_Q4_1                      ? 4
                       : type == TYPE_Q5_0                      ? 6
                       : type == TYPE_Q5_1                      ? 8
                                                                : 8 + 16 * j;
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + at));
        *lo = _mm_and_si128(raw, mask);
        *hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        if (type == TYPE_Q4_0) {
            *lo = _mm_sub_epi8(*lo, _mm_set1_epi8(8));
            *hi = _mm_sub_epi8(*hi, _mm_set1_epi8(8));
        } else if (type == TYPE_Q5_0 || type == TYPE_Q5_1) {
            const int qh = type == TYPE_Q5_0 ? 2 : 4;
            const __m128i bias = _mm_set1_epi8(type == TYPE_Q5_0 ? 16 : 0);
            *lo = _mm_sub_epi8(_mm_or_si128(*lo, fifth_bits(b + qh, 0)), bias);
            *hi = _mm_sub_epi8(_mm_or_si128(*hi, fifth_bits(b + qh, 1)), bias);
        } else if (type == TYPE_IQ4_NL || type == TYPE_IQ4_XS) {
            const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
            *lo = _mm_shuffle_epi8(table, *lo);
            *hi = _mm_shuffle_epi8(table, *hi);
        }
        return;
    }
    __m256i q;
    switch (type) {
    case TYPE_Q2_K:
        q = bits(b + 16 + 32 * (j / 4), 2 * (j % 4), 3);
        break;
    case TYPE_Q3_K: {
        const __m256i high = _mm256_slli_epi16(bits(b, j, 1), 2);
        q = _mm256_sub_epi8(_mm256_add_epi8(bits(b + 32 + 32 * (j / 4), 2 * (j % 4), 3), high),
                            _mm256_set1_epi8(4));
        break;
    }
    case TYPE_Q4_K:
        q = bits(b + 16 + 32 * (j / 2), 4 * (j % 2), 0x0f);
        break;
    case TYPE_Q5_K:
        q = _mm256_or_si256(bits(b + 48 + 32 * (j / 2), 4 * (j % 2), 0x0f),
                            _mm256_slli_epi16(bits(b + 16, j, 1), 4));
        break;
    case TYPE_Q6_K: {
        const __m256i low = bits(b + 64 * (j / 4) + 32 * (j % 2), 4 * ((j / 2) % 2), 0x0f);
        const __m256i high = _mm256_slli_epi16(bits(b + 128 + 32 * (j / 4), 2 * (j % 4), 3), 4);
        q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
        break;
    }
    default: {
        int8_t qs[QK];
        sub_quants(type, row, s, qs);
        q = _mm256_loadu_si256((const __m256i *)qs);
    }
    }
    *lo = _mm256_castsi256_si128(q);
    *hi = _mm256_extracti128_si256(q, 1);
}

/* The sub-block's 32 values as floats, elements 8k..8k+7 in vector k (the quants widened, or a float
 * type's weights). */
static ALWAYS_INLINE void x86_values(int type, const uint8_t *row, int64_t s, __m256 v[4])
{
    switch (type) {
    case TYPE_F32:
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_loadu_ps((const float *)(row + 128 * s + 32 * k));
        return;
    case TYPE_F16:
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 64 * s + 16 * k)));
        return;
    case TYPE_BF16:
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 64 * s + 16 * k))), 16));
        return;
    case TYPE_Q8_0:
        /* Widened straight from memory: no shuffle to split the bytes first. */
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 34 * s + 2 + 8 * k))));
        return;
    default: {
        __m128i lo, hi;
        x86_quants(type, row, s, &lo, &hi);
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
    }
}

/* Bytes of a row before sub-block s (where its stream is; for prefetching). */
static ALWAYS_INLINE size_t sub_offset(int type, int64_t s)
{
    return (size_t)s * QK * (size_t)TYPE_INFO[type].bytes / (size_t)TYPE_INFO[type].elems;
}
#endif

#endif
