/* Linear products on GGUF's weight types, read in place: the summation order that every path keeps, and
 * what the portable reference (quants.c), the x86 tiles (arch/x86/quants.c) and the threaded entry point
 * (matmul.c) share.
 *
 * out[t, o] = op(sum_i x[t, i] * w[o, i] + bias[o]). Row o of a matrix is where the file stores it, at
 * w + o * row_bytes; the kernels never copy nor write it. Every type is read as sub-blocks of 32 weights
 * (decode.h decodes one, per type, exactly as ggml's dequantization reads its fields): integer quants
 * q[32] (int8) with a float32 scale d and offset m per half (elements 0..15 and 16..31), the weight being
 * d * q + m; a type without offsets has m = 0. Q2_K, Q3_K and Q6_K have a scale per 16 (`split_scales`:
 * two halves); the others one per 32 (equal halves). The float types (F32, F16, BF16) decode to their
 * float values with d = 1 and m = 0.
 *
 * The weights are never requantized. Two orders, one per activation mode (quant_linear's `int16`):
 *
 * int16 (the default; every row of an integer type): each row's activations are quantized per block of
 * 32 (quants.c's `quantize_q16`: dx = max |x| / 32767, q = x * (32767 / max |x|) rounded to nearest even).
 * Per sub-block, the sum of weight quants times activation quants over the 32 (over each half for the
 * split_scales types) is exact in int32, so its order is free; an output's total takes (float) that sum
 * times (d * dx) by a fused multiply-add, sub-block after sub-block (the low half's, then the high
 * half's). One float chain per output and row: no lanes to add at the end.
 *
 * float32 (the exact mode, and every row of a float type): the quants are widened to float32 in
 * registers. Per sub-block, eight lanes l each sum q * x over elements 8k + l (k = 0..3: one multiply,
 * then three fused multiply-adds) and a lane's running total takes d times that sum by a fused
 * multiply-add; with a scale per 16 each half is summed apart (k = 0, 1 and k = 2, 3) and the total takes
 * d0 times the low sum, then d1 times the high one. At the end the lanes are added in one fixed tree.
 *
 * In both, the offset term, m times the sum of x over the 32 (or over each half, low first, for Q2_K's
 * offsets per 16), is summed apart in sub-block order and added last; the activations' sums per 32 and
 * per 16 are computed once per product. That order is the same for every output of every row, whatever
 * the batch, the tile it falls in, the thread count or the instruction set: a row's output is bitwise
 * independent of the rest of its batch, and the AVX2, AVX-512 and portable paths give the same bits
 * (tests/model/test_quant_blocks_native_kernel.py checks them). The library is compiled without
 * -ffast-math and with -ffp-contract=off so that the compiler keeps exactly these operations.
 */
#ifndef KVSERVE_QUANTS_H
#define KVSERVE_QUANTS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "kvserve.h"

#define QK 32
#define QK_K 256
/* Rows per tile of one output: the float tiles take FLOAT_ROW_TILE (a vector of eight rows' offset terms),
 * then ROW_TILE. */
#define ROW_TILE 4
#define FLOAT_ROW_TILE 8
/* Column tiles a thread takes at a time: 64 outputs at least, enough to amortize the hand-off; up to about
 * RUN_BYTES of weights while each thread keeps RUNS_PER_THREAD runs (matmul.c:run_tiles). */
#define CHUNK_TILES 16
#define RUN_BYTES (1 << 20)
#define RUNS_PER_THREAD 4
/* The most threads a product splits among (each keeps a counter on the stack). */
#define MAX_THREADS 256
#define ROW_CHUNK 48
/* Activation bytes a row chunk of the AVX2 tiles may take: they are read again for every output, so they
 * should stay in the L1 data cache (32-48 KiB) beside the blocks. */
#define L1_ROWS_BYTES 24576
/* int16 activations keep 15 bits of each block's largest value. */
#define Q16_MAX 32767.0f
/* int16 rows are taken Q16_GROUP at a time (one row per lane) from Q16_GROUP_MIN rows on: their quants
 * are then also laid out by group (`struct product`'s xt) and the rows padded to a whole group. Fewer rows
 * (and up to Q16_FEW_ROWS rows past the last whole group) take the few-row tiles: Q16_FEW_ROWS rows at a
 * time, each sub-block decoded from the file once for them. Where the group tiles start paying for widening
 * the weights, measured as whole decode steps (docs/benchmarks.md): from 10 rows with AVX-512, from 25 with
 * AVX2 alone. */
#define Q16_GROUP 16
#if HAVE_AVX512
#define Q16_GROUP_MIN 10
#else
#define Q16_GROUP_MIN 25
#endif
/* Rows per few-row tile: 5 where AVX-512's 32 registers hold their sums, so that a decode of four sequences
 * with a draft row, or of one with four, reads the weights once; 4 with AVX2's 16. */
#if HAVE_AVX512
#define Q16_FEW_ROWS 5
#else
#define Q16_FEW_ROWS 4
#endif

/* A type's block: its bytes and the weights it holds (1 for the float types). */
struct type_info {
    int bytes, elems;
    /* Whether its weights carry offsets (their term is summed apart, in sub-block order). */
    int offset;
};

