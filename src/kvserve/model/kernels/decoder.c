/* Every decoder layer of a step's decode rows in one call (loaded through ctypes by
 * kvserve/model/native_decoder.py).
 *
 * The same operations, in the same order, as the per-op path of transformer.py with these kernels:
 * rms_norm_rows; the qkv product (its bias included); the q and k heads' norms where the layer has them;
 * rope on the first rotary_dim dimensions of q and k with the layer's tables, none on a NoPE layer (x1 *
 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded: no contraction in this library); the K/V
 * write into the layer's paged cache (float32, rounded to float16 to nearest even as torch rounds, or
 * quantized to q8_0 as kv_quant.py does); the attention kernel over the layer's group (called through
 * the pointer the caller passes, from the attention library), with the layer's window; the o product plus
 * the residual, or, with a post-attention norm, the residual plus the normed product; rms_norm_rows; the
 * MLP: the gate product with silu or gelu(tanh) (gelu_tanh_rows, which the per-op path calls too), the up
 * product times it, the down product plus the residual (or plus its normed output); or the experts
 * (moe_route, then each chosen expert on the rows that chose it, weighted, summed by rank, plus the
 * residual). So a row's bits are those of the per-op path, and as batch-invariant. What it saves is the
 * per-op calls between the products. */
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
    return quant_linear(l, x, other, out, rows, op, threads, 0, (int)m->q16);
}

/* Rotates pairs (i, i + rot / 2) of the first `rot` dimensions of each head; the rest pass through. */
static void rope_rows(float *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t dim, int64_t rot,
                      const int64_t *positions, const float *cos_t, const float *sin_t)
{
    const int64_t half = rot / 2;
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

void gelu_tanh_rows(const float *x, float *out, int64_t n)
{
    /* torch's constants: sqrt(2) * (2 / sqrt(pi)) * 0.5 and 0.044715. */
    const float beta = (float)(1.41421356237309504880 * 1.12837916709551257390 * 0.5), kappa = 0.044715f;
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i], cube = v * v * v, inner = beta * (v + kappa * cube);
        out[i] = 0.5f * v * (1.0f + tanhf(inner));
    }
}

/* x . w over n, in eight interleaved partial sums combined pairwise: a fixed order (the compiler may
 * vectorize the eight lanes, it may not reorder them), the same bits on every machine. */
