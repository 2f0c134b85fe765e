/* Linear products on GGUF's quantized weight blocks, loaded through ctypes by kvserve/model/quant_linear.py.
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
 * every product and sum is in float32 (int16 rows: see "Decode rows" below). Per block, eight lanes l
 * each sum q * x over the block's elements 8k + l (k = 0..3: one multiply, then three fused
 * multiply-adds), and a lane's running total takes d times that block sum by a fused multiply-add (K8:
 * each half's two-term sum times its own scale, low half first). The offset term of Q4_1 and K8, m times
 * the block's sum of x, is summed apart in block order.
 * At the end the lanes are added in one fixed tree. That order is the same for every output of every row,
 * whatever the batch, the tile it falls in, the thread count or the instruction set: a row's output is
 * bitwise independent of the rest of its batch, and the AVX2 path and the portable one give the same
 * bits (tests/model/test_quantized_blocks.py checks both). The library is compiled without -ffast-math and with
 * -ffp-contract=off so that the compiler keeps exactly these operations.
 *
 * Work is split over output columns between threads (OpenMP), each output computed by one thread. Rows
 * are taken eight (then four) at a time where the batch has them (each block is widened once for the
 * tile's rows, and their offset terms are summed side by side in one vector), and one at a time across
 * four outputs otherwise (decodes). Where the build has AVX-512, batches of WIDE_MIN rows or more take a
 * column group's four outputs up to six rows at a time instead, its blocks widened once per row chunk into
 * a float32 buffer, two outputs' lanes side by side in each 16-lane register: the same operations per
 * lane, so the same bits.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* ggml's type ids. */
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_K8 = 100 };
enum { OP_NONE = 0, OP_SILU = 1, OP_ADD = 2, OP_MUL = 3 };
#define QK 32
/* Rows per tile of one output: the int16 tiles and the float tiles' second size take ROW_TILE, the
 * float tiles FLOAT_ROW_TILE first (a vector of eight rows' offset terms). */
#define ROW_TILE 4
#define FLOAT_ROW_TILE 8
#define COL_TILE 4
/* Column tiles a thread takes at a time: 64 outputs, enough to amortize the hand-off. */
#define CHUNK_TILES 16
#define ROW_CHUNK 48
/* Activation bytes a row chunk of the AVX2 tiles may take: they are read again for every output, so they
 * should stay in the L1 data cache (32-48 KiB) beside the blocks. */
#define L1_ROWS_BYTES 24576
#define PREFETCH_BLOCKS 32

static float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        /* Subnormal: normalize the mantissa. */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int block_bytes(int type)
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

static inline uint16_t read_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The lanes' fixed addition tree, shared by both paths. */
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

/* Portable path: the same operations as the vector path, lane by lane. */
static inline float read_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, sizeof v);
    return v;
}

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

static void scalar_quants(int type, const uint8_t *blk, float q[QK])
{
    if (type == TYPE_Q8_0 || type == TYPE_K8) {
        const int at = type == TYPE_K8 ? 12 : 2;
        for (int j = 0; j < QK; j++)
            q[j] = (float)(int8_t)blk[at + j];
        return;
    }
    const uint8_t *qs = blk + (type == TYPE_Q4_1 ? 4 : 2);
    const int bias = type == TYPE_Q4_0 ? 8 : 0;
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (float)((qs[j] & 0x0f) - bias);
        q[j + QK / 2] = (float)((qs[j] >> 4) - bias);
    }
}

static float scalar_dot(int type, const uint8_t *w, size_t block_stride, int64_t nb, const float *x,
                        const float *sx, int64_t ss)
{
    float acc[8] = {0}, offset = 0, q[QK];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_stride;
        const float *xb = x + b * QK;
        scalar_quants(type, blk, q);
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
        if (type == TYPE_Q4_1 || type == TYPE_K8)
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
 * (llama.cpp's 8-bit activations keep 7, and lose top-1 agreement with float32 on about 1 token in 40 on
 * the default model; int16 on 1 in 3,000, see docs/design.md, Weight precision). */
#define Q16_MAX 32767.0f

/* Row x's nb blocks quantized: q [nb * 32] and dx [nb]. A block with a value that is not finite gets dx
 * NaN (and quants 0), so the row's outputs are NaN as the float path's would be. */
static void quantize_q16(const float *x, int64_t nb, int16_t *q, float *dx)
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
        if (type == TYPE_Q4_1 || type == TYPE_K8)
            offset = fmaf(m, sx[b * ss], offset);
    }
    return lane_sum(acc) + offset;
}

