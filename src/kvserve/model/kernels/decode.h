/* Decoding one sub-block of 32 weights of a row, per type, in plain C: the one per-type piece of the
 * portable path and of the dequantization, and the x86 tiles' fallback for the types they do not decode in
 * vectors (arch/x86/decode.h). Each reads the file's fields as ggml's dequantization does (the gguf
 * package's `dequantize` is the reference the tests hold it to).
 *
 * `sub_quants` writes the integer quants q[32] in element order and `sub_scales` each half's scale d and
 * offset m, the weight being d * q + m (m = 0 for the types without offsets); for the super-block types
 * (256 weights: Q2_K .. Q6_K, IQ4_XS) sub-block s is sub-block s % 8 of super-block s / 8. The float types
 * decode with `sub_floats`. MXFP4 (gpt-oss's experts) decodes as IQ4_NL does, through a table of doubled
 * e2m1 values with a halved power-of-two scale: d * q is exactly ggml's weight.
 */
#ifndef KVSERVE_DECODE_H
#define KVSERVE_DECODE_H

#include <stdint.h>

#include "quants.h"

/* IQ4_NL's and IQ4_XS's values of the 16 codes (ggml's kvalues_iq4nl). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's e2m1 values of the 16 codes, doubled so that they are integers; its scale is halved to match. */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* MXFP4's E8M0 scale byte e as 2^(e - 127) / 2, exactly (a subnormal for e < 2), as ggml reads it. */
static ALWAYS_INLINE float e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static ALWAYS_INLINE float f16(const uint8_t *p)
{
#if HAVE_F16C
    return _cvtsh_ss(read_u16(p));
#else
    return half_to_float(read_u16(p));
#endif
}

/* The block holding sub-block s of a row, and s's place in it (0 for the types with blocks of 32). */
static ALWAYS_INLINE const uint8_t *sub_block(int type, const uint8_t *row, int64_t s, int *j)
{
    if (TYPE_INFO[type].elems == QK_K) {
        *j = (int)(s % 8);
        return row + (size_t)(s / 8) * (size_t)TYPE_INFO[type].bytes;
    }
    *j = 0;
    return row + (size_t)s * (size_t)TYPE_INFO[type].bytes;
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j from their 12 packed bytes. */
static ALWAYS_INLINE void k_scale_min(const uint8_t *sc, int j, int *scale, int *min)
{
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 2) & 0x30);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 2) & 0x30);
    }
}

/* Q3_K's signed 6-bit scale k (of 16) from its 12 packed bytes. */
static ALWAYS_INLINE int q3_scale(const uint8_t *sc, int k)
{
    const int low = (k < 8 ? sc[k] : sc[k - 8] >> 4) & 0x0f;
    const int high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
    return (low | high << 4) - 32;
}

/* IQ4_XS's signed 6-bit scale of sub-block j. */
static ALWAYS_INLINE int iq4xs_scale(const uint8_t *blk, int j)
{
    const int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
    const int high = (read_u16(blk + 2) >> (2 * j)) & 3;
    return (low | high << 4) - 32;
}

static ALWAYS_INLINE void sub_scales(int type, const uint8_t *row, int64_t s, float d[2], float m[2])
{
    int j;
    const uint8_t *b = sub_block(type, row, s, &j);
    m[0] = m[1] = 0.0f;
    switch (type) {
    case TYPE_Q4_0:
    case TYPE_Q5_0:
    case TYPE_Q8_0:
    case TYPE_IQ4_NL:
        d[0] = d[1] = f16(b);
        return;
    case TYPE_Q4_1:
    case TYPE_Q5_1:
        d[0] = d[1] = f16(b);
        m[0] = m[1] = f16(b + 2);
        return;
    case TYPE_Q2_K: {
        const float dd = f16(b + 80), dmin = f16(b + 82);
        for (int h = 0; h < 2; h++) {
            const int sc = b[2 * j + h];
            d[h] = dd * (float)(sc & 0x0f);
            m[h] = -(dmin * (float)(sc >> 4));
        }
        return;
    }
    case TYPE_Q3_K: {
        const float dd = f16(b + 108);
        for (int h = 0; h < 2; h++)
            d[h] = dd * (float)q3_scale(b + 96, 2 * j + h);
        return;
    }
    case TYPE_Q4_K:
    case TYPE_Q5_K: {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        d[0] = d[1] = f16(b) * (float)sc;
        m[0] = m[1] = -(f16(b + 2) * (float)mn);
        return;
    }
    case TYPE_Q6_K: {
        const float dd = f16(b + 208);
        for (int h = 0; h < 2; h++)
            d[h] = dd * (float)(int8_t)b[192 + 2 * j + h];
        return;
    }
    case TYPE_IQ4_XS:
        d[0] = d[1] = f16(b) * (float)iq4xs_scale(b, j);
        return;
    case TYPE_MXFP4:
        d[0] = d[1] = e8m0_half(b[0]);
        return;
    default:
        d[0] = d[1] = 1.0f;
        return;
    }
}

