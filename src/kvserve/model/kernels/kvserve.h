/* The interface between the kernels and Python (kvserve/model/kernel_abi.py declares the same in ctypes).
 *
 * Two libraries are built from these sources (kernel_abi.py lists which files go into each, with their
 * flags): the products and decoder layers, compiled without -ffast-math so that every float operation
 * stays as written, and paged attention, compiled with it. Both export kvserve_abi_version and
 * kvserve_struct_sizes, which Python compares with its own definitions before it binds a symbol: a change
 * here that kernel_abi.py does not follow is refused at load instead of corrupting memory. Any change to a
 * struct, a signature or a constant below bumps KVSERVE_ABI_VERSION here and ABI_VERSION there.
 */
#ifndef KVSERVE_H
#define KVSERVE_H

#include <stdint.h>

#define KVSERVE_ABI_VERSION 9

/* The weight types the products read: ggml's type ids (quants.h and decode.h hold the layouts). */
enum {
    TYPE_F32 = 0,
    TYPE_F16 = 1,
    TYPE_Q4_0 = 2,
    TYPE_Q4_1 = 3,
    TYPE_Q5_0 = 6,
    TYPE_Q5_1 = 7,
    TYPE_Q8_0 = 8,
    TYPE_Q2_K = 10,
    TYPE_Q3_K = 11,
    TYPE_Q4_K = 12,
    TYPE_Q5_K = 13,
    TYPE_Q6_K = 14,
    TYPE_IQ4_NL = 20,
    TYPE_IQ4_XS = 23,
    TYPE_BF16 = 30,
    TYPE_MXFP4 = 39,
    TYPE_COUNT = 40
};
/* The op quant_linear applies to each output after the bias. */
enum { OP_NONE = 0, OP_ADD = 1, OP_MUL = 2 };
/* Outputs a column tile computes together, reading their rows side by side. */
#define COL_TILE 4
/* The most parts one product holds (q, k and v of three types). */
#define QLINEAR_PARTS 4

/* ---- Both libraries ---- */

int kvserve_abi_version(void);
/* Writes the sizes of struct qlinear, struct mixer, struct decoder_layer and struct decoder, in that
 * order, into sizes[0, n) and returns how many structs there are (4), whatever n. */
int kvserve_struct_sizes(int64_t *sizes, int n);

/* ---- Paged attention (paged_attention.c), for prefill and decode rows alike ----
 *
 * q: rows of [heads, dim], `q_stride` elements apart; out: [rows, heads, dim] contiguous; k_cache and
 * v_cache: [slots, kv_heads, dim] (slot = block * block_size + offset); tables: row r's block ids from
 * tables + r * table_stride (0: every row reads one table, as a prefill chunk's tokens do); lens: [rows]
 * context lengths, each >= 1; window: 0, or the positions a row attends to, its own and the window - 1
 * before it (a sliding-window layer: a row of length n reads positions [n - window, n) only, and never a
 * block wholly before them, whose table entry may be anything). Returns 0, or -1 when scratch memory could not be allocated. The element
 * types are the symbol's: float or double rows, a cache of the same type, of _Float16 under float, or of
 * q8_0 blocks (`_q8`: each position's row is kv_heads * dim / 32 blocks of a float16 scale and 32 int8
 * quants, 34 bytes, llama.cpp's block_q8_0; dim a multiple of 32). sinks: NULL, or each head's sink logit
 * [heads] (gpt-oss), which joins the softmax's max and denominator and attends to nothing. */
typedef int attention_kernel(const void *q, int64_t q_stride, void *out, const void *k_cache,
                             const void *v_cache, const int64_t *tables, int64_t table_stride,
                             const int64_t *lens, int64_t window, int64_t rows, int64_t heads, int64_t kv_heads,
                             int64_t dim, int64_t block_size, double scale, const float *sinks, int threads);

attention_kernel paged_attention_f32;
attention_kernel paged_attention_f64;
/* Only where the compiler has _Float16; Python then finds no symbol and refuses a float16 cache. */
attention_kernel paged_attention_f32_kv16;
attention_kernel paged_attention_f32_q8;
attention_kernel paged_attention_f64_q8;

/* ---- Products on quantized blocks (matmul.c) ---- */

/* One part of a product: n_out rows of n_in weights of `type`, row o at w + o * row bytes (row bytes =
 * n_in / elements per block * block bytes: the file's own layout, read in place and never written);
 * bias: [n_out] or NULL. */
struct qpart {
    int64_t type;
    const uint8_t *w;
    const float *bias;
    int64_t n_out;
};

/* A product of up to QLINEAR_PARTS parts over the same inputs, their outputs side by side (q, k and v of
 * different types in one call); n_out is the parts' total. */
struct qlinear {
    int64_t n_parts, n_in, n_out;
    struct qpart parts[QLINEAR_PARTS];
};