#if HAVE_AVX2
/* The four vectors of block `blk`'s quants as floats, elements 8k..8k+7 in vector k. */
static inline __attribute__((always_inline)) void vector_quants(int type, const uint8_t *blk, __m256 v[4])
{
    if (type == TYPE_Q8_0 || type == TYPE_K8) {
        const int at = type == TYPE_K8 ? 12 : 2;
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + at + 8 * k))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == TYPE_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if (type == TYPE_Q4_0) {
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(lo, eight);
        hi = _mm_sub_epi8(hi, eight);
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}

/* `scales` with the CPU's float16 conversion (the same values). */
static inline void vector_scales(int type, const uint8_t *blk, float *d0, float *d1, float *m)
{
    if (type == TYPE_K8) {
        *d0 = read_f32(blk), *d1 = read_f32(blk + 4), *m = read_f32(blk + 8);
        return;
    }
    *d0 = *d1 = _cvtsh_ss(read_u16(blk));
    *m = type == TYPE_Q4_1 ? _cvtsh_ss(read_u16(blk + 2)) : 0.0f;
}

static inline float vector_total(__m256 acc, float offset)
{
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    return lane_sum(lanes) + offset;
}

/* ROWS rows x COLS outputs; res[r * COLS + c]. Called with constant ROWS and COLS so that it unrolls. */
static inline __attribute__((always_inline)) void vector_tile(int type, int rows, int cols, const uint8_t *w,
                                                              size_t block_stride, int64_t nb, const float *x,
                                                              int64_t x_stride, const float *sx, int64_t ss,
                                                              float *res)
{
    const int bb = block_bytes(type);
    __m256 acc[FLOAT_ROW_TILE * COL_TILE];
    float offset[FLOAT_ROW_TILE * COL_TILE];
    /* A row tile's offsets side by side: one fused multiply-add per block, the same as each row's own. */
    const int row_offsets = cols == 1 && (rows == FLOAT_ROW_TILE || rows == ROW_TILE);
    __m256 offsets = _mm256_setzero_ps();
    __m128 offsets4 = _mm_setzero_ps();
    for (int i = 0; i < rows * cols; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0;
    }
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < cols; c++) {
            /* A column tile's blocks are interleaved (see `column`): consecutive in memory. */
            const uint8_t *blk = w + c * bb + b * block_stride;
            _mm_prefetch((const char *)blk + PREFETCH_BLOCKS * block_stride, _MM_HINT_T0);
            __m256 v[4];
            vector_quants(type, blk, v);
            float d0, d1, m;
            vector_scales(type, blk, &d0, &d1, &m);
            const __m256 d = _mm256_set1_ps(d0);
            for (int r = 0; r < rows; r++) {
                const float *xb = x + r * x_stride + b * QK;
                if (type == TYPE_K8) {
                    __m256 lo = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
                    lo = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), lo);
                    __m256 hi = _mm256_mul_ps(v[2], _mm256_loadu_ps(xb + 16));
                    hi = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), hi);
                    acc[r * cols + c] =
                        _mm256_fmadd_ps(_mm256_set1_ps(d1), hi, _mm256_fmadd_ps(d, lo, acc[r * cols + c]));
                } else {
                    __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
                    t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
                    t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
                    t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
                    acc[r * cols + c] = _mm256_fmadd_ps(d, t, acc[r * cols + c]);
                }
                if ((type == TYPE_Q4_1 || type == TYPE_K8) && !row_offsets)
                    offset[r * cols + c] = fmaf(m, sx[b * ss + r], offset[r * cols + c]);
            }
            if ((type == TYPE_Q4_1 || type == TYPE_K8) && rows == FLOAT_ROW_TILE && row_offsets)
                offsets = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(sx + b * ss), offsets);
            if ((type == TYPE_Q4_1 || type == TYPE_K8) && rows == ROW_TILE && row_offsets)
                offsets4 = _mm_fmadd_ps(_mm_set1_ps(m), _mm_loadu_ps(sx + b * ss), offsets4);
        }
    }
    if (row_offsets && rows == FLOAT_ROW_TILE)
        _mm256_storeu_ps(offset, offsets);
    if (row_offsets && rows == ROW_TILE)
        _mm_storeu_ps(offset, offsets4);
    for (int i = 0; i < rows * cols; i++)
        res[i] = vector_total(acc[i], offset[i]);
}

