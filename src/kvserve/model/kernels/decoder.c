/* Every decoder layer of a step's decode rows in one call (loaded through ctypes by
 * kvserve/model/native_decoder.py).
 *
 * The same operations, in the same order, as the per-op path of transformer.py with these kernels:
 * rms_norm_rows; the qkv product (its bias included); the q and k heads' norms where the layer has them;
 * rope on the first rotary_dim dimensions of q and k with the layer's tables, none on a NoPE layer (x1 *
 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded: no contraction in this library); the K/V
 * write into the layer's paged cache (float32, rounded to float16 to nearest even as torch rounds, or
 * quantized to q8_0 as kv_quant.py does); the attention kernel over the layer's group (called through
 * the pointer the caller passes, from the attention library), with the layer's window and sinks; the
 * output gate (gate_rows) where the layer has one; the o product plus the residual, or, with a
 * post-attention norm, the residual plus the normed product; rms_norm_rows; the MLP: the gate product,
 * then silu or gelu(tanh) (silu_rows, gelu_tanh_rows: the per-op path calls them too), the up product
 * times it, the down product plus the residual (or plus its normed output); or the experts
 * (moe_route, then each chosen expert on the rows that chose it, weighted, summed by rank, plus the
 * residual), with a router bias, the clamped SwiGLU or a shared expert where the layer has them. A
 * recurrent layer runs its input products, mixer_rows (the one-row step both paths call: the convolution
 * over the slot's window, LFM2's gates or the DeltaNet's l2 norms, gates, delta rule and gated norm, the
 * slot updated in place) and its out product plus the residual. So a row's bits are those of the per-op
 * path, and as batch-invariant. Everything here is plain C, each sum in a fixed order: the same bits on
 * every machine (the gelu's vector paths, activation.c, give its portable bits). What it saves is the
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

int moe_route(const float *x, const float *router, const float *bias, int64_t rows, int64_t hidden, int64_t experts,
              int64_t top_k, int norm_topk, int64_t *chosen, float *weights)
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
            if (bias)
                p[e] = p[e] + bias[e];
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

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

void clamped_swiglu_rows(const float *gate, float *up, int64_t n, float alpha, float limit)
{
    for (int64_t i = 0; i < n; i++) {
        /* As torch's clamps: a NaN stays a NaN. */
        const float g = gate[i] > limit ? limit : gate[i];
        const float u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        up[i] = (u + 1.0f) * (g * sigmoidf(g * alpha));
    }
}

void gate_rows(float *x, const float *gate, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] * sigmoidf(gate[i]);
}

void shared_expert_rows(float *routed, const float *shared, const float *x, const float *gate, int64_t rows,
                        int64_t hidden)
{
    for (int64_t t = 0; t < rows; t++) {
        const float scale = sigmoidf(dot(x + t * hidden, gate, hidden));
        for (int64_t j = 0; j < hidden; j++)
            routed[t * hidden + j] = routed[t * hidden + j] + shared[t * hidden + j] * scale;
    }
}

/* torch's softplus (beta 1, threshold 20). */
static float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* One channel's convolution over its window (the slot's kernel - 1 inputs, oldest first, then `input`),
 * taps summed in order; the window then moves on by `input`. */
static float conv_step(float *window, const float *taps, int64_t kernel, float input)
{
    const int64_t held = kernel - 1;
    float acc = (held ? window[0] : input) * taps[0];
    for (int64_t i = 1; i < kernel; i++)
        acc = acc + (i < held ? window[i] : input) * taps[i];
    for (int64_t i = 0; i + 1 < held; i++)
        window[i] = window[i + 1];
    if (held)
        window[held - 1] = input;
    return acc;
}

/* The delta rule on one value head's state s [k_dim, v_dim] for one token, and its gated RMSNorm: s <-
 * exp(g) s; s <- s + k (beta (v - s^T k))^T; o = s^T q; out = rms_norm(o) * norm * silu(z). `scratch`
 * holds 3 * v_dim floats. Each sum runs over k_dim in index order. */