static ALWAYS_INLINE void sub_quants(int type, const uint8_t *row, int64_t s, int8_t q[QK])
{
    int j;
    const uint8_t *b = sub_block(type, row, s, &j);
    switch (type) {
    case TYPE_Q8_0:
        for (int i = 0; i < QK; i++)
            q[i] = (int8_t)b[2 + i];
        return;
    case TYPE_Q4_0:
    case TYPE_Q4_1:
    case TYPE_IQ4_NL: {
        const uint8_t *qs = b + (type == TYPE_Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; i++) {
            const int lo = qs[i] & 0x0f, hi = qs[i] >> 4;
            q[i] = (int8_t)(type == TYPE_IQ4_NL ? IQ4_VALUES[lo] : type == TYPE_Q4_0 ? lo - 8 : lo);
            q[i + 16] = (int8_t)(type == TYPE_IQ4_NL ? IQ4_VALUES[hi] : type == TYPE_Q4_0 ? hi - 8 : hi);
        }
        return;
    }
    case TYPE_Q5_0:
    case TYPE_Q5_1: {
        const int at = type == TYPE_Q5_1 ? 4 : 2;
        const uint32_t qh = (uint32_t)b[at] | (uint32_t)b[at + 1] << 8 | (uint32_t)b[at + 2] << 16 |
                            (uint32_t)b[at + 3] << 24;
        const uint8_t *qs = b + at + 4;
        const int bias = type == TYPE_Q5_0 ? 16 : 0;
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)(((qs[i] & 0x0f) | ((qh >> i) & 1) << 4) - bias);
            q[i + 16] = (int8_t)(((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - bias);
        }
        return;
    }
    case TYPE_Q2_K: {
        const uint8_t *qs = b + 16 + 32 * (j / 4);
        for (int i = 0; i < QK; i++)
            q[i] = (int8_t)((qs[i] >> (2 * (j % 4))) & 3);
        return;
    }
    case TYPE_Q3_K: {
        const uint8_t *hm = b, *qs = b + 32 + 32 * (j / 4);
        for (int i = 0; i < QK; i++)
            q[i] = (int8_t)(((qs[i] >> (2 * (j % 4))) & 3) - (((hm[i] >> j) & 1) ? 0 : 4));
        return;
    }
    case TYPE_Q4_K:
    case TYPE_Q5_K: {
        const uint8_t *qs = b + (type == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
        for (int i = 0; i < QK; i++) {
            int v = (qs[i] >> (4 * (j % 2))) & 0x0f;
            if (type == TYPE_Q5_K)
                v |= ((b[16 + i] >> j) & 1) << 4;
            q[i] = (int8_t)v;
        }
        return;
    }
    case TYPE_Q6_K: {
        const uint8_t *ql = b + 64 * (j / 4) + 32 * (j % 2), *qh = b + 128 + 32 * (j / 4);
        for (int i = 0; i < QK; i++) {
            const int lo = (ql[i] >> (4 * ((j / 2) % 2))) & 0x0f, hi = (qh[i] >> (2 * (j % 4))) & 3;
            q[i] = (int8_t)((lo | hi << 4) - 32);
        }
        return;
    }
    case TYPE_IQ4_XS: {
        const uint8_t *qs = b + 8 + 16 * j;
        for (int i = 0; i < 16; i++) {
            q[i] = IQ4_VALUES[qs[i] & 0x0f];
            q[i + 16] = IQ4_VALUES[qs[i] >> 4];
        }
        return;
    }
    case TYPE_MXFP4:
        for (int i = 0; i < 16; i++) {
            q[i] = MXFP4_VALUES[b[1 + i] & 0x0f];
            q[i + 16] = MXFP4_VALUES[b[1 + i] >> 4];
        }
        return;
    default:
        return;
    }
}

/* bfloat16 bits to float: exact. */
static inline float bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static ALWAYS_INLINE void sub_floats(int type, const uint8_t *row, int64_t s, float w[QK])
{
    for (int i = 0; i < QK; i++) {
        const int64_t e = s * QK + i;
        w[i] = type == TYPE_F32   ? read_f32(row + 4 * e)
               : type == TYPE_F16 ? half_to_float(read_u16(row + 2 * e))
                                  : bf16_to_float(read_u16(row + 2 * e));
    }
}

#endif