/* The block's quants as int16: elements 0..15 in lo, 16..31 in hi. */
static inline __attribute__((always_inline)) void q16_quants(int type, const uint8_t *blk, __m256i *lo,
                                                             __m256i *hi)
{
    if (type == TYPE_Q8_0 || type == TYPE_K8) {
        const uint8_t *qs = blk + (type == TYPE_K8 ? 12 : 2);
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == TYPE_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    if (type == TYPE_Q4_0) {
        const __m256i eight = _mm256_set1_epi16(8);
        *lo = _mm256_sub_epi16(*lo, eight);
        *hi = _mm256_sub_epi16(*hi, eight);
    }
}

/* ROWS int16 rows x COLS outputs, as `scalar_dot_q16` computes each; res[r * COLS + c]. */
static inline __attribute__((always_inline)) void q16_tile(int type, int rows, int cols, const uint8_t *w,
                                                           size_t block_stride, int64_t nb, const int16_t *xq,
                                                           int64_t x_stride, const float *dx, const float *sx,
                                                           int64_t ss, float *res)
{
    const int bb = block_bytes(type);
    __m256 acc[ROW_TILE * COL_TILE];
    float offset[ROW_TILE * COL_TILE];
    for (int i = 0; i < rows * cols; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0;
    }
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < cols; c++) {
            const uint8_t *blk = w + c * bb + b * block_stride;
            _mm_prefetch((const char *)blk + PREFETCH_BLOCKS * block_stride, _MM_HINT_T0);
            __m256i lo, hi;
            q16_quants(type, blk, &lo, &hi);
            float d0, d1, m;
            vector_scales(type, blk, &d0, &d1, &m);
            for (int r = 0; r < rows; r++) {
                const int16_t *xb = xq + r * x_stride + b * QK;
                const float x_scale = dx[r * nb + b];
                const __m256i plo = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xb));
                const __m256i phi = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 16)));
                __m256 *a = &acc[r * cols + c];
                if (type == TYPE_K8) {
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), _mm256_set1_ps(d0 * x_scale), *a);
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), _mm256_set1_ps(d1 * x_scale), *a);
                } else {
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(plo, phi)),
                                         _mm256_set1_ps(d0 * x_scale), *a);
                }
                if (type == TYPE_Q4_1 || type == TYPE_K8)
                    offset[r * cols + c] = fmaf(m, sx[b * ss + r], offset[r * cols + c]);
            }
        }
    }
    for (int i = 0; i < rows * cols; i++)
        res[i] = vector_total(acc[i], offset[i]);
}

typedef void (*q16_fn)(const uint8_t *, size_t, int64_t, const int16_t *, int64_t, const float *, const float *,
                       int64_t, float *);
#define DEFINE_Q16_TILES(NAME, TYPE)                                                                      \
    static void NAME##_q16_rows(const uint8_t *w, size_t rb, int64_t nb, const int16_t *x, int64_t xs,   \
                                const float *dx, const float *sx, int64_t ss, float *res)                \
    {                                                                                                    \
        q16_tile(TYPE, ROW_TILE, 1, w, rb, nb, x, xs, dx, sx, ss, res);                                  \
    }                                                                                                    \
    static void NAME##_q16_cols(const uint8_t *w, size_t rb, int64_t nb, const int16_t *x, int64_t xs,   \
                                const float *dx, const float *sx, int64_t ss, float *res)                \
    {                                                                                                    \
        q16_tile(TYPE, 1, COL_TILE, w, rb, nb, x, xs, dx, sx, ss, res);                                  \
    }                                                                                                    \
    static void NAME##_q16_one(const uint8_t *w, size_t rb, int64_t nb, const int16_t *x, int64_t xs,    \
                               const float *dx, const float *sx, int64_t ss, float *res)                 \
    {                                                                                                    \
        q16_tile(TYPE, 1, 1, w, rb, nb, x, xs, dx, sx, ss, res);                                         \
    }
DEFINE_Q16_TILES(q8_0, TYPE_Q8_0)
DEFINE_Q16_TILES(q4_0, TYPE_Q4_0)
DEFINE_Q16_TILES(q4_1, TYPE_Q4_1)
DEFINE_Q16_TILES(k8, TYPE_K8)

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define HAVE_AVX512 1
/* The AVX-512 tile: up to WR rows x WP pairs of outputs (2 * WP of them, a column group). Its WR * WP
 * 16-lane block sums and running totals stay in registers (24 of the 32); the widened blocks are read from
 * a buffer. */
#define WR 6 /* at most res's eight rows in vector_range */
#define WP (COL_TILE / 2)
/* Below two full tiles' rows, widening into the buffer costs more than the AVX2 tiles lose. */
#define WIDE_MIN (2 * WR)
/* Floats per block in the widened buffer: per pair four quant vectors and two scale vectors, then the
 * four outputs' offsets (padded to a vector). */
