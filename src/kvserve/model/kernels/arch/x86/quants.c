/* The products' x86 tiles: AVX2 (with FMA and F16C), and AVX-512 where the build has it.
 *
 * Each tile computes every output it holds in the order quants.h fixes, lane for lane as the portable
 * reference (quants.c) does, so every tile gives the same bits. Rows are taken eight (then four) at a time
 * where the batch has them (each block is widened once for the tile's rows, and their offset terms are
 * summed side by side in one vector), and one at a time across four outputs otherwise (decodes). Where the
 * build has AVX-512, batches of WIDE_MIN rows or more take a column group's four outputs up to six rows at
 * a time instead, its blocks widened once per row chunk into a float32 buffer, two outputs' lanes side by
 * side in each 16-lane register: the same operations per lane, so the same bits.
 *
 * A tile takes its block type, rows and outputs as constants (DEFINE_TILES instantiates each per type), so
 * that its loops unroll into registers; `TILES`, indexed by block type, holds every type's tiles.
 */
#include <stdint.h>
#include <stdlib.h>

#include "quants.h"

#if HAVE_AVX2
/* The four vectors of block `blk`'s quants as floats, elements 8k..8k+7 in vector k. */
static ALWAYS_INLINE void vector_quants(int type, const uint8_t *blk, __m256 v[4])
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
static ALWAYS_INLINE void vector_tile(int type, int rows, int cols, const uint8_t *w, size_t block_stride,
                                      int64_t nb, const float *x, int64_t x_stride, const float *sx, int64_t ss,
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
                if (has_offset(type) && !row_offsets)
                    offset[r * cols + c] = fmaf(m, sx[b * ss + r], offset[r * cols + c]);
            }
            if (has_offset(type) && rows == FLOAT_ROW_TILE && row_offsets)
                offsets = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(sx + b * ss), offsets);
            if (has_offset(type) && rows == ROW_TILE && row_offsets)
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
static ALWAYS_INLINE void q16_quants(int type, const uint8_t *blk, __m256i *lo, __m256i *hi)
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
static ALWAYS_INLINE void q16_tile(int type, int rows, int cols, const uint8_t *w, size_t block_stride,
                                   int64_t nb, const int16_t *xq, int64_t x_stride, const float *dx,
                                   const float *sx, int64_t ss, float *res)
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
                if (has_offset(type))
                    offset[r * cols + c] = fmaf(m, sx[b * ss + r], offset[r * cols + c]);
            }
        }
    }
    for (int i = 0; i < rows * cols; i++)
        res[i] = vector_total(acc[i], offset[i]);
}


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

#if HAVE_AVX512
/* Two 8-lane vectors side by side: a in the low half, b in the high half. */
static inline __m512 pair(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

/* A column group's nb blocks (interleaved, see `column`) widened once into `buf` (64-byte aligned, nb *
 * WIDE_BLOCK floats) for every row tile of a row chunk: per pair, vector k holds the two outputs' quants
 * 8k..8k+7 side by side, and the scales likewise. The values are exact, so reading them back is the same
 * as widening in registers. */
static ALWAYS_INLINE void widen(int type, const uint8_t *w, size_t block_stride, int64_t nb, float *buf)
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
static ALWAYS_INLINE void wide_tile(int type, int rows, const float *buf, int64_t nb, const float *x,
                                    int64_t x_stride, const float *sx, int64_t ss, float *res)
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
    if (has_offset(type))
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


/* `wide_tile` with its row count as a constant. */
static ALWAYS_INLINE void wide_rows(int type, int rows, const float *buf, int64_t nb, const float *x,
                                    int64_t x_stride, const float *sx, int64_t ss, float *res)
{
    switch (rows) {
    case 1:
        wide_tile(type, 1, buf, nb, x, x_stride, sx, ss, res);
        break;
    case 2:
        wide_tile(type, 2, buf, nb, x, x_stride, sx, ss, res);
        break;
    case 3:
        wide_tile(type, 3, buf, nb, x, x_stride, sx, ss, res);
        break;
    case 4:
        wide_tile(type, 4, buf, nb, x, x_stride, sx, ss, res);
        break;
    case 5:
        wide_tile(type, 5, buf, nb, x, x_stride, sx, ss, res);
        break;
    default:
        wide_tile(type, WR, buf, nb, x, x_stride, sx, ss, res);
        break;
    }
}
#endif

typedef void (*tile_fn)(const uint8_t *, size_t, int64_t, const float *, int64_t, const float *, int64_t,
                        float *);
typedef void (*q16_fn)(const uint8_t *, size_t, int64_t, const int16_t *, int64_t, const float *, const float *,
                       int64_t, float *);
typedef void (*widen_fn)(const uint8_t *, size_t, int64_t, float *);
typedef void (*wide_fn)(int, const float *, int64_t, const float *, int64_t, const float *, int64_t, float *);

/* One block type's tiles. */
struct tiles {
    /* Float rows: eight rows of one output, four rows, one row of COL_TILE outputs, one of one. */
    tile_fn rows8, rows4, cols, one;
    /* int16 rows: ROW_TILE rows of one output, one row of COL_TILE outputs, one of one. */
    q16_fn q16_rows, q16_cols, q16_one;
    /* AVX-512: a column group's blocks widened into the buffer, then 1..WR rows of the group's outputs
     * from it. NULL where the build has no AVX-512. */
    widen_fn widen;
    wide_fn wide;
};

#define DEFINE_TILES(NAME, TYPE)                                                                          \
    static void NAME##_rows8(const uint8_t *w, size_t rb, int64_t nb, const float *x, int64_t xs,        \
                             const float *sx, int64_t ss, float *res)                                    \
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
    }                                                                                                    \
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
DEFINE_TILES(q8_0, TYPE_Q8_0)
DEFINE_TILES(q4_0, TYPE_Q4_0)
DEFINE_TILES(q4_1, TYPE_Q4_1)
DEFINE_TILES(k8, TYPE_K8)