static void delta_head(const struct mixer *mx, float *s, const float *q, const float *k, const float *v,
                       const float *z, float beta, float decay, float *out, float *scratch)
{
    const int64_t dk = mx->k_dim, dv = mx->v_dim;
    float *predicted = scratch, *written = scratch + dv, *o = scratch + 2 * dv;
    for (int64_t j = 0; j < dv; j++)
        predicted[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j++) {
            row[j] = row[j] * decay;
            predicted[j] = predicted[j] + k[i] * row[j];
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        written[j] = (v[j] - predicted[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j++) {
            row[j] = row[j] + k[i] * written[j];
            o[j] = o[j] + q[i] * row[j];
        }
    }
    rms_norm_rows(o, mx->norm, o, 1, dv, (float)mx->eps);
    for (int64_t j = 0; j < dv; j++)
        out[j] = o[j] * (z[j] * sigmoidf(z[j]));
}

/* x [n] / sqrt(sum(x^2) + eps) * scale, the sum in index order. */
static void l2_normalize(float *x, int64_t n, float scale)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++)
        ss = ss + x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] * inv * scale;
}

int mixer_rows(const struct mixer *mx, float *conv_state, float *delta_state, const float *in, const float *z,
               const float *b, const float *a, int64_t rows, const int64_t *slots, float *out, int threads)
{
    const int64_t ch = mx->channels, held = mx->kernel - 1;
    if (mx->kernel < 1 || ch < 1 || !conv_state)
        return -1;
    if (mx->kind == MIXER_SHORT_CONV) {
        for (int64_t t = 0; t < rows; t++) {
            const float *bcx = in + t * 3 * ch;
            float *window = conv_state + slots[t] * ch * held;
            for (int64_t c = 0; c < ch; c++) {
                const float bx = bcx[c] * bcx[2 * ch + c];
                float conv = conv_step(window + c * held, mx->conv + c * mx->kernel, mx->kernel, bx);
                if (mx->conv_bias)
                    conv = conv + mx->conv_bias[c];
                out[t * ch + c] = bcx[ch + c] * conv;
            }
        }
        return 0;
    }
    if (mx->kind != MIXER_DELTANET)
        return -1;
    const int64_t kh = mx->k_heads, vh = mx->v_heads, dk = mx->k_dim, dv = mx->v_dim, key = kh * dk;
    if (kh < 1 || vh % kh || ch != 2 * key + vh * dv || !delta_state)
        return -1;
    float *mixed = malloc(sizeof(float) * (size_t)(ch + vh * 3 * dv));
    if (!mixed)
        return -2;
    float *scratch = mixed + ch;
    const float scale = (float)(1.0 / sqrt((double)dk));
    const int64_t per_key = vh / kh;
    for (int64_t t = 0; t < rows; t++) {
        float *window = conv_state + slots[t] * ch * held;
        for (int64_t c = 0; c < ch; c++) {
            float conv = conv_step(window + c * held, mx->conv + c * mx->kernel, mx->kernel, in[t * ch + c]);
            if (mx->conv_bias)
                conv = conv + mx->conv_bias[c];
            mixed[c] = conv * sigmoidf(conv);
        }
        for (int64_t h = 0; h < kh; h++) {
            l2_normalize(mixed + h * dk, dk, scale);
            l2_normalize(mixed + key + h * dk, dk, 1.0f);
        }
        float *states = delta_state + slots[t] * vh * dk * dv;
        const float *bt = b + t * vh, *at = a + t * vh;
#pragma omp parallel for schedule(static) num_threads(threads) if (vh * dk * dv >= 65536)
        for (int64_t h = 0; h < vh; h++) {
            const int64_t src = mx->tiled ? h % kh : h / per_key;
            const float beta = sigmoidf(bt[h]);
            const float decay = expf(mx->decay[h] * softplusf(at[h] + mx->dt_bias[h]));
            delta_head(mx, states + h * dk * dv, mixed + src * dk, mixed + key + src * dk, mixed + 2 * key + h * dv,
                       z + (t * vh + h) * dv, beta, decay, out + (t * vh + h) * dv, scratch + h * 3 * dv);
        }
    }
    free(mixed);
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

/* down(act(gate(x)) * up(x)) over `rows` rows into out, plus `other` with OP_ADD, with the layer's
 * activation (`l->act`; the clamped SwiGLU takes both products plain, then clamped_swiglu_rows); g and u
 * hold the gate's and up's outputs. */
static int gated_mlp(const struct decoder *m, const struct decoder_layer *l, const struct qlinear *gate,
                     const struct qlinear *up, const struct qlinear *down, const float *x, int64_t rows, float *g,
                     float *u, const float *other, float *out, int op, int threads)
{
    int status;
    if (l->act != ACT_SILU && l->act != ACT_GELU_TANH && l->act != ACT_CLAMPED_SWIGLU)
        return -1;
    if ((status = run_linear(m, gate, x, NULL, g, rows, OP_NONE, threads)))
        return status;
    if (l->act == ACT_SILU)
        silu_rows(g, g, rows * gate->n_out, threads, 0);
    else if (l->act == ACT_GELU_TANH)
        gelu_tanh_rows(g, g, rows * gate->n_out, threads, 0);
    if (l->act == ACT_CLAMPED_SWIGLU) {
        if ((status = run_linear(m, up, x, NULL, u, rows, OP_NONE, threads)))
            return status;
        clamped_swiglu_rows(g, u, rows * up->n_out, (float)l->alpha, (float)l->limit);
    } else if ((status = run_linear(m, up, x, g, u, rows, OP_MUL, threads))) {
        return status;
    }
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
 * each row's experts summed by rank; then a shared expert's share (shared_expert.py's order). */
static int experts_block(const struct decoder *m, const struct decoder_layer *l, const float *x, int64_t rows,
                         float *out, float *g, float *u, const struct moe_scratch *s, int threads)
{
    const int64_t k = l->top_k, hidden = m->hidden, pairs = rows * k;
    int status = moe_route(x, l->router, l->router_bias, rows, hidden, l->experts, k, (int)l->norm_topk, s->chosen,
                           s->weights);
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
        if ((status = gated_mlp(m, l, &products[0], &products[1], &products[2], s->gathered, n, g, u, NULL,
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
    if (l->shared_gate) {
        /* The shared expert (of the experts' activation) is the dense MLP's products. */
        if ((status = gated_mlp(m, l, &l->gate, &l->up, &l->down, x, rows, g, u, NULL, s->gathered, OP_NONE,
                                threads)))
            return status;
        shared_expert_rows(out, s->gathered, x, l->shared_gate, rows, hidden);
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
        }
        if (l->experts == 0 || l->shared_gate)
            *inter = l->gate.n_out > *inter ? l->gate.n_out : *inter;
    }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The widest outputs of the mixers' products over the layers: the input product (qkv, in_proj), the
 * mixer's output (o's input), z and the DeltaNet's b and a. */
struct extent {
    int64_t in, mixed, z, heads;
};

static struct extent mixer_extent(const struct decoder *m)
{
    struct extent e = {0, 0, 0, 0};
    for (int64_t i = 0; i < m->num_layers; i++) {
        const struct decoder_layer *l = &m->layers[i];
        e.in = max64(e.in, l->qkv.n_out);
        e.mixed = max64(e.mixed, l->o.n_in);
        if (l->mixer.kind == MIXER_DELTANET) {
            e.z = max64(e.z, l->z.n_out);
            e.heads = max64(e.heads, max64(l->beta.n_out, l->dt.n_out));
        }
    }
    return e;
}

/* The recurrent layer's token mixing of the normed rows x, plus the residual, into h. */
static int recurrent_layer(const struct decoder *m, const struct decoder_layer *l, float *h, const float *x,
                           int64_t rows, const int64_t *state_slots, float *in, float *mixed, float *z, float *b,
                           float *a, int threads)
{
    int status;
    if (!state_slots)
        return -1;
    if ((status = run_linear(m, &l->qkv, x, NULL, in, rows, OP_NONE, threads)))
        return status;
    if (l->mixer.kind == MIXER_DELTANET) {
        if ((status = run_linear(m, &l->z, x, NULL, z, rows, OP_NONE, threads)) ||
            (status = run_linear(m, &l->beta, x, NULL, b, rows, OP_NONE, threads)) ||
            (status = run_linear(m, &l->dt, x, NULL, a, rows, OP_NONE, threads)))
            return status;
    }
    if ((status = mixer_rows(&l->mixer, l->conv_state, l->delta_state, in, z, b, a, rows, state_slots, mixed,
                             threads)))
        return status;
    return run_linear(m, &l->o, mixed, h, h, rows, OP_ADD, threads);
}

/* A gated attention layer's product [rows, 2 * q_size + 2 * kv_size] (per head its query then its gate,
 * then k and v) into qkv [rows, q_size + 2 * kv_size] and gate [rows, q_size]. */
static void split_gate(const struct decoder *m, const float *raw, float *qkv, float *gate, int64_t rows)
{
    const int64_t dim = m->head_dim, q_size = m->heads * dim, kv_size = m->kv_heads * dim;
    const int64_t width = 2 * q_size + 2 * kv_size, qkv_size = q_size + 2 * kv_size;
    for (int64_t t = 0; t < rows; t++) {
        const float *r = raw + t * width;
        for (int64_t hd = 0; hd < m->heads; hd++) {
            memcpy(qkv + t * qkv_size + hd * dim, r + 2 * hd * dim, sizeof(float) * (size_t)dim);
            memcpy(gate + t * q_size + hd * dim, r + (2 * hd + 1) * dim, sizeof(float) * (size_t)dim);
        }
        memcpy(qkv + t * qkv_size + q_size, r + 2 * q_size, sizeof(float) * (size_t)(2 * kv_size));
    }
}

int decoder_layers(const struct decoder *m, float *h, int64_t rows, const int64_t *positions,
                   const int64_t *slots, const int64_t *tables, int64_t table_width, const int64_t *sliding_slots,
                   const int64_t *sliding_tables, int64_t sliding_width, const int64_t *lens,
                   const int64_t *state_slots, attention_kernel *attention, int threads)
{
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t q_size = m->heads * dim, kv_size = m->kv_heads * dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (m->rotary_dim < 0 || m->rotary_dim > dim || m->rotary_dim % 2)
        return -1;
    int64_t inter, top_k;
    mlp_extent(m, &inter, &top_k);
    const struct extent e = mixer_extent(m);
    const int64_t pairs = rows * top_k, wide = max64(e.in, qkv_size), mixed_width = max64(e.mixed, q_size);
    /* x, y: normed rows and a product's output before its post norm; raw: an input product's output (a
     * gated layer's or a mixer's), then qkv, the attention's or mixer's output, its gate, z, b and a,
     * gate and up; then the experts' gathered rows, their outputs and the pairs' outputs. */
    const size_t floats = (size_t)(rows * (2 * hidden + wide + qkv_size + mixed_width + q_size + e.z + 2 * e.heads +
                                           2 * inter) +
                                   (top_k ? rows * hidden * 2 + pairs * hidden + pairs : 0));
    float *scratch = malloc(sizeof(float) * floats);
    int64_t *indices = malloc(sizeof(int64_t) * (size_t)(2 * pairs + 1));
    if (!scratch || !indices) {
        free(scratch);
        free(indices);
        return -2;
    }
    float *x = scratch, *y = x + rows * hidden, *raw = y + rows * hidden, *qkv = raw + rows * wide;
    float *attn = qkv + rows * qkv_size, *out_gate = attn + rows * mixed_width, *zs = out_gate + rows * q_size;
    float *bs = zs + rows * e.z, *as = bs + rows * e.heads;
    float *gate = as + rows * e.heads, *up = gate + rows * inter;
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
        if (l->mixer.kind != MIXER_ATTENTION) {
            if ((status = recurrent_layer(m, l, h, x, rows, state_slots, raw, attn, zs, bs, as, threads)))
                break;
        } else {
            if (l->output_gate) {
                if (l->qkv.n_out != qkv_size + q_size) {
                    status = -1;
                    break;
                }
                if ((status = run_linear(m, &l->qkv, x, NULL, raw, rows, OP_NONE, threads)))
                    break;
                split_gate(m, raw, qkv, out_gate, rows);
            } else if ((status = run_linear(m, &l->qkv, x, NULL, qkv, rows, OP_NONE, threads))) {
                break;
            }
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
                          m->kv_heads, dim, m->block_size, m->scale, l->sinks, threads)) {
                status = -2;
                break;
            }
            if (l->output_gate)
                gate_rows(attn, out_gate, rows * q_size);
            if (l->post_attn_norm) {
                if ((status = run_linear(m, &l->o, attn, NULL, y, rows, OP_NONE, threads)))
                    break;
                add_normed(m, h, y, l->post_attn_norm, rows);
            } else if ((status = run_linear(m, &l->o, attn, h, h, rows, OP_ADD, threads))) {
                break;
            }
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
            if ((status = gated_mlp(m, l, &l->gate, &l->up, &l->down, x, rows, gate, up, NULL, y, OP_NONE, threads)))
                break;
            add_normed(m, h, y, l->post_mlp_norm, rows);
        } else {
            status = gated_mlp(m, l, &l->gate, &l->up, &l->down, x, rows, gate, up, h, h, OP_ADD, threads);
        }
    }
    free(scratch);
    free(indices);
    return status;
}