#define WIDE_BLOCK ((WP * 6 + 1) * 16)
/* Two 8-lane vectors side by side: a in the low half, b in the high half. */
static inline __m512 pair(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

/* A column group's nb blocks (interleaved, see `column`) widened once into `buf` (64-byte aligned, nb *
 * WIDE_BLOCK floats) for every row tile of a row chunk: per pair, vector k holds the two outputs' quants
 * 8k..8k+7 side by side, and the scales likewise. The values are exact, so reading them back is the same
 * as widening in registers. */
static inline __attribute__((always_inline)) void widen(int type, const uint8_t *w, size_t block_stride,
                                                        int64_t nb, float *buf)
{
    const int bb = block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_stride;
        for (int line = 0; line < 2 * WP * bb; line += 64)
            _mm_prefetch((const char *)blk + PREFETCH_BLOCKS * block_stride + line, _MM_HINT_T0);
        float *fb = buf + b * WIDE_BLOCK, *m = fb + WP * 6 * 16;
        for (int h = 0; h < WP; h++) {
            const uint8_t *lo_blk = blk + 2 * h * bb, *hi_blk = lo_blk + bb;
            __m256 a[4], c[4];
            vector_quants(type, lo_blk, a);
            vector_quants(type, hi_blk, c);
            for (int k = 0; k < 4; k++)
                _mm512_store_ps(fb + (h * 6 + k) * 16, pair(a[k], c[k]));
            float d0[2], d1[2];
            for (int i = 0; i < 2; i++) {
                const uint8_t *one = i ? hi_blk : lo_blk;
                vector_scales(type, one, &d0[i], &d1[i], &m[2 * h + i]);
            }
            _mm512_store_ps(fb + (h * 6 + 4) * 16, pair(_mm256_set1_ps(d0[0]), _mm256_set1_ps(d0[1])));
            _mm512_store_ps(fb + (h * 6 + 5) * 16, pair(_mm256_set1_ps(d1[0]), _mm256_set1_ps(d1[1])));
        }
    }
}

/* WR rows x 2 * WP outputs of a column group widened by `widen`. Each 16-lane accumulator holds two
 * outputs' eight lanes side by side, so every lane takes exactly the operations of `vector_tile` (the same
 * products, fused multiply-adds and scales, in the same order): the same bits. Within a block the quant
 * vectors are the outer loop, so that each widened vector is loaded once for WR rows and each row's
 * activations once for 2 * WP outputs; the WR * WP block sums and running totals stay in registers. */
static inline __attribute__((always_inline)) void wide_tile(int type, int rows, const float *buf, int64_t nb,
                                                            const float *x, int64_t x_stride, const float *sx,
                                                            int64_t ss, float *res)
{
    __m512 acc[WR][WP], t[WR][WP];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < WP; h++)
            acc[r][h] = t[r][h] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float *fb = buf + b * WIDE_BLOCK, *xb = x + b * QK;
        for (int k = 0; k < 4; k++) {
            /* K8 sums each half apart: a fresh block sum at k = 2. */
            const int fresh = k == 0 || (type == TYPE_K8 && k == 2);
            __m512 w[WP];
            for (int h = 0; h < WP; h++)
                w[h] = _mm512_load_ps(fb + (h * 6 + k) * 16);
            for (int r = 0; r < rows; r++) {
                const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xb + r * x_stride + 8 * k));
                for (int h = 0; h < WP; h++)
                    t[r][h] = fresh ? _mm512_mul_ps(w[h], xv) : _mm512_fmadd_ps(w[h], xv, t[r][h]);
            }
            /* The half or block is whole: its sum times its scale (K8: d0 for the low half, d1 high). */
            if (k == 3 || (type == TYPE_K8 && k == 1)) {
                const int scale = type == TYPE_K8 && k == 3 ? 5 : 4;
                for (int h = 0; h < WP; h++) {
                    const __m512 d = _mm512_load_ps(fb + (h * 6 + scale) * 16);
                    for (int r = 0; r < rows; r++)
                        acc[r][h] = _mm512_fmadd_ps(d, t[r][h], acc[r][h]);
                }
            }
        }
    }
    /* The offset term in block order, as `vector_tile` sums it (the rows' chains side by side). */
    __m128 offset[WR];
    for (int r = 0; r < rows; r++)
        offset[r] = _mm_setzero_ps();
    if (type == TYPE_Q4_1 || type == TYPE_K8)
        for (int64_t b = 0; b < nb; b++) {
            const __m128 m = _mm_load_ps(buf + b * WIDE_BLOCK + WP * 6 * 16);
            for (int r = 0; r < rows; r++)
                offset[r] = _mm_fmadd_ps(m, _mm_set1_ps(sx[b * ss + r]), offset[r]);
        }
    for (int r = 0; r < rows; r++) {
        float lanes[16], off[4];
        _mm_storeu_ps(off, offset[r]);
        for (int h = 0; h < WP; h++) {
            _mm512_storeu_ps(lanes, acc[r][h]);
            res[r * (2 * WP) + 2 * h] = lane_sum(lanes) + off[2 * h];
            res[r * (2 * WP) + 2 * h + 1] = lane_sum(lanes + 8) + off[2 * h + 1];
        }
    }
}