/* x: [rows, n_in] float32, contiguous; other: [rows, l->n_out] for OP_ADD and OP_MUL, else NULL; out:
 * [rows, l->n_out]. `int16` 1: every row runs with int16 activations (the float types' parts: float32
 * always); 0: float32 activations. `portable` 1 forces the portable path, 2 the AVX2 tiles without the AVX-512 ones (for
 * tests). Returns 0, -1 for an unknown type or shape, -2 when out of memory. */
int quant_linear(const struct qlinear *l, const float *x, const float *other, float *out, int64_t rows, int op,
                 int threads, int portable, int int16);
/* 1 when this build has the AVX2 path. */
int quant_linear_vectorized(void);
/* Rows index[0, n) of a [n_rows, n_in] matrix of `type` (layout as struct qpart's) dequantized into out
 * [n, n_in] as float32, bit for bit the values of ggml's dequantization. Returns 0, or -1 for an unknown
 * type, a shape or an index out of range. */
int dequantize_rows(int type, const uint8_t *w, int64_t n_rows, int64_t n_in, const int64_t *index, int64_t n,
                    float *out, int threads);
/* 1 when the products read `type`. */
int quant_type_supported(int type);

/* ---- Decoder layers (decoder.c) ---- */

/* The gated MLP's activation (`act`): silu (silu_rows), gelu with the tanh approximation (gelu_tanh_rows),
 * or gpt-oss's clamped SwiGLU (clamped_swiglu_rows, with the layer's alpha and limit). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_CLAMPED_SWIGLU = 2 };
/* A layer's token mixer (`mixer_kind`): attention over the KV cache, LFM2's gated short convolution, or
 * Qwen3.5's Gated DeltaNet. */
enum { MIXER_ATTENTION = 0, MIXER_SHORT_CONV = 1, MIXER_DELTANET = 2 };

/* A recurrent layer's decode step past its input products (mixer_rows): the kind, the convolution over
 * `channels` with `kernel` taps, conv [channels, kernel] and its bias (NULL: none); for the DeltaNet its
 * heads (value head h reads key head h % k_heads where `tiled`, else h / (v_heads / k_heads)), the decay
 * A [v_heads] (negative), dt_bias [v_heads], the gated norm's weight [v_dim] and its eps. */
struct mixer {
    int64_t kind, channels, kernel;
    const float *conv, *conv_bias;
    int64_t k_heads, v_heads, k_dim, v_dim, tiled;
    const float *decay, *dt_bias, *norm;
    double eps;
};

struct decoder_layer {
    const float *attn_norm, *mlp_norm;
    /* NULL where the layer has none: RMSNorms over each q and k head (head_dim wide, before rope), and the
     * norms of the attention's and the MLP's outputs before their residual adds (Gemma 3). */
    const float *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    /* The layer's rope tables [positions, rotary_dim / 2]; NULL: a NoPE layer. */
    const float *cos, *sin;
    /* The layer's K and V caches [slots, kv_heads, head_dim] (the cache's kv_type), in its group. */
    void *k_cache, *v_cache;
    /* 0: a global layer; else its sliding window, over the sliding group's slots and tables. */
    int64_t window;
    /* ACT_*: the dense MLP's or the experts' activation; alpha and limit: ACT_CLAMPED_SWIGLU's. */
    int64_t act;
    double alpha, limit;
    /* Each query head's sink logit [heads] (gpt-oss), NULL: none. */
    const float *sinks;
    /* 1: q's product holds, per head, the query's head_dim rows then as many of an output gate, and the
     * attention's output is multiplied by sigmoid(gate) (Qwen3.5; gate_rows). */
    int64_t output_gate;
    struct qlinear qkv, o;
    /* The dense MLP's products (unused where experts > 0). */
    struct qlinear gate, up, down;
    /* A mixture of experts where experts > 0 (moe_route, then each chosen expert's gated MLP): router
     * [experts, hidden] float32 and its bias [experts] (NULL: none); expert_products [experts * 3]: each
     * expert's gate, up and down. A shared expert beside them where shared_gate is not NULL: the dense
     * MLP's products, its output scaled by sigmoid(x . shared_gate) (shared_expert_rows). */
    int64_t experts, top_k, norm_topk;
    const float *router, *router_bias;
    const struct qlinear *expert_products;
    const float *shared_gate;
    /* A recurrent layer (mixer.kind != MIXER_ATTENTION): qkv is its input product (LFM2's in_proj, the
     * DeltaNet's in_proj_qkv), o its out_proj; z, beta and dt the DeltaNet's in_proj_z, in_proj_b and
     * in_proj_a; conv_state and delta_state the state pool's tensors, indexed by the rows' state slots. */
    struct mixer mixer;
    struct qlinear z, beta, dt;
    float *conv_state, *delta_state;
};