#if HAVE_AVX512
#define DEFINE_WIDE_TILES(NAME, TYPE)                                                                     \
    static void NAME##_widen(const uint8_t *w, size_t rb, int64_t nb, float *buf)                        \
    {                                                                                                    \
        widen(TYPE, w, rb, nb, buf);                                                                     \
    }                                                                                                    \
    static void NAME##_wide(int rows, const float *buf, int64_t nb, const float *x, int64_t xs,          \
                            const float *sx, int64_t ss, float *res)                                     \
    {                                                                                                    \
        wide_rows(TYPE, rows, buf, nb, x, xs, sx, ss, res);                                              \
    }
DEFINE_WIDE_TILES(q8_0, TYPE_Q8_0)
DEFINE_WIDE_TILES(q4_0, TYPE_Q4_0)
DEFINE_WIDE_TILES(q4_1, TYPE_Q4_1)
DEFINE_WIDE_TILES(k8, TYPE_K8)
#define WIDE_TILES_OF(NAME) NAME##_widen, NAME##_wide
#else
#define WIDE_TILES_OF(NAME) NULL, NULL
#endif

/* Every block type's tiles, indexed by the type's id. */
static const struct tiles TILES[TYPE_K8 + 1] = {
    [TYPE_Q8_0] = {q8_0_rows8, q8_0_rows4, q8_0_cols, q8_0_one, q8_0_q16_rows, q8_0_q16_cols, q8_0_q16_one,
                   WIDE_TILES_OF(q8_0)},
    [TYPE_Q4_0] = {q4_0_rows8, q4_0_rows4, q4_0_cols, q4_0_one, q4_0_q16_rows, q4_0_q16_cols, q4_0_q16_one,
                   WIDE_TILES_OF(q4_0)},
    [TYPE_Q4_1] = {q4_1_rows8, q4_1_rows4, q4_1_cols, q4_1_one, q4_1_q16_rows, q4_1_q16_cols, q4_1_q16_one,
                   WIDE_TILES_OF(q4_1)},
    [TYPE_K8] = {k8_rows8, k8_rows4, k8_cols, k8_one, k8_q16_rows, k8_q16_cols, k8_q16_one, WIDE_TILES_OF(k8)},
};