typedef void (*widen_fn)(const uint8_t *, size_t, int64_t, float *);
typedef void (*wide_fn)(const float *, int64_t, const float *, int64_t, const float *, int64_t, float *);
#define WIDE_ROWS(NAME, TYPE, R)                                                                          \
    static void NAME##_wide##R(const float *buf, int64_t nb, const float *x, int64_t xs, const float *sx,  \
                               int64_t ss, float *res)                                                   \
    {                                                                                                    \
        wide_tile(TYPE, R, buf, nb, x, xs, sx, ss, res);                                                 \
    }
#define WIDE_TILE(NAME, TYPE)                                                                             \
    static void NAME##_widen(const uint8_t *w, size_t rb, int64_t nb, float *buf)                        \
    {                                                                                                    \
        widen(TYPE, w, rb, nb, buf);                                                                     \
    }                                                                                                    \
    WIDE_ROWS(NAME, TYPE, 1)                                                                             \
    WIDE_ROWS(NAME, TYPE, 2)                                                                             \
    WIDE_ROWS(NAME, TYPE, 3)                                                                             \
    WIDE_ROWS(NAME, TYPE, 4)                                                                             \
    WIDE_ROWS(NAME, TYPE, 5)                                                                             \
    WIDE_ROWS(NAME, TYPE, 6)                                                                             \
    static const wide_fn NAME##_wide[WR + 1] = {NULL,          NAME##_wide1, NAME##_wide2, NAME##_wide3,  \
                                                NAME##_wide4, NAME##_wide5, NAME##_wide6};
WIDE_TILE(q8_0, TYPE_Q8_0)
WIDE_TILE(q4_0, TYPE_Q4_0)
WIDE_TILE(q4_1, TYPE_Q4_1)
WIDE_TILE(k8, TYPE_K8)
#else
#define HAVE_AVX512 0
#endif

#define DEFINE_TILES(NAME, TYPE)                                                                          \
    static void NAME##_rows(const uint8_t *w, size_t rb, int64_t nb, const float *x, int64_t xs,         \
                            const float *sx, int64_t ss, float *res)                                     \
    {                                                                                                    \
        vector_tile(TYPE, FLOAT_ROW_TILE, 1, w, rb, nb, x, xs, sx, ss, res);                             \
    }                                                                                                    \
    static void NAME##_rows4(const uint8_t *w, size_t rb, int64_t nb, const float *x, int64_t xs,        \
                             const float *sx, int64_t ss, float *res)                                    \
    {                                                                                                    \
        vector_tile(TYPE, ROW_TILE, 1, w, rb, nb, x, xs, sx, ss, res);                                   \
    }                                                                                                    \
    static void NAME##_cols(const uint8_t *w, size_t rb, int64_t nb, const float *x, int64_t xs,         \
                            const float *sx, int64_t ss, float *res)                                     \
    {                                                                                                    \
        vector_tile(TYPE, 1, COL_TILE, w, rb, nb, x, xs, sx, ss, res);                                   \
    }                                                                                                    \
    static void NAME##_one(const uint8_t *w, size_t rb, int64_t nb, const float *x, int64_t xs,          \
                           const float *sx, int64_t ss, float *res)                                      \
    {                                                                                                    \
        vector_tile(TYPE, 1, 1, w, rb, nb, x, xs, sx, ss, res);                                          \
    }
DEFINE_TILES(q8_0, TYPE_Q8_0)
DEFINE_TILES(q4_0, TYPE_Q4_0)
DEFINE_TILES(q4_1, TYPE_Q4_1)
DEFINE_TILES(k8, TYPE_K8)
#endif

typedef void (*tile_fn)(const uint8_t *, size_t, int64_t, const float *, int64_t, const float *, int64_t,
                        float *);

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

