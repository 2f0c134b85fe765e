/* The portable reference of the products: the block formats read in plain C, the same operations as the
 * vector tiles of arch/x86/quants.c lane by lane (quants.h says which), so both give the same bits. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode.h"
#include "quants.h"

/* Sub-block s's 32 values as floats (the quants, or a float type's weights), its halves' scales and
 * offsets. */
static void sub_values(int type, const uint8_t *row, int64_t s, float v[QK], float d[2], float m[2])
{
    sub_scales(type, row, s, d, m);
    if (is_float_type(type)) {
        sub_floats(type, row, s, v);
        return;
    }
    int8_t q[QK];
    sub_quants(type, row, s, q);
    for (int j = 0; j < QK; j++)
        v[j] = (float)q[j];
}

static float scalar_dot(int type, const uint8_t *w, int64_t ns, const float *x, const float *sx, int64_t ss)
{
    float acc[8] = {0}, offset = 0, v[QK];
    for (int64_t s = 0; s < ns; s++) {
        const float *xb = x + s * QK;
        float d[2], m[2];
        sub_values(type, w, s, v, d, m);
        for (int l = 0; l < 8; l++) {
            if (split_scales(type)) {
                const float lo = fmaf(v[8 + l], xb[8 + l], v[l] * xb[l]);
                const float hi = fmaf(v[24 + l], xb[24 + l], v[16 + l] * xb[16 + l]);
                acc[l] = fmaf(d[1], hi, fmaf(d[0], lo, acc[l]));
                continue;
            }
            float t = v[l] * xb[l];
            for (int k = 1; k < 4; k++)
                t = fmaf(v[8 * k + l], xb[8 * k + l], t);
            acc[l] = fmaf(d[0], t, acc[l]);
        }
        if (has_offset(type) && split_scales(type)) {
            offset = fmaf(m[0], sx[2 * s * ss], offset);
            offset = fmaf(m[1], sx[(2 * s + 1) * ss], offset);
        } else if (has_offset(type)) {
            offset = fmaf(m[0], sx[s * ss], offset);
        }
    }
    return lane_sum(acc) + offset;
}

/* ---- int16 activations ------------------------------------------------------------------------------
 *
 * Widening every quant to float32 costs about two dozen operations per block of 32, and a float fused
 * multiply-add takes 8 (AVX2) or 16 (AVX-512) products at a time. The activations are instead quantized
 * once per block to int16, and a multiply-add of int16 pairs (vpmaddwd, vpdpwssd) takes twice as many
 * products, exactly. Each sub-block's sum over its 32 (or each half) is exact in int32 (at most 32 * 128 *
 * 32767 < 2^31), so it has no order: the tiles sum it as they like (pairs per lane, lanes across outputs or
 * rows) and only the float operations per sub-block are fixed (quants.h). int16 keeps 15 bits of each
 * block's largest value (llama.cpp's 8-bit activations keep 7; docs/benchmarks.md, Precision, measures what
 * each costs). The float types have no integer quants: their rows always take the float path. */

/* Row x's nb blocks quantized: q [nb * 32] and block b's scale at dx[b * ds]. A block with a value that is
 * not finite gets dx NaN (and quants 0), so the row's outputs are NaN as the float path's would be. */
void quantize_q16(const float *x, int64_t nb, int16_t *q, float *dx, int64_t ds)
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
            dx[b * ds] = NAN;
            memset(qb, 0, sizeof(int16_t) * QK);
            continue;
        }
        const float id = amax > 0 ? Q16_MAX / amax : 0.0f;
        dx[b * ds] = amax / Q16_MAX;
        for (int j = 0; j < QK; j++) {
            const float v = nearbyintf(xb[j] * id);
            qb[j] = (int16_t)(v > Q16_MAX ? Q16_MAX : v < -Q16_MAX ? -Q16_MAX : v);
        }
    }
}

/* Up to Q16_FEW_ROWS int16 rows (`xs` apart) of one output, each sub-block decoded once for all of them:
 * res[r]. */
static void scalar_rows_q16(int type, const uint8_t *w, int64_t ns, int rows, const int16_t *xq, int64_t xs,
                            const float *dx, const float *sx, int64_t ss, float *res)
{
    float acc[Q16_FEW_ROWS] = {0}, offset[Q16_FEW_ROWS] = {0};
    int8_t q[QK];
    for (int64_t s = 0; s < ns; s++) {
        sub_quants(type, w, s, q);
        float d[2], m[2];
        sub_scales(type, w, s, d, m);
        for (int r = 0; r < rows; r++) {
            const int16_t *xb = xq + r * xs + s * QK;
            int32_t half[2] = {0, 0};
            for (int j = 0; j < QK; j++)
                half[j / 16] += q[j] * xb[j];
            const float x_scale = dx[s * ss + r];
            if (split_scales(type)) {
                acc[r] = fmaf((float)half[0], d[0] * x_scale, acc[r]);
                acc[r] = fmaf((float)half[1], d[1] * x_scale, acc[r]);
            } else {
                acc[r] = fmaf((float)(half[0] + half[1]), d[0] * x_scale, acc[r]);
            }
            if (has_offset(type) && split_scales(type)) {
                offset[r] = fmaf(m[0], sx[2 * s * ss + r], offset[r]);
                offset[r] = fmaf(m[1], sx[(2 * s + 1) * ss + r], offset[r]);
            } else if (has_offset(type)) {
                offset[r] = fmaf(m[0], sx[s * ss + r], offset[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        res[r] = acc[r] + offset[r];
}

void scalar_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1)
{
    if (p->q16) {
        float res[Q16_FEW_ROWS];
        for (int64_t t = 0; t < rows; t += Q16_FEW_ROWS) {
            const int n = rows - t < Q16_FEW_ROWS ? (int)(rows - t) : Q16_FEW_ROWS;
            for (int64_t o = o0; o < o1; o++) {
                scalar_rows_q16(p->type, row_of(p, o), p->ns, n, p->xq + t * p->n_in, p->n_in, p->dx + t,
                                p->sx + t, p->ss, res);
                for (int r = 0; r < n; r++)
                    store(p, t + r, o, res[r]);
            }
        }
        return;
    }
    for (int64_t t = 0; t < rows; t++)
        for (int64_t o = o0; o < o1; o++)
            store(p, t, o, scalar_dot(p->type, row_of(p, o), p->ns, p->x + t * p->n_in, p->sx + t, p->ss));
}

/* The values of ggml's dequantization, in its operations: d * q, plus the offset where the type has
 * one (a float16 field times a small integer is exact in float32, so the scales are the same values). */
void dequantize_row(int type, const uint8_t *row, int64_t n_in, float *out)
{
    for (int64_t s = 0; s < n_in / QK; s++) {
        float *o = out + s * QK;
        if (is_float_type(type)) {
            sub_floats(type, row, s, o);
            continue;
        }
        int8_t q[QK];
        float d[2], m[2];
        sub_quants(type, row, s, q);
        sub_scales(type, row, s, d, m);
        for (int j = 0; j < QK; j++) {
            const float w = d[j / 16] * (float)q[j];
            /* Adding a zero offset would turn -0 into +0. */
            o[j] = has_offset(type) ? w + m[j / 16] : w;
        }
    }
}