static const struct type_info TYPE_INFO[TYPE_COUNT] = {
    [TYPE_F32] = {4, 1, 0},       [TYPE_F16] = {2, 1, 0},       [TYPE_BF16] = {2, 1, 0},
    [TYPE_Q4_0] = {18, 32, 0},    [TYPE_Q4_1] = {20, 32, 1},    [TYPE_Q5_0] = {22, 32, 0},
    [TYPE_Q5_1] = {24, 32, 1},    [TYPE_Q8_0] = {34, 32, 0},    [TYPE_Q2_K] = {84, 256, 1},
    [TYPE_Q3_K] = {110, 256, 0},  [TYPE_Q4_K] = {144, 256, 1},  [TYPE_Q5_K] = {176, 256, 1},
    [TYPE_Q6_K] = {210, 256, 0},  [TYPE_IQ4_NL] = {18, 32, 0},  [TYPE_IQ4_XS] = {136, 256, 0},
    [TYPE_MXFP4] = {17, 32, 0},
};

static inline int type_known(int64_t type) { return type >= 0 && type < TYPE_COUNT && TYPE_INFO[type].bytes; }
static inline int has_offset(int type) { return TYPE_INFO[type].offset; }
/* Types with a scale (and offset) per 16 weights: their sub-blocks' halves are summed apart. */
static inline int split_scales(int type) { return type == TYPE_Q2_K || type == TYPE_Q3_K || type == TYPE_Q6_K; }
/* The float types: no integer quants, so their rows never take the int16 path. */
static inline int is_float_type(int type) { return type == TYPE_F32 || type == TYPE_F16 || type == TYPE_BF16; }
/* Bytes of a row of n_in weights, 0 where n_in is no whole number of blocks of 32 weights or more. */
static inline int64_t row_bytes(int type, int64_t n_in)
{
    const int64_t unit = TYPE_INFO[type].elems < QK ? QK : TYPE_INFO[type].elems;
    return n_in > 0 && n_in % unit == 0 ? n_in / TYPE_INFO[type].elems * TYPE_INFO[type].bytes : 0;
}

/* The lanes' fixed addition tree, shared by every path. */
static inline float lane_sum(const float *a)
{
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static inline float apply_op(float v, int op, float other)
{
    switch (op) {
    case OP_ADD:
        return v + other;
    case OP_MUL:
        return v * other;
    default:
        return v;
    }
}

/* One part of a product as the paths see it. */
struct product {
    int type;
    const uint8_t *w;
    size_t row_bytes;
    /* ns: sub-blocks of 32 per row. */
    int64_t ns, n_in, n_out, rows;
    /* sx: the rows' sums of x per 32 (per 16 for split_scales types), row t's sum u at sx[u * ss + t]
     * (a row tile's side by side; ss is the rows, padded to a whole group of Q16_GROUP in int16 mode,
     * the padding's sums 0). */
    const float *x, *sx, *bias;
    int64_t ss;
    /* other and out: row t's output o at [t * out_stride + o] (the part's columns of the whole product). */
    const float *other;
    float *out;
    int64_t out_stride;
    int op;
    /* q16: every row runs with int16 activations: xq [rows, n_in], and row t's scale of sub-block s at
     * dx[s * ss + t] (0 for the padding). From Q16_GROUP_MIN rows on, xt holds the quants again by group
     * of Q16_GROUP rows: pair k (elements 2k, 2k + 1, as one int32) of sub-block s of row 16g + l at
     * xt[((g * ns + s) * 16 + k) * 16 + l]; NULL below. */
    int q16;
    const int16_t *xq;
    const int32_t *xt;
    const float *dx;
    /* xsum: the int16 rows' sums of their quants per 16, row t's of half h of sub-block s at
     * xsum[(2 s + h) * ss + t] (the x86 tiles take a bias times them off their sums). */
    const int32_t *xsum;
};

static inline void store(const struct product *p, int64_t t, int64_t o, float v)
{
    if (p->bias)
        v += p->bias[o];
    const int64_t i = t * p->out_stride + o;
    p->out[i] = apply_op(v, p->op, p->other ? p->other[i] : 0.0f);
}

static inline const uint8_t *row_of(const struct product *p, int64_t o) { return p->w + (size_t)o * p->row_bytes; }

/* quants.c: row x's ns sub-blocks quantized to int16, q [ns * 32] and sub-block s's scale at dx[s * ds]. */
INTERNAL void quantize_q16(const float *x, int64_t ns, int16_t *q, float *dx, int64_t ds);
/* quants.c: outputs [o0, o1) of every row, by the portable path. */
INTERNAL void scalar_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1);
/* quants.c: row `row` of the type dequantized into out [n_in]. */
INTERNAL void dequantize_row(int type, const uint8_t *row, int64_t n_in, float *out);
#if HAVE_AVX2
/* arch/x86/quants.c: outputs [o0, o1) of every row, int16 rows (q16_range) or float rows (vector_range)
 * (`wide`: whether to take the AVX-512 tiles where the build has them; the AVX2 tiles give the same
 * bits). */
INTERNAL void q16_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide);
INTERNAL void vector_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide);
#endif

#endif