/* Outputs [o0, o1) of every row, by the portable path. */
static void scalar_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1)
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

#if HAVE_AVX2
/* `wide`: whether to take the AVX-512 tiles where the build has them (the AVX2 tiles give the same bits). */
/* Outputs [o0, o1) of the int16 rows: four rows per output, the rest one at a time across four outputs. */
static void q16_range(const struct product *p, int64_t o0, int64_t o1)
{
    q16_fn by_rows, by_cols, one;
    switch (p->type) {
    case TYPE_Q8_0:
        by_rows = q8_0_q16_rows, by_cols = q8_0_q16_cols, one = q8_0_q16_one;
        break;
    case TYPE_Q4_0:
        by_rows = q4_0_q16_rows, by_cols = q4_0_q16_cols, one = q4_0_q16_one;
        break;
    case TYPE_Q4_1:
        by_rows = q4_1_q16_rows, by_cols = q4_1_q16_cols, one = q4_1_q16_one;
        break;
    default:
        by_rows = k8_q16_rows, by_cols = k8_q16_cols, one = k8_q16_one;
        break;
    }
    const int64_t rows = p->q16_rows, nb = p->nb, n = p->n_in;
    float res[ROW_TILE * COL_TILE];
    for (int64_t o = o0; o < o1;) {
        const uint8_t *w = column(p, o);
        const size_t bs = block_stride(p, o);
        int64_t t = 0;
        if (o1 - o < COL_TILE || o >= p->grouped || rows >= ROW_TILE) {
            for (; t + ROW_TILE <= rows; t += ROW_TILE) {
                by_rows(w, bs, nb, p->xq + t * n, n, p->dx + t * nb, p->sx + t, p->rows, res);
                for (int r = 0; r < ROW_TILE; r++)
                    store(p, t + r, o, res[r]);
            }
            for (; t < rows; t++) {
                one(w, bs, nb, p->xq + t * n, n, p->dx + t * nb, p->sx + t, p->rows, res);
                store(p, t, o, res[0]);
            }
            o += 1;
        } else {
            for (; t < rows; t++) {
                by_cols(w, bs, nb, p->xq + t * n, n, p->dx + t * nb, p->sx + t, p->rows, res);
                for (int c = 0; c < COL_TILE; c++)
                    store(p, t, o + c, res[c]);
            }
            o += COL_TILE;
        }
    }
}