/* The decoder layers' KV cache formats (`kv_type`). */
enum { KV_TYPE_F32 = 0, KV_TYPE_F16 = 1, KV_TYPE_Q8_0 = 2 };

struct decoder {
    /* rotary_dim: the dimensions of a head that rotate (the first ones; the rest pass through). */
    int64_t num_layers, hidden, heads, kv_heads, head_dim, rotary_dim, block_size;
    /* The caches' KV_TYPE_*. */
    int64_t kv_type;
    /* 1: the products take the rows with int16 activations (quant_linear's `int16`). */
    int64_t q16;
    double eps, scale;
    const struct decoder_layer *layers;
};

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, row by row. */
void rms_norm_rows(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps);
/* out[i] = 0.5 * x[i] * (1 + tanh(sqrt(2 / pi) * (x[i] + 0.044715 * x[i]^3))), torch's gelu(tanh) formula
 * (out may be x), computed as activation.h says. The per-op path calls it too, so both paths' activation
 * is this one function. `portable` as quant_linear's: 1 the portable path, 2 AVX2 without AVX-512 (for
 * tests); every path gives the same bits. */
void gelu_tanh_rows(const float *x, float *out, int64_t n, int threads, int portable);
/* out[i] = x[i] / (1 + exp(-x[i])), torch's silu, as gelu_tanh_rows (the gated MLP's silu after the gate
 * product on both paths). */
void silu_rows(const float *x, float *out, int64_t n, int threads, int portable);
/* A mixture of experts' routing of rows x [rows, hidden]: logits x . router[e] (router [experts, hidden]),
 * each summed over its own row in a fixed order; their softmax; the top_k experts, highest probability
 * first and the lower id on ties, into chosen [rows, top_k]; their probabilities into weights [rows,
 * top_k], divided by their sum where norm_topk. The per-op path (moe.py) calls it too. Returns 0, -1 for a
 * top_k not in [1, experts], -2 when out of memory. */
int moe_route(const float *x, const float *router, const float *bias, int64_t rows, int64_t hidden, int64_t experts,
              int64_t top_k, int norm_topk, int64_t *chosen, float *weights);
/* gpt-oss's expert activation, in place in up [n]: (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g))
 * with g = min(gate, limit); the per-op path (mlp.ClampedSwiGlu) calls it too. */
void clamped_swiglu_rows(const float *gate, float *up, int64_t n, float alpha, float limit);
/* x[i] *= sigmoid(gate[i]) over n (Qwen3.5's attention output gate; the per-op path calls it too). */
void gate_rows(float *x, const float *gate, int64_t n);
/* A shared expert's share, in place in routed [rows, hidden]: routed + shared * sigmoid(x . gate), the
 * logit summed over its row alone as moe_route's; the per-op path (shared_expert.py) calls it too. */
void shared_expert_rows(float *routed, const float *shared, const float *x, const float *gate, int64_t rows,
                        int64_t hidden);
/* A recurrent layer's step for `rows` one-token sequences, row r in state slot slots[r] (distinct), each
 * slot updated in place. Short conv: in [rows, 3 * channels] (B, C, x) -> out [rows, channels], C times
 * the convolution of B * x over the slot's window. DeltaNet: in [rows, channels] (q, k, v before the
 * convolution), z [rows, v_heads * v_dim], b and a [rows, v_heads] -> out [rows, v_heads * v_dim], the
 * gated RMSNorm of the delta rule's output. conv_state [slots, channels, kernel - 1], delta_state [slots,
 * v_heads, k_dim, v_dim]. Both paths call it for their one-row sequences. Returns 0, -1 for a refused
 * shape, -2 when out of memory. */
int mixer_rows(const struct mixer *mx, float *conv_state, float *delta_state, const float *in, const float *z,
               const float *b, const float *a, int64_t rows, const int64_t *slots, float *out, int threads);
/* h: [rows, hidden] hidden states of decode rows, updated in place through every layer. positions, slots,
 * state_slots (each row's recurrent state slot, distinct; NULL without recurrent layers): [rows]; tables
 * [rows, table_width] and lens [rows] as `attention` takes them, for the global layers;
 * sliding_slots and sliding_tables [rows, sliding_width] the same rows in the sliding layers' group
 * (the global ones where both groups share their ids). Returns 0, -1 for a refused shape or type, -2
 * when out of memory. */
int decoder_layers(const struct decoder *m, float *h, int64_t rows, const int64_t *positions,
                   const int64_t *slots, const int64_t *tables, int64_t table_width, const int64_t *sliding_slots,
                   const int64_t *sliding_tables, int64_t sliding_width, const int64_t *lens,
                   const int64_t *state_slots, attention_kernel *attention, int threads);
/* 1 when this build can write a float16 or q8_0 cache (both need the compiler's _Float16). */
int decoder_layers_kv16(void);

#endif
