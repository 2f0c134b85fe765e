/* Every decoder layer of a step's decode rows in one call (loaded through ctypes by
 * kvserve/model/native_decoder.py).
 *
 * The same operations, in the same order, as the per-op path of transformer.py with these kernels:
 * rms_norm_rows, the qkv product, rope on q and k (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product
 * rounded: no contraction in this library), the K/V write into the paged cache (float32, rounded to
 * float16 to nearest even as torch rounds, or quantized to q8_0 as kv_quant.py does), the attention
 * kernel (called through the pointer the caller passes, from the attention library), the o product plus
 * the residual, rms_norm_rows, the gate product with silu, the up product times it, the down product plus
 * the residual. So a row's bits are those of the
 * per-op path, and as batch-invariant. What it saves is the per-op calls between the products. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kvserve.h"

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, row by row: one call instead of torch's five ops. The
 * sum of squares runs in index order in plain C (no reassociation is allowed, so no vector code): the
 * same bits on every machine and for every batch. */
void rms_norm_rows(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps)
{
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * n;
        float *ot = out + t * n;
        float ss = 0;
        for (int64_t i = 0; i < n; i++)
            ss += xt[i] * xt[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++)
            ot[i] = xt[i] * inv * weight[i];
    }
}

static int run_linear(const struct decoder *m, const struct qlinear *l, const float *x, const float *other,
                      float *out, int64_t rows, int op, int threads)
{
    return quant_linear(l, x, other, out, rows, op, threads, 0, m->q16 ? rows : 0);
}

static void rope_rows(float *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t dim,
                      const int64_t *positions, const float *cos_t, const float *sin_t)
{
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qkv + t * stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
                x[i] = a - b;
                x[i + half] = e + f;
            }
        }
    }
}

/* q8_0 (llama.cpp's quantize_row_q8_0_ref): per 32 values d = max |x| / 127, stored as float16, and
 * roundf(x * (1 / d)) (0 for an all-zero block). The operations of kv_quant.quantize, in float, so that
 * a decode's blocks have the bytes its prefill would have written. */
#define QK 32
#define Q8_BYTES (2 + QK)

#if HAVE_FLOAT16
static void quantize_q8_0(const float *x, uint8_t *dst, int64_t n)
{
    for (int64_t b = 0; b < n / QK; b++, x += QK, dst += Q8_BYTES) {
        float amax = 0;
        for (int j = 0; j < QK; j++)
            amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float d = amax / 127.0f, inverse = d != 0 ? 1.0f / d : 0.0f;
        const _Float16 half = (_Float16)d;
        memcpy(dst, &half, 2);
        for (int j = 0; j < QK; j++)
            dst[2 + j] = (uint8_t)(int8_t)roundf(x[j] * inverse);
    }
}
#endif

/* The bytes of one position's row of the caches. */
static size_t kv_row_bytes(const struct decoder *m)
{
    const int64_t n = m->kv_heads * m->head_dim;
    if (m->kv_type == KV_TYPE_Q8_0)
        return (size_t)(n / QK * Q8_BYTES);
    return (size_t)n * (m->kv_type == KV_TYPE_F16 ? 2 : 4);
}

static int write_kv(const struct decoder *m, void *cache, const float *src, int64_t rows, int64_t stride,
                    const int64_t *slots)
{
    const int64_t n = m->kv_heads * m->head_dim;
    for (int64_t t = 0; t < rows; t++) {
        if (m->kv_type == KV_TYPE_Q8_0) {
#if HAVE_FLOAT16
            quantize_q8_0(src + t * stride, (uint8_t *)cache + (size_t)slots[t] * kv_row_bytes(m), n);
#else
            return -1;
#endif
        } else if (m->kv_type == KV_TYPE_F16) {
#if HAVE_FLOAT16
            _Float16 *dst = (_Float16 *)cache + slots[t] * n;
            for (int64_t i = 0; i < n; i++)
                dst[i] = (_Float16)src[t * stride + i];
#else
            return -1;
#endif
        } else {
            memcpy((float *)cache + slots[t] * n, src + t * stride, sizeof(float) * (size_t)n);
        }
    }
    return 0;
}

int decoder_layers_kv16(void) { return HAVE_FLOAT16; }

int decoder_layers(const struct decoder *m, float *h, int64_t rows, const int64_t *positions,
                   const int64_t *slots, void *k_cache, void *v_cache, const int64_t *tables,
                   int64_t table_width, const int64_t *lens, attention_kernel *attention, int threads)
{
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const size_t layer_bytes = (size_t)m->layer_slots * kv_row_bytes(m);
    float *scratch = malloc(sizeof(float) * (size_t)(rows * (m->hidden + qkv_size + q_size + 2 * m->intermediate)));
    if (!scratch)
        return -2;
    float *x = scratch, *qkv = x + rows * m->hidden, *attn = qkv + rows * qkv_size;
    float *gate = attn + rows * q_size, *up = gate + rows * m->intermediate;
    int status = 0;
    for (int64_t i = 0; i < m->num_layers && status == 0; i++) {
        const struct decoder_layer *l = &m->layers[i];
        void *kc = (uint8_t *)k_cache + (size_t)i * layer_bytes, *vc = (uint8_t *)v_cache + (size_t)i * layer_bytes;
        rms_norm_rows(h, l->attn_norm, x, rows, m->hidden, (float)m->eps);
        if ((status = run_linear(m, &l->qkv, x, NULL, qkv, rows, OP_NONE, threads)))
            break;
        rope_rows(qkv, rows, qkv_size, m->heads + m->kv_heads, m->head_dim, positions, m->cos, m->sin);
        if ((status = write_kv(m, kc, qkv + q_size, rows, qkv_size, slots)))
            break;
        if ((status = write_kv(m, vc, qkv + q_size + kv_size, rows, qkv_size, slots)))
            break;
        /* Global layers only: models with sliding-window layers decode op by op (native_decoder.py). */
        if (attention(qkv, qkv_size, attn, kc, vc, tables, table_width, lens, 0, rows, m->heads, m->kv_heads,
                      m->head_dim, m->block_size, m->scale, threads)) {
            status = -2;
            break;
        }
        if ((status = run_linear(m, &l->o, attn, h, h, rows, OP_ADD, threads)))
            break;
        rms_norm_rows(h, l->mlp_norm, x, rows, m->hidden, (float)m->eps);
        if ((status = run_linear(m, &l->gate, x, NULL, gate, rows, OP_SILU, threads)))
            break;
        if ((status = run_linear(m, &l->up, x, gate, up, rows, OP_MUL, threads)))
            break;
        status = run_linear(m, &l->down, up, h, h, rows, OP_ADD, threads);
    }
    free(scratch);
    return status;
}