/* Four rows per output, the rest one at a time across four outputs. */
void q16_range(const struct product *p, int64_t o0, int64_t o1)
{
    const struct tiles *k = &TILES[p->type];
    const int64_t rows = p->q16_rows, nb = p->nb, n = p->n_in;
    float res[ROW_TILE * COL_TILE];
    for (int64_t o = o0; o < o1;) {
        const uint8_t *w = column(p, o);
        const size_t bs = block_stride(p, o);
        int64_t t = 0;
        if (o1 - o < COL_TILE || o >= p->grouped || rows >= ROW_TILE) {
            for (; t + ROW_TILE <= rows; t += ROW_TILE) {
                k->q16_rows(w, bs, nb, p->xq + t * n, n, p->dx + t * nb, p->sx + t, p->rows, res);
                for (int r = 0; r < ROW_TILE; r++)
                    store(p, t + r, o, res[r]);
            }
            for (; t < rows; t++) {
                k->q16_one(w, bs, nb, p->xq + t * n, n, p->dx + t * nb, p->sx + t, p->rows, res);
                store(p, t, o, res[0]);
            }
            o += 1;
        } else {
            for (; t < rows; t++) {
                k->q16_cols(w, bs, nb, p->xq + t * n, n, p->dx + t * nb, p->sx + t, p->rows, res);
                for (int c = 0; c < COL_TILE; c++)
                    store(p, t, o + c, res[c]);
            }
            o += COL_TILE;
        }
    }
}

void vector_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide)
{
    const struct tiles *k = &TILES[p->type];
    /* The widened blocks of one column group; without it (no AVX-512, or not `wide`), the AVX2 tiles. */
    const size_t buf_bytes = ((size_t)p->nb * WIDE_BLOCK * sizeof(float) + 63) / 64 * 64;
    float *buf = wide && k->wide && rows - p->q16_rows >= WIDE_MIN ? aligned_alloc(64, buf_bytes) : NULL;
    /* Up to eight rows (the AVX-512 tile) x COL_TILE outputs. */
    float res[8 * COL_TILE];
    /* Rows in chunks, so that a chunk's activations stay in cache while the outputs' weights stream: for
     * the row tiles, as many rows as fit in the L1 data cache beside the blocks (at least one tile). */
    int64_t chunk = buf ? ROW_CHUNK : L1_ROWS_BYTES / (p->n_in * (int64_t)sizeof(float)) / ROW_TILE * ROW_TILE;
    chunk = chunk < ROW_TILE ? ROW_TILE : chunk > ROW_CHUNK ? ROW_CHUNK : chunk;
    for (int64_t t0 = p->q16_rows; t0 < rows; t0 += chunk) {
        const int64_t t1 = t0 + chunk < rows ? t0 + chunk : rows;
        for (int64_t o = o0; o < o1;) {
            int64_t t = t0;
            const uint8_t *w = column(p, o);
            const size_t bs = block_stride(p, o);
            if (buf && t1 - t0 >= WIDE_MIN && o + COL_TILE <= o1 && o < p->grouped) {
                /* A column group WR rows at a time, the last tile taking the rows that are left. */
                k->widen(w, bs, p->nb, buf);
                for (; t < t1;) {
                    const int n = t1 - t < WR ? (int)(t1 - t) : WR;
                    k->wide(n, buf, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    for (int r = 0; r < n; r++)
                        for (int c = 0; c < COL_TILE; c++)
                            store(p, t + r, o + c, res[r * COL_TILE + c]);
                    t += n;
                }
                o += COL_TILE;
                continue;
            }
            if (o1 - o < COL_TILE || t1 - t0 >= ROW_TILE) {
                /* One output at a time: eight rows per tile, then four, then the rest one by one. */
                for (; t + ROW_TILE <= t1;) {
                    const int n = t + FLOAT_ROW_TILE <= t1 ? FLOAT_ROW_TILE : ROW_TILE;
                    (n == FLOAT_ROW_TILE ? k->rows8 : k->rows4)(w, bs, p->nb, p->x + t * p->n_in, p->n_in,
                                                                p->sx + t, p->rows, res);
                    for (int r = 0; r < n; r++)
                        store(p, t + r, o, res[r]);
                    t += n;
                }
                for (; t < t1; t++) {
                    k->one(w, bs, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    store(p, t, o, res[0]);
                }
                o += 1;
            } else {
                for (; t < t1; t++) {
                    k->cols(w, bs, p->nb, p->x + t * p->n_in, p->n_in, p->sx + t, p->rows, res);
                    for (int c = 0; c < COL_TILE; c++)
                        store(p, t, o + c, res[c]);
                }
                o += COL_TILE;
            }
        }
    }
    free(buf);
}
#endif
