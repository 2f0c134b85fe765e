/* Decoding one sub-block of 32 weights in AVX2 registers, per type: the x86 tiles' one per-type piece
 * (decode.h is the portable twin; both give the same integers). `x86_quants` returns the quants as int8,
 * each half in one vector; with AVX-512 VBMI, `x86_biased` returns them plus a bias as bytes in one
 * vector, which `widen_biased` turns into floats. The scales are decode.h's `sub_scales`, or, eight or
 * sixteen at a time for a super-block, `super_scales` (the same values). */
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
        type == TYPE_IQ4_XS || type == TYPE_MXFP4) {
        const int at = type == TYPE_MXFP4                       ? 1
                       : type == TYPE_Q4_0 || type == TYPE_IQ4_NL ? 2
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
        } else if (type == TYPE_IQ4_NL || type == TYPE_IQ4_XS || type == TYPE_MXFP4) {
            const __m128i table = _mm_loadu_si128((const __m128i *)(type == TYPE_MXFP4 ? MXFP4_VALUES : IQ4_VALUES));
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

#if HAVE_AVX512_VBMI
/* What x86_biased adds to each quant so that it is a byte from 0 to 255. */
static ALWAYS_INLINE int quant_bias(int type)
{
    switch (type) {
    case TYPE_Q4_0:
        return 8;
    case TYPE_Q5_0:
        return 16;
    case TYPE_Q3_K:
        return 4;
    case TYPE_Q6_K:
        return 32;
    case TYPE_MXFP4:
        /* Its doubled values lie in [-12, 12]: biased, below 128, so the few-row tiles take them as bytes. */
        return 16;
    case TYPE_Q8_0:
    case TYPE_IQ4_NL:
    case TYPE_IQ4_XS:
        return 128;
    default:
        return 0;
    }
}

/* Bytes 0..15 at p as 32 nibbles in element order: the low nibbles, then the high ones. */
static ALWAYS_INLINE __m256i nibbles(const uint8_t *p)
{
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i shift = _mm256_setr_epi64x(0, 0, 0x0004000400040004LL, 0x0004000400040004LL);
    return _mm256_and_si256(_mm256_srlv_epi16(raw, shift), _mm256_set1_epi8(0x0f));
}

/* A table of 16 values (IQ4_VALUES, MXFP4_VALUES) plus the type's bias, in both halves (for the byte
 * shuffle). */
static ALWAYS_INLINE __m256i table_biased(int type, const int8_t *table)
{
    const __m128i values = _mm_loadu_si128((const __m128i *)table);
    return _mm256_broadcastsi128_si256(_mm_add_epi8(values, _mm_set1_epi8((char)quant_bias(type))));
}

/* The quants of sub-block s plus quant_bias(type), in element order in one vector; a fifth (or third) bit
 * per element is added under a byte mask (the low bits are below it, so adding is or-ing). The same
 * integers as x86_quants. */
static ALWAYS_INLINE __m256i x86_biased(int type, const uint8_t *row, int64_t s)
{
    int j;
    const uint8_t *b = sub_block(type, row, s, &j);
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    switch (type) {
    case TYPE_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    case TYPE_Q4_0:
        return nibbles(b + 2);
    case TYPE_IQ4_NL:
        return _mm256_shuffle_epi8(table_biased(type, IQ4_VALUES), nibbles(b + 2));
    case TYPE_Q4_1:
        return nibbles(b + 4);
    case TYPE_Q5_0:
    case TYPE_Q5_1: {
        const int at = type == TYPE_Q5_0 ? 2 : 4;
        const __m256i u = nibbles(b + at + 4);
        uint32_t qh;
        memcpy(&qh, b + at, sizeof qh);
        return _mm256_mask_add_epi8(u, (__mmask32)qh, u, bit4);
    }
    case TYPE_IQ4_XS:
        return _mm256_shuffle_epi8(table_biased(type, IQ4_VALUES), nibbles(b + 8 + 16 * j));
    case TYPE_MXFP4:
        return _mm256_shuffle_epi8(table_biased(type, MXFP4_VALUES), nibbles(b + 1));
    case TYPE_Q2_K:
        return bits(b + 16 + 32 * (j / 4), 2 * (j % 4), 3);
    case TYPE_Q3_K: {
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        const __mmask32 high = _mm256_test_epi8_mask(hm, _mm256_set1_epi8((char)(1 << j)));
        const __m256i low = bits(b + 32 + 32 * (j / 4), 2 * (j % 4), 3);
        return _mm256_mask_add_epi8(low, high, low, _mm256_set1_epi8(4));
    }
    case TYPE_Q4_K:
        return bits(b + 16 + 32 * (j / 2), 4 * (j % 2), 0x0f);
    case TYPE_Q5_K: {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __mmask32 high = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << j)));
        const __m256i low = bits(b + 48 + 32 * (j / 2), 4 * (j % 2), 0x0f);
        return _mm256_mask_add_epi8(low, high, low, bit4);
    }
    case TYPE_Q6_K: {
        /* The two high bits at 2 (j % 4) rotated to bits 4-5 of their byte (what the rotation brings in from
         * the neighbour bytes falls outside the mask), then or-ed under the mask in one operation. */
        const __m256i low = bits(b + 64 * (j / 4) + 32 * (j % 2), 4 * ((j / 2) % 2), 0x0f);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (j / 4)));
        const __m256i high = _mm256_rolv_epi32(qh, _mm256_set1_epi32((4 - 2 * (j % 4)) & 31));
        return _mm256_ternarylogic_epi32(low, high, _mm256_set1_epi8(0x30), 0xf8);
    }
    default:
        return _mm256_setzero_si256();
    }
}

