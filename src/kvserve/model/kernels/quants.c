/* The portable reference of the products: the block formats read in plain C, the same operations as the
 * vector tiles of arch/x86/quants.c lane by lane (quants.h says which), so both give the same bits. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quants.h"

/* Scales of the block's two halves, and its offset (0 for the types without one). */
static inline void scales(int type, const uint8_t *blk, float *d0, float *d1, float *m)
{
    if (type == TYPE_K8) {
        *d0 = read_f32(blk), *d1 = read_f32(blk + 4), *m = read_f32(blk + 8);
        return;
    }
    *d0 = *d1 = half_to_float(read_u16(blk));
    *m = type == TYPE_Q4_1 ? half_to_float(read_u16(blk + 2)) : 0.0f;
}

/* The block's quants as integers, elements in order (Q4_0 with its 8 taken off). */
static inline void int_quants(int type, const uint8_t *blk, int32_t q[QK])
{
    if (type == TYPE_Q8_0 || type == TYPE_K8) {
        const int at = type == TYPE_K8 ? 12 : 2;
        for (int j = 0; j < QK; j++)
            q[j] = (int8_t)blk[at + j];
        return;
    }
    const uint8_t *qs = blk + (type == TYPE_Q4_1 ? 4 : 2);
    const int bias = type == TYPE_Q4_0 ? 8 : 0;
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (qs[j] & 0x0f) - bias;
        q[j + QK / 2] = (qs[j] >> 4) - bias;
    }
}

static float scalar_dot(int type, const uint8_t *w, size_t block_stride, int64_t nb, const float *x,
                        const float *sx, int64_t ss)
{
    float acc[8] = {0}, offset = 0, q[QK];
    int32_t qi[QK];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_stride;
        const float *xb = x + b * QK;
        int_quants(type, blk, qi);
        for (int j = 0; j < QK; j++)
            q[j] = (float)qi[j];
        float d0, d1, m;
        scales(type, blk, &d0, &d1, &m);
        for (int l = 0; l < 8; l++) {
            if (type == TYPE_K8) {
                /* Two halves with their own scales. */
                const float lo = fmaf(q[8 + l], xb[8 + l], q[l] * xb[l]);
                const float hi = fmaf(q[24 + l], xb[24 + l], q[16 + l] * xb[16 + l]);
                acc[l] = fmaf(d1, hi, fmaf(d0, lo, acc[l]));
                continue;
            }
            float t = q[l] * xb[l];
            for (int k = 1; k < 4; k++)
                t = fmaf(q[8 * k + l], xb[8 * k + l], t);
            acc[l] = fmaf(d0, t, acc[l]);
        }
        if (has_offset(type))
            offset = fmaf(m, sx[b * ss], offset);
    }
    return lane_sum(acc) + offset;
}

/* ---- Decode rows: int16 activations ------------------------------------------------------------------
 *
 * A decode row uses each weight once, so the float path's cost is widening every quant to float32 (about
 * two dozen operations per block of 32). A decode row's activations are instead quantized once per block
 * to int16 (dx = max |x| / 32767, q = x * (32767 / max |x|) rounded to nearest even), and each block's
 * sum of weight quants times activation quants is exact in int32: per block, lane l holds the four
 * products of elements 2l, 2l + 1, 16 + 2l and 17 + 2l (K8: the low half's two and the high half's two
 * apart), and takes (float) that sum times d * dx by a fused multiply-add; the offset term and the final
 * lane tree are the float path's. Integer sums have no order, so the bits are again the same for every
 * batch, tile, thread count and instruction set. int16 keeps 15 bits of each block's largest value
 * (llama.cpp's 8-bit activations keep 7; docs/design.md, Weight precision, measures what each costs). */

/* Row x's nb blocks quantized: q [nb * 32] and dx [nb]. A block with a value that is not finite gets dx
 * NaN (and quants 0), so the row's outputs are NaN as the float path's would be. */
void quantize_q16(const float *x, int64_t nb, int16_t *q, float *dx)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0;
        int finite = 1;
        for (int j = 0; j < QK; j++) {
            const float a = fabsf(xb[j]);
            finite &= a <= FLT_MAX;
            amax = a > amax ? a : amax;
        }
        int16_t *qb = q + b * QK;
        if (!finite) {
            dx[b] = NAN;
            memset(qb, 0, sizeof(int16_t) * QK);
            continue;
        }
        const float id = amax > 0 ? Q16_MAX / amax : 0.0f;
        dx[b] = amax / Q16_MAX;
        for (int j = 0; j < QK; j++) {
            const float v = nearbyintf(xb[j] * id);
            qb[j] = (int16_t)(v > Q16_MAX ? Q16_MAX : v < -Q16_MAX ? -Q16_MAX : v);
        }
    }
}

static float scalar_dot_q16(int type, const uint8_t *w, size_t block_stride, int64_t nb, const int16_t *xq,
                            const float *dx, const float *sx, int64_t ss)
{
    float acc[8] = {0}, offset = 0;
    int32_t q[QK];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_stride;
        const int16_t *xb = xq + b * QK;
        int_quants(type, blk, q);
        float d0, d1, m;
        scales(type, blk, &d0, &d1, &m);
        for (int l = 0; l < 8; l++) {
            const int32_t lo = q[2 * l] * xb[2 * l] + q[2 * l + 1] * xb[2 * l + 1];
            const int32_t hi = q[16 + 2 * l] * xb[16 + 2 * l] + q[17 + 2 * l] * xb[17 + 2 * l];
            if (type == TYPE_K8)
                acc[l] = fmaf((float)hi, d1 * dx[b], fmaf((float)lo, d0 * dx[b], acc[l]));
            else
                acc[l] = fmaf((float)(lo + hi), d0 * dx[b], acc[l]);
        }
        if (has_offset(type))
            offset = fmaf(m, sx[b * ss], offset);
    }
    return lane_sum(acc) + offset;
}

void scalar_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1)
{
    for (int64_t t = 0; t < rows; t++)
        for (int64_t o = o0; o < o1; o++) {
            const uint8_t *w = column(p, o);
            const size_t bs = block_stride(p, o);
            const float *sx = p->sx + t;
            store(p, t, o,
                  t < p->q16_rows
                      ? scalar_dot_q16(p->type, w, bs, p->nb, p->xq + t * p->n_in, p->dx + t * p->nb, sx,
                                       rows)
                      : scalar_dot(p->type, w, bs, p->nb, p->x + t * p->n_in, sx, rows));
        }
}