static float dot(const float *x, const float *w, int64_t n)
{
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += x[i + j] * w[i + j];
    for (int j = 0; i < n; i++, j++)
        acc[j] += x[i] * w[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

int moe_route(const float *x, const float *router, int64_t rows, int64_t hidden, int64_t experts, int64_t top_k,
              int norm_topk, int64_t *chosen, float *weights)
{
    if (top_k < 1 || top_k > experts)
        return -1;
    float *p = malloc(sizeof(float) * (size_t)experts);
    unsigned char *taken = malloc((size_t)experts);
    if (!p || !taken) {
        free(p);
        free(taken);
        return -2;
    }
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * hidden;
        float max = -INFINITY, sum = 0;
        for (int64_t e = 0; e < experts; e++) {
            p[e] = dot(xt, router + e * hidden, hidden);
            max = p[e] > max ? p[e] : max;
        }
        for (int64_t e = 0; e < experts; e++) {
            p[e] = expf(p[e] - max);
            sum += p[e];
        }
        for (int64_t e = 0; e < experts; e++) {
            p[e] /= sum;
            taken[e] = 0;
        }
        float total = 0;
        for (int64_t r = 0; r < top_k; r++) {
            /* The first expert not taken, then any strictly more probable one: ties go to the lower id
             * and a NaN is never preferred. */
            int64_t best = 0;
            while (taken[best])
                best++;
            for (int64_t e = best + 1; e < experts; e++)
                if (!taken[e] && p[e] > p[best])
                    best = e;
            taken[best] = 1;
            chosen[t * top_k + r] = best;
            weights[t * top_k + r] = p[best];
            total += p[best];
        }
        if (norm_topk)
            for (int64_t r = 0; r < top_k; r++)
                weights[t * top_k + r] /= total;
    }
    free(p);
    free(taken);
    return 0;
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

/* down(act(gate(x)) * up(x)) over `rows` rows into out, plus `other` with OP_ADD; g and u hold the gate's
 * and up's outputs. */
static int gated_mlp(const struct decoder *m, int64_t act, const struct qlinear *gate, const struct qlinear *up,
                     const struct qlinear *down, const float *x, int64_t rows, float *g, float *u,
                     const float *other, float *out, int op, int threads)
{
    int status;
    if (act == ACT_SILU) {
        if ((status = run_linear(m, gate, x, NULL, g, rows, OP_SILU, threads)))
            return status;
    } else if (act == ACT_GELU_TANH) {
        if ((status = run_linear(m, gate, x, NULL, g, rows, OP_NONE, threads)))
            return status;
        gelu_tanh_rows(g, g, rows * gate->n_out);
    } else {
        return -1;
    }
    if ((status = run_linear(m, up, x, g, u, rows, OP_MUL, threads)))
        return status;
    return run_linear(m, down, u, other, out, rows, op, threads);
}

/* Scratch of the experts' block: the routing, the rows gathered for one expert and their outputs, and
 * every (row, rank) pair's weighted output. */
struct moe_scratch {
    int64_t *chosen, *pairs;
    float *weights, *gathered, *expert_out, *by_pair;
};

/* The experts' output (not yet added to the residual) of x [rows, hidden] into out, in moe.py's order: each
 * chosen expert once, on the rows that chose it in row order; its outputs times the row's routing weight;
 * each row's experts summed by rank. */
static int experts_block(const struct decoder *m, const struct decoder_layer *l, const float *x, int64_t rows,
                         float *out, float *g, float *u, const struct moe_scratch *s, int threads)
{
    const int64_t k = l->top_k, hidden = m->hidden, pairs = rows * k;
    int status = moe_route(x, l->router, rows, hidden, l->experts, k, (int)l->norm_topk, s->chosen, s->weights);
    if (status)
        return status;
    for (int64_t e = 0; e < l->experts; e++) {
        int64_t n = 0;
        for (int64_t p = 0; p < pairs; p++)
            if (s->chosen[p] == e) {
                s->pairs[n] = p;
                memcpy(s->gathered + n * hidden, x + (p / k) * hidden, sizeof(float) * (size_t)hidden);
                n++;
            }
        if (!n)
            continue;
        const struct qlinear *products = l->expert_products + 3 * e;
        if ((status = gated_mlp(m, l->act, &products[0], &products[1], &products[2], s->gathered, n, g, u, NULL,
                                s->expert_out, OP_NONE, threads)))
            return status;
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = s->pairs[i];
            const float w = s->weights[p];
            for (int64_t j = 0; j < hidden; j++)
                s->by_pair[p * hidden + j] = s->expert_out[i * hidden + j] * w;
        }
    }
    for (int64_t t = 0; t < rows; t++) {
        float *o = out + t * hidden;
        memcpy(o, s->by_pair + t * k * hidden, sizeof(float) * (size_t)hidden);
        for (int64_t r = 1; r < k; r++)
            for (int64_t j = 0; j < hidden; j++)
                o[j] += s->by_pair[(t * k + r) * hidden + j];
    }
    return 0;
}

static void add_rows(float *h, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        h[i] = h[i] + y[i];
}

/* h += rms_norm(y) (a post norm before the residual add); y is normed in place. */
static void add_normed(const struct decoder *m, float *h, float *y, const float *norm, int64_t rows)
{
    rms_norm_rows(y, norm, y, rows, m->hidden, (float)m->eps);
    add_rows(h, y, rows * m->hidden);
}

/* The widest MLP hidden size and the most experts any layer chooses per row, for the scratch. */
static void mlp_extent(const struct decoder *m, int64_t *inter, int64_t *top_k)
{
    *inter = 0;
    *top_k = 0;
    for (int64_t i = 0; i < m->num_layers; i++) {
        const struct decoder_layer *l = &m->layers[i];
        if (l->experts > 0) {
            for (int64_t e = 0; e < l->experts; e++)
                *inter = l->expert_products[3 * e].n_out > *inter ? l->expert_products[3 * e].n_out : *inter;
            *top_k = l->top_k > *top_k ? l->top_k : *top_k;
        } else {
            *inter = l->gate.n_out > *inter ? l->gate.n_out : *inter;
        }
    }
}

int decoder_layers(const struct decoder *m, float *h, int64_t rows, const int64_t *positions,
                   const int64_t *slots, const int64_t *tables, int64_t table_width, const int64_t *sliding_slots,
                   const int64_t *sliding_tables, int64_t sliding_width, const int64_t *lens,
                   attention_kernel *attention, int threads)
{
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t q_size = m->heads * dim, kv_size = m->kv_heads * dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (m->rotary_dim < 0 || m->rotary_dim > dim || m->rotary_dim % 2)
        return -1;
    int64_t inter, top_k;
    mlp_extent(m, &inter, &top_k);
    const int64_t pairs = rows * top_k;
    /* x, y: normed rows and a product's output before its post norm; then qkv, attention, gate, up; then
     * the experts' gathered rows, their outputs and the pairs' outputs. */
    const size_t floats = (size_t)(rows * (2 * hidden + qkv_size + q_size + 2 * inter) +
                                   (top_k ? rows * hidden * 2 + pairs * hidden + pairs : 0));
    float *scratch = malloc(sizeof(float) * floats);
    int64_t *indices = malloc(sizeof(int64_t) * (size_t)(2 * pairs + 1));
    if (!scratch || !indices) {
        free(scratch);
        free(indices);
        return -2;
    }
    float *x = scratch, *y = x + rows * hidden, *qkv = y + rows * hidden, *attn = qkv + rows * qkv_size;
    float *gate = attn + rows * q_size, *up = gate + rows * inter;
    struct moe_scratch moe = {indices, indices + pairs, NULL, NULL, NULL, NULL};
    if (top_k) {
        moe.gathered = up + rows * inter;
        moe.expert_out = moe.gathered + rows * hidden;
        moe.by_pair = moe.expert_out + rows * hidden;
        moe.weights = moe.by_pair + pairs * hidden;
    }
    int status = 0;
    for (int64_t i = 0; i < m->num_layers && status == 0; i++) {
        const struct decoder_layer *l = &m->layers[i];
        const int64_t *s = l->window ? sliding_slots : slots, *tab = l->window ? sliding_tables : tables;
        const int64_t width = l->window ? sliding_width : table_width;
        rms_norm_rows(h, l->attn_norm, x, rows, hidden, (float)m->eps);
        if ((status = run_linear(m, &l->qkv, x, NULL, qkv, rows, OP_NONE, threads)))
            break;
        if (l->q_norm && l->k_norm)
            for (int64_t t = 0; t < rows; t++) {
                float *qt = qkv + t * qkv_size;
                rms_norm_rows(qt, l->q_norm, qt, m->heads, dim, (float)m->eps);
                rms_norm_rows(qt + q_size, l->k_norm, qt + q_size, m->kv_heads, dim, (float)m->eps);
            }
        if (l->cos && l->sin)
            rope_rows(qkv, rows, qkv_size, m->heads + m->kv_heads, dim, m->rotary_dim, positions, l->cos, l->sin);
        if ((status = write_kv(m, l->k_cache, qkv + q_size, rows, qkv_size, s)))
            break;
        if ((status = write_kv(m, l->v_cache, qkv + q_size + kv_size, rows, qkv_size, s)))
            break;
        if (attention(qkv, qkv_size, attn, l->k_cache, l->v_cache, tab, width, lens, l->window, rows, m->heads,
                      m->kv_heads, dim, m->block_size, m->scale, NULL, threads)) {
            status = -2;
            break;
        }
        if (l->post_attn_norm) {
            if ((status = run_linear(m, &l->o, attn, NULL, y, rows, OP_NONE, threads)))
                break;
            add_normed(m, h, y, l->post_attn_norm, rows);
        } else if ((status = run_linear(m, &l->o, attn, h, h, rows, OP_ADD, threads))) {
            break;
        }
        rms_norm_rows(h, l->mlp_norm, x, rows, hidden, (float)m->eps);
        if (l->experts > 0) {
            if ((status = experts_block(m, l, x, rows, y, gate, up, &moe, threads)))
                break;
            if (l->post_mlp_norm)
                add_normed(m, h, y, l->post_mlp_norm, rows);
            else
                add_rows(h, y, rows * hidden);
        } else if (l->post_mlp_norm) {
            if ((status = gated_mlp(m, l->act, &l->gate, &l->up, &l->down, x, rows, gate, up, NULL, y, OP_NONE,
                                    threads)))
                break;
            add_normed(m, h, y, l->post_mlp_norm, rows);
        } else {
            status = gated_mlp(m, l->act, &l->gate, &l->up, &l->down, x, rows, gate, up, h, h, OP_ADD, threads);
        }
    }
    free(scratch);
    free(indices);
    return status;
}