/* Biased quants as floats, exactly: byte 8k + l goes into the low byte of lane l of vector k over the
 * bits of 2^23 (a float whose last 8 bits are the byte: 2^23 + u), and 2^23 + bias is taken away (exact).
 * One byte permute and one subtraction per vector, where widening takes a shuffle, a sign extension and a
 * conversion. */
static ALWAYS_INLINE void widen_biased(__m256i u, int bias, __m256 v[4])
{
    const __m256i magic = _mm256_set1_epi32(0x4B000000);
    const __m256 base = _mm256_set1_ps(8388608.0f + (float)bias);
    for (int k = 0; k < 4; k++) {
        const __m256i index = _mm256_setr_epi32(8 * k, 8 * k + 1, 8 * k + 2, 8 * k + 3, 8 * k + 4, 8 * k + 5,
                                                8 * k + 6, 8 * k + 7);
        const __m256i lanes = _mm256_mask_permutexvar_epi8(magic, (__mmask32)0x11111111, index, u);
        v[k] = _mm256_sub_ps(_mm256_castsi256_ps(lanes), base);
    }
}
#endif

/* The sub-block's 32 values as floats, elements 8k..8k+7 in vector k (the quants widened, or a float
 * type's weights). */
static ALWAYS_INLINE void x86_values(int type, const uint8_t *row, int64_t s, __m256 v[4])
{
#if HAVE_AVX512_VBMI
    if (!is_float_type(type) && type != TYPE_Q8_0) {
        widen_biased(x86_biased(type, row, s), quant_bias(type), v);
        return;
    }
#endif
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

/* Eight small integers times `scale`, into out[0..7]: sub_scales' products, one rounding each (negated
 * after it where `negate`, as sub_scales negates the offsets). */
static ALWAYS_INLINE void times8(__m256i n, float scale, int negate, float *out)
{
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(scale));
    if (negate)
        v = _mm256_xor_ps(v, _mm256_set1_ps(-0.0f));
    _mm256_storeu_ps(out, v);
}

/* The scales and offsets of the super-block at b (Q2_K, Q4_K, Q5_K, Q6_K): sub-block j's half h at d[2j +
 * h] and m[2j + h] for the split_scales types, at d[j] and m[j] for the others. The values of sub_scales,
 * computed eight at a time: the packed integer scales unpacked together (Q4_K's and Q5_K's 6-bit ones in
 * integer registers), each vector of them converted and multiplied by the float16 field at once. */
static ALWAYS_INLINE void super_scales(int type, const uint8_t *b, float *d, float *m)
{
    switch (type) {
    case TYPE_Q4_K:
    case TYPE_Q5_K: {
        uint32_t w[3];
        memcpy(w, b + 4, sizeof w);
        /* Scales 0-3 and mins 0-3: the low six bits of bytes 0-3 and 4-7; scales 4-7: the low nibbles of
         * bytes 8-11 under the top two bits of bytes 0-3; mins 4-7: the high nibbles of bytes 8-11 under
         * the top two bits of bytes 4-7. */
        const uint32_t low6 = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, top2 = 0x03030303u;
        const uint32_t sc_hi = (w[2] & nib) | ((w[0] >> 6) & top2) << 4;
        const uint32_t mn_hi = ((w[2] >> 4) & nib) | ((w[1] >> 6) & top2) << 4;
        const __m128i sc = _mm_set_epi32(0, 0, (int)sc_hi, (int)(w[0] & low6));
        const __m128i mn = _mm_set_epi32(0, 0, (int)mn_hi, (int)(w[1] & low6));
        times8(_mm256_cvtepu8_epi32(sc), f16(b), 0, d);
        times8(_mm256_cvtepu8_epi32(mn), f16(b + 2), 1, m);
        return;
    }
    case TYPE_Q6_K: {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        const float dd = f16(b + 208);
        times8(_mm256_cvtepi8_epi32(sc), dd, 0, d);
        times8(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)), dd, 0, d + 8);
        return;
    }
    case TYPE_Q2_K: {
        const __m128i sc = _mm_loadu_si128((const __m128i *)b), low = _mm_set1_epi8(0x0f);
        const __m128i s4 = _mm_and_si128(sc, low), m4 = _mm_and_si128(_mm_srli_epi16(sc, 4), low);
        const float dd = f16(b + 80), dmin = f16(b + 82);
        times8(_mm256_cvtepu8_epi32(s4), dd, 0, d);
        times8(_mm256_cvtepu8_epi32(_mm_srli_si128(s4, 8)), dd, 0, d + 8);
        times8(_mm256_cvtepu8_epi32(m4), dmin, 1, m);
        times8(_mm256_cvtepu8_epi32(_mm_srli_si128(m4, 8)), dmin, 1, m + 8);
        return;
    }
    default:
        return;
    }
}

/* Bytes of a row before sub-block s (where its stream is; for prefetching). */
static ALWAYS_INLINE size_t sub_offset(int type, int64_t s)
{
    return (size_t)s * QK * (size_t)TYPE_INFO[type].bytes / (size_t)TYPE_INFO[type].elems;
}
#endif

#endif