/* Outputs [o0, o1) of the float rows [q16_rows, rows). */
static void vector_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide)
{
    tile_fn by_rows, by_rows4, by_cols, one;
#if HAVE_AVX512
    widen_fn widen_group = NULL;
    const wide_fn *by_both = NULL;
#endif
    switch (p->type) {
    case TYPE_Q8_0:
        by_rows = q8_0_rows, by_rows4 = q8_0_rows4, by_cols = q8_0_cols, one = q8_0_one;
#if HAVE_AVX512
        widen_group = q8_0_widen, by_both = q8_0_wide;
#endif
        break;
    case TYPE_Q4_0:
        by_rows = q4_0_rows, by_rows4 = q4_0_rows4, by_cols = q4_0_cols, one = q4_0_one;
#if HAVE_AVX512
        widen_group = q4_0_widen, by_both = q4_0_wide;
#endif
        break;
    case TYPE_Q4_1:
        by_rows = q4_1_rows, by_rows4 = q4_1_rows4, by_cols = q4_1_cols, one = q4_1_one;
#if HAVE_AVX512
        widen_group = q4_1_widen, by_both = q4_1_wide;
#endif
        break;
    default:
        by_rows = k8_rows, by_rows4 = k8_rows4, by_cols = k8_cols, one = k8_one;
#if HAVE_AVX512
        widen_group = k8_widen, by_both = k8_wide;
#endif
        break;
    }
#if HAVE_AVX512
    /* The widened blocks of one column group; without it (or `wide`), the AVX2 tiles (the same bits). */
    const size_t buf_bytes = ((size_t)p->nb * WIDE_BLOCK * sizeof(float) + 63) / 64 * 64;
    float *buf = wide && rows - p->q16_rows >= WIDE_MIN ? aligned_alloc(64, buf_bytes) : NULL;
    if (!buf)
        by_both = NULL;
#else
    (void)wide;
#endif
    /* Up to eight rows (the AVX-512 tile) x COL_TILE outputs. */
    float res[8 * COL_TILE];
    /* Rows in chunks, so that a chunk's activations stay in cache while the outputs' weights stream: for
     * the row tiles, as many rows as fit in the L1 data cache beside the blocks (at least one tile). */
    int64_t chunk = L1_ROWS_BYTES / (p->n_in * (int64_t)sizeof(float)) / ROW_TILE * ROW_TILE;
#if HAVE_AVX512
    if (by_both)
        chunk = ROW_CHUNK;
#endif
    chunk = chunk < ROW_TILE ? ROW_TILE : chunk > ROW_CHUNK ? ROW_CHUNK : chunk;
    for (int64_t t0 = p->q16_rows; t0 < rows; t0 += chunk) {
        const int64_t t1 = t0 + chunk < rows ? t0 + chunk : rows;
        for (int64_t o = o0; o < o1;) {
            int64_t t = t0;
            const uint8_t *w = column(p, o);
            const size_t bs = block_stride(p, o);
#if HAVE_AVX512
            if (by_both && t1 - t0 >= WIDE_MIN && o + COL_TILE <= o1 && o < p->grouped) {
                /* A column group WR rows at a time, the last tile taking the rows that are left. */
                widen_group(w, bs, p->nb, buf);
                for (; t < t1;) {
                    const int n = t1 - t < WR ? (int)(t1 - t) : WR;
                    by_both[n](buf, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    for (int r = 0; r < n; r++)
                        for (int c = 0; c < COL_TILE; c++)
                            store(p, t + r, o + c, res[r * COL_TILE + c]);
                    t += n;
                }
                o += COL_TILE;
                continue;
            }
#endif
            if (o1 - o < COL_TILE || t1 - t0 >= ROW_TILE) {
                /* One output at a time: eight rows per tile, then four, then the rest one by one. */
                for (; t + ROW_TILE <= t1;) {
                    const int n = t + FLOAT_ROW_TILE <= t1 ? FLOAT_ROW_TILE : ROW_TILE;
                    const tile_fn tile = n == FLOAT_ROW_TILE ? by_rows : by_rows4;
                    tile(w, bs, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    for (int r = 0; r < n; r++)
                        store(p, t + r, o, res[r]);
                    t += n;
                }
                for (; t < t1; t++) {
                    one(w, bs, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    store(p, t, o, res[0]);
                }
                o += 1;
            } else {
                for (; t < t1; t++) {
                    by_cols(w, bs, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    for (int c = 0; c < COL_TILE; c++)
                        store(p, t, o + c, res[c]);
                }
                o += COL_TILE;
            }
        }
    }
#if HAVE_AVX512
    free(buf);
#endif
}
#endif

/* 1 when this build has the AVX2 path. */
int quant_linear_vectorized(void) { return HAVE_AVX2; }

/* x: [rows, n_in] float32, contiguous; w: n_out * n_in / 32 blocks of `type`, laid out as `column`
 * says (quant_linear.py's `interleave`); bias: [n_out] or NULL; other: [rows, n_out] for OP_ADD and
 * OP_MUL, else NULL; out: [rows, n_out]. The first `q16_rows` rows (decodes) run with int16 activations.
 * `portable` 1 forces the portable path, 2 the AVX2 tiles without the AVX-512 ones (for tests). Returns
 * 0, -1 for an unknown type or shape, -2 when out of memory. */
int quant_linear(int type, const uint8_t *w, const float *x, const float *bias, const float *other, float *out,
                 int64_t rows, int64_t n_in, int64_t n_out, int op, int threads, int portable, int64_t q16_rows)
{
    const int bb = block_bytes(type);
    if (bb == 0 || n_in % QK != 0 || q16_rows < 0 || q16_rows > rows)
        return -1;
    const int64_t nb = n_in / QK;
    /* One allocation: the rows' block sums of x (Q4_1, K8), then the int16 rows' scales and quants. */
    const size_t sx_n = (type == TYPE_Q4_1 || type == TYPE_K8) ? (size_t)(rows * nb) : 0;
    const size_t dx_n = (size_t)(q16_rows * nb);
    float *scratch = malloc(sizeof(float) * (sx_n + dx_n) + sizeof(int16_t) * (size_t)(q16_rows * n_in) + 1);
    if (!scratch)
        return -2;
    float *sx = sx_n ? scratch : NULL, *dx = scratch + sx_n;
    int16_t *xq = (int16_t *)(dx + dx_n);
    for (int64_t t = 0; sx && t < rows; t++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + t * n_in + b * QK;
            float s = 0;
            for (int j = 0; j < QK; j++)
                s += xb[j];
            sx[b * rows + t] = s;
        }
    for (int64_t t = 0; t < q16_rows; t++)
        quantize_q16(x + t * n_in, nb, xq + t * n_in, dx + t * nb);
    const struct product p = {type, w,     (size_t)bb, nb, n_in, n_out,    n_out / COL_TILE * COL_TILE, rows,
                              x,    sx,    bias,       other, out, op,       q16_rows,                   xq,
                              dx};
    /* Threads take runs of CHUNK_TILES column tiles as they come free, not a fixed share: a thread the OS
     * preempts (the server's event loop shares the cores) then delays the product by one run, not by its
     * whole share. Each output is still summed by one thread in one order, so the bits never change. */
    const int64_t tiles = (n_out + COL_TILE - 1) / COL_TILE;
    const int64_t runs = (tiles + CHUNK_TILES - 1) / CHUNK_TILES;
    int nt = threads < 1 ? 1 : threads;
    if (nt > runs)
        nt = (int)runs;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t r = 0; r < runs; r++) {
        const int64_t o0 = r * CHUNK_TILES * COL_TILE, o1e = (r + 1) * CHUNK_TILES * COL_TILE;
        const int64_t o1 = o1e < n_out ? o1e : n_out;
#if HAVE_AVX2
        if (portable != 1) {
            if (q16_rows > 0)
                q16_range(&p, o0, o1);
            if (rows > q16_rows)
                vector_range(&p, rows, o0, o1, portable != 2);
        } else
#endif
            scalar_range(&p, rows, o0, o1);
    }
    free(scratch);
    return 0;
}

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

/* ---- Every decoder layer of a step's decode rows in one call ---------------------------------------
 *
 * The same operations, in the same order, as the per-op path of transformer.py with these kernels:
 * rms_norm_rows, the qkv product, rope on q and k (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product
 * rounded: no contraction in this library), the K/V write into the paged cache (float32, or rounded to
 * float16 to nearest even as torch rounds), the attention kernel (called through the pointer the caller
 * passes, from the attention library), the o product plus the residual, rms_norm_rows, the gate product
 * with silu, the up product times it, the down product plus the residual. So a row's bits are those of the
 * per-op path, and as batch-invariant. What it saves is the per-op calls between the products. */

struct qlinear {
    int64_t type;
    const uint8_t *w;
    const float *bias;
    int64_t n_in, n_out;
};

struct decoder_layer {
    const float *attn_norm, *mlp_norm;
    struct qlinear qkv, o, gate, up, down;
};

struct decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    /* Slots per layer in the caches ([layers, slots, kv_heads, head_dim]); 1 when the cache is float16. */
    int64_t layer_slots, kv_half;
    /* 1: the products take the rows with int16 activations (they are all decodes). */
    int64_t q16;
    double eps, scale;
    const struct decoder_layer *layers;
    /* cos and sin tables [positions, head_dim / 2]. */
    const float *cos, *sin;
};

typedef int (*attention_fn)(const float *, int64_t, float *, const void *, const void *, const int64_t *,
                            int64_t, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, double, int);

static int run_linear(const struct decoder *m, const struct qlinear *l, const float *x, const float *other,
                      float *out, int64_t rows, int op, int threads)
{
    return quant_linear((int)l->type, l->w, x, l->bias, other, out, rows, l->n_in, l->n_out, op, threads, 0,
                        m->q16 ? rows : 0);
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

static int write_kv(const struct decoder *m, void *cache, const float *src, int64_t rows, int64_t stride,
                    const int64_t *slots)
{
    const int64_t n = m->kv_heads * m->head_dim;
    for (int64_t t = 0; t < rows; t++) {
        if (m->kv_half) {
#ifdef __FLT16_MAX__
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

/* 1 when this build can write a float16 cache. */
int decoder_layers_kv16(void)
{
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

/* h: [rows, hidden] hidden states of decode rows, updated in place through every layer. positions, slots:
 * [rows]; tables [rows, table_width] and lens [rows] as the attention kernel takes them; k_cache, v_cache:
 * the caches of every layer. Returns 0, -1 for a refused shape or type, -2 when out of memory. */
int decoder_layers(const struct decoder *m, float *h, int64_t rows, const int64_t *positions,
                   const int64_t *slots, void *k_cache, void *v_cache, const int64_t *tables,
                   int64_t table_width, const int64_t *lens, attention_fn attention, int threads)
{
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const size_t elem = m->kv_half ? 2 : 4;
    const size_t layer_bytes = (size_t)m->layer_slots * (size_t)kv_size * elem;
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
        if (attention(qkv, qkv_size, attn, kc, vc, tables, table_width, lens, rows, m->heads, m->kv_heads,
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
