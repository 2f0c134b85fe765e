/* Linear products on GGUF's quantized weight blocks: the block formats, the summation order that every
 * path keeps, and what the portable reference (quants.c), the x86 tiles (arch/x86/quants.c) and the
 * threaded entry point (matmul.c) share.
 *
 * out[t, o] = op(sum_i x[t, i] * w[o, i] + bias[o]) with w kept as the file's blocks of 32 weights:
 *   Q8_0 (34 bytes): float16 d, int8 q[32];            w = d * q
 *   Q4_0 (18 bytes): float16 d, 4-bit q[32];           w = d * (q - 8)
 *   Q4_1 (20 bytes): float16 d, float16 m, 4-bit q[32]; w = d * q + m
 *   K8   (44 bytes): float32 d0, d1, m, int8 q[32];    w = d0 * q + m (elements 0..15), d1 * q + m (16..31)
 * K8 is kvserve's own: the K-quants (Q4_K, Q5_K, Q6_K) convert to it exactly at load (quant_blocks.py).
 * (4-bit: byte j holds element j in its low nibble and element j + 16 in its high nibble.)
 *
 * The weights are never requantized. For float rows the quants are widened to float32 in registers and
 * every product and sum is in float32 (int16 rows: see quants.c). Per block, eight lanes l each sum
 * q * x over the block's elements 8k + l (k = 0..3: one multiply, then three fused multiply-adds), and a
 * lane's running total takes d times that block sum by a fused multiply-add (K8: each half's two-term sum
 * times its own scale, low half first). The offset term of Q4_1 and K8, m times the block's sum of x, is
 * summed apart in block order.
 * At the end the lanes are added in one fixed tree. That order is the same for every output of every row,
 * whatever the batch, the tile it falls in, the thread count or the instruction set: a row's output is
 * bitwise independent of the rest of its batch, and the AVX2 path and the portable one give the same
 * bits (tests/model/test_quantized_blocks.py checks both). The library is compiled without -ffast-math and
 * with -ffp-contract=off so that the compiler keeps exactly these operations.
 */
#ifndef KVSERVE_QUANTS_H
#define KVSERVE_QUANTS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "kvserve.h"

#define QK 32
/* Rows per tile of one output: the int16 tiles and the float tiles' second size take ROW_TILE, the
 * float tiles FLOAT_ROW_TILE first (a vector of eight rows' offset terms). */
#define ROW_TILE 4
#define FLOAT_ROW_TILE 8
/* Column tiles a thread takes at a time: 64 outputs, enough to amortize the hand-off. */
#define CHUNK_TILES 16
#define ROW_CHUNK 48
/* Activation bytes a row chunk of the AVX2 tiles may take: they are read again for every output, so they
 * should stay in the L1 data cache (32-48 KiB) beside the blocks. */
#define L1_ROWS_BYTES 24576
#define PREFETCH_BLOCKS 32
/* int16 activations keep 15 bits of each block's largest value. */
#define Q16_MAX 32767.0f

static inline int block_bytes(int type)
{
    switch (type) {
    case TYPE_Q8_0:
        return 34;
    case TYPE_Q4_0:
        return 18;
    case TYPE_Q4_1:
        return 20;
    case TYPE_K8:
        return 44;
    default:
        return 0;
    }
}

/* Whether the type's weights carry an offset m (its term is summed apart, in block order). */
static inline int has_offset(int type) { return type == TYPE_Q4_1 || type == TYPE_K8; }

/* The lanes' fixed addition tree, shared by every path. */
static inline float lane_sum(const float *a)
{
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static inline float apply_op(float v, int op, float other)
{
    switch (op) {
    case OP_SILU:
        return v / (1.0f + expf(-v));
    case OP_ADD:
        return v + other;
    case OP_MUL:
        return v * other;
    default:
        return v;
    }
}

/* One product as the paths see it. */
struct product {
    int type;
    const uint8_t *w;
    size_t bb;
    int64_t nb, n_in, n_out, grouped, rows;
    /* sx: the rows' block sums of x, row t's block b at sx[b * rows + t] (a row tile's side by side). */
    const float *x, *sx, *bias, *other;
    float *out;
    int op;
    /* Rows [0, q16_rows) run with int16 activations: xq [q16_rows, n_in] and dx [q16_rows, nb]. */
    int64_t q16_rows;
    const int16_t *xq;
    const float *dx;
};

static inline void store(const struct product *p, int64_t t, int64_t o, float v)
{
    if (p->bias)
        v += p->bias[o];
    const int64_t i = t * p->n_out + o;
    p->out[i] = apply_op(v, p->op, p->other ? p->other[i] : 0.0f);
}

/* The first block of output o. The outputs below `grouped` (a multiple of COL_TILE) are stored in groups
 * of COL_TILE with their blocks interleaved (block b of the group's outputs side by side, then block
 * b + 1), so that a column tile reads one contiguous stream; the rest follow as plain rows. */
static inline const uint8_t *column(const struct product *p, int64_t o)
{
    if (o < p->grouped)
        return p->w + ((o / COL_TILE) * p->nb * COL_TILE + o % COL_TILE) * p->bb;
    return p->w + (p->grouped * p->nb + (o - p->grouped) * p->nb) * p->bb;
}

static inline size_t block_stride(const struct product *p, int64_t o)
{
    return o < p->grouped ? COL_TILE * p->bb : p->bb;
}

/* quants.c: row x's nb blocks quantized to int16, q [nb * 32] and dx [nb]. */
INTERNAL void quantize_q16(const float *x, int64_t nb, int16_t *q, float *dx);
/* quants.c: outputs [o0, o1) of every row, by the portable path. */
INTERNAL void scalar_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1);
#if HAVE_AVX2
/* arch/x86/quants.c: outputs [o0, o1) of the int16 rows, then of the float rows [q16_rows, rows) (`wide`:
 * whether to take the AVX-512 tiles where the build has them; the AVX2 tiles give the same bits). */
INTERNAL void q16_range(const struct product *p, int64_t o0, int64_t o1);
INTERNAL void vector_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide);
#endif

#endif
