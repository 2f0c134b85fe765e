/* The products' x86 tiles: AVX2 (with FMA and F16C), and AVX-512 where the build has it.
 *
 * Each tile computes every output it holds in the order quants.h fixes, lane for lane as the portable
 * reference (quants.c) does, so every tile gives the same bits. A tile of several outputs reads their rows
 * side by side, where the file has them (the tiles ahead prefetched as one ordered stream). Rows
 * are taken eight (then four) at a time where the batch has them (each sub-block is decoded once for the
 * tile's rows, and their offset terms are summed side by side in one vector), and one at a time across
 * COL_TILE outputs otherwise (decodes). Where the build has AVX-512, batches of WIDE_MIN rows or more take
 * COL_TILE outputs up to six rows at a time instead, their sub-blocks decoded once per row chunk into a
 * float32 buffer, two outputs' lanes side by side in each 16-lane register: the same operations per lane,
 * so the same bits. One row (a decode) of a K-quant takes ROW_COLS outputs at a time in the row tile: the
 * scales of a super-block computed together ahead of it, then the same operations.
 *
 * The only per-type code is the decoding of a sub-block (decode.h beside this file). A tile takes its type,
 * rows and outputs as constants (DEFINE_TILES instantiates each per type), so that its loops unroll into
 * registers and the decoding inlines; `TILES`, indexed by type, holds every type's tiles.
 */
#include <stdint.h>
#include <stdlib.h>

#include "../../quants.h"
#include "decode.h"

#if HAVE_AVX2
static inline float vector_total(__m256 acc, float offset)
{
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    return lane_sum(lanes) + offset;
}

/* A tile's rows are one stretch of memory (consecutive rows); the next tile's stretch is prefetched in
 * order, `step` bytes of it per sub-block, so that it is all fetched by the time this tile ends. One
 * ordered stream, not one per row: four rows read side by side defeat the hardware prefetchers (without
 * software prefetch, or with one per row stream, rows out of cache were far slower, and fetching further
 * ahead gained nothing: docs/benchmarks.md). */
static ALWAYS_INLINE void prefetch_tile(const uint8_t *tile, int64_t s, size_t step)
{
    const char *at = (const char *)tile + (size_t)s * step;
    for (size_t line = 0; line < step; line += 64)
        _mm_prefetch(at + line, _MM_HINT_T0);
}

/* `prefetch_tile` into the L2 cache only: for tiles so large that the next one, fetched into the L1 data
 * cache (32 KiB) beside this one, would push out this one's lines before they are read (the int16 rows'
 * tiles of more than Q16_L1_TILE bytes: docs/benchmarks.md). */
static ALWAYS_INLINE void prefetch_tile_l2(const uint8_t *tile, int64_t s, size_t step)
{
    const char *at = (const char *)tile + (size_t)s * step;
    for (size_t line = 0; line < step; line += 64)
        _mm_prefetch(at + line, _MM_HINT_T1);
}

/* ROWS rows x COLS outputs (rows `rs` bytes apart); res[r * COLS + c]. Called with constant ROWS and COLS
 * so that it unrolls. */
static ALWAYS_INLINE void vector_tile(int type, int rows, int cols, const uint8_t *w, size_t rs, int64_t ns,
                                      const float *x, int64_t x_stride, const float *sx, int64_t ss, float *res)
{
    const uint8_t *next = w + cols * rs;
    const size_t step = (cols * rs + (size_t)ns - 1) / (size_t)ns;
    __m256 acc[FLOAT_ROW_TILE * COL_TILE];
    float offset[FLOAT_ROW_TILE * COL_TILE];
    /* A row tile's offsets side by side: one fused multiply-add per half, the same as each row's own. */
    const int row_offsets = cols == 1 && (rows == FLOAT_ROW_TILE || rows == ROW_TILE);
    __m256 offsets = _mm256_setzero_ps();
    __m128 offsets4 = _mm_setzero_ps();
    for (int i = 0; i < rows * cols; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0;
    }
    /* The super-block types a super-block at a time, sub-block j of it at a time (no division by 8 per
     * sub-block; unrolling it, as the int16 tile does, spilled this tile's registers). */
    const int spb = TYPE_INFO[type].elems == QK_K ? 8 : 1;
    const size_t ub = sub_offset(type, spb);
    for (int64_t u = 0; u < ns / spb; u++)
#pragma GCC unroll 1
        for (int j = 0; j < spb; j++) {
            const int64_t s = u * spb + j;
            prefetch_tile(next, s, step);
            for (int c = 0; c < cols; c++) {
                const uint8_t *row = w + c * rs + u * ub;
                __m256 v[4];
                x86_values(type, row, j, v);
                float d[2], m[2];
                sub_scales(type, row, j, d, m);
                const __m256 d0 = _mm256_set1_ps(d[0]), d1 = _mm256_set1_ps(d[1]);
                for (int r = 0; r < rows; r++) {
                    const float *xb = x + r * x_stride + s * QK;
                    __m256 *a = &acc[r * cols + c];
                    if (split_scales(type)) {
                        __m256 lo = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
                        lo = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), lo);
                        __m256 hi = _mm256_mul_ps(v[2], _mm256_loadu_ps(xb + 16));
                        hi = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), hi);
                        *a = _mm256_fmadd_ps(d1, hi, _mm256_fmadd_ps(d0, lo, *a));
                    } else {
                        __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
                        t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
                        t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
                        t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
                        *a = _mm256_fmadd_ps(d0, t, *a);
                    }
                    if (has_offset(type) && !row_offsets) {
                        float *o = &offset[r * cols + c];
                        if (split_scales(type))
                            *o = fmaf(m[1], sx[(2 * s + 1) * ss + r], fmaf(m[0], sx[2 * s * ss + r], *o));
                        else
                            *o = fmaf(m[0], sx[s * ss + r], *o);
                    }
                }
                /* The sums of x for this sub-block's offsets: one per 32, or the two halves'. */
                const int units = split_scales(type) ? 2 : 1;
                for (int h = 0; h < units; h++) {
                    const float *sxu = sx + (units * s + h) * ss;
                    if (has_offset(type) && rows == FLOAT_ROW_TILE && row_offsets)
                        offsets = _mm256_fmadd_ps(_mm256_set1_ps(m[h]), _mm256_loadu_ps(sxu), offsets);
                    if (has_offset(type) && rows == ROW_TILE && row_offsets)
                        offsets4 = _mm_fmadd_ps(_mm_set1_ps(m[h]), _mm_loadu_ps(sxu), offsets4);
                }
            }
        }
    if (row_offsets && rows == FLOAT_ROW_TILE)
        _mm256_storeu_ps(offset, offsets);
    if (row_offsets && rows == ROW_TILE)
        _mm_storeu_ps(offset, offsets4);
    for (int i = 0; i < rows * cols; i++)
        res[i] = vector_total(acc[i], offset[i]);
}

/* Outputs of a row tile (vector_range's results hold them). */
#define ROW_COLS 8
_Static_assert(ROW_COLS <= 8 * COL_TILE && CHUNK_TILES * COL_TILE % ROW_COLS == 0, "row tiles fit the runs");

/* One row x `cols` outputs (a decode) of a type of super-blocks: `vector_tile`'s operations for one row.
 * The scales and offsets of a super-block are computed for every output before its eight sub-blocks
 * (super_scales), so that their loop keeps to decoding and the fused multiply-adds: unpacked one
 * sub-block at a time in that loop, as `vector_tile` does, they cost about as much as the vector work. */
static ALWAYS_INLINE void row_tile(int type, int cols, const uint8_t *w, size_t rs, int64_t ns, const float *x,
                                   const float *sx, int64_t ss, float *res)
{
    const uint8_t *next = w + cols * rs;
    const size_t step = (cols * rs + (size_t)ns - 1) / (size_t)ns;
    const int split = split_scales(type);
    __m256 acc[ROW_COLS];
    float offset[ROW_COLS];
    for (int c = 0; c < cols; c++) {
        acc[c] = _mm256_setzero_ps();
        offset[c] = 0;
    }
    for (int64_t u = 0; u < ns / 8; u++) {
        const size_t at = (size_t)u * (size_t)TYPE_INFO[type].bytes;
        float d[ROW_COLS][16], m[ROW_COLS][16];
        for (int c = 0; c < cols; c++)
            super_scales(type, w + c * rs + at, d[c], m[c]);
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            const int64_t s = 8 * u + j;
            prefetch_tile(next, s, step);
            const float *xb = x + s * QK;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                         x3 = _mm256_loadu_ps(xb + 24);
            for (int c = 0; c < cols; c++) {
                __m256 v[4];
                x86_values(type, w + c * rs + at, j, v);
                if (split) {
                    const __m256 lo = _mm256_fmadd_ps(v[1], x1, _mm256_mul_ps(v[0], x0));
                    const __m256 hi = _mm256_fmadd_ps(v[3], x3, _mm256_mul_ps(v[2], x2));
                    acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d[c][2 * j + 1]), hi,
                                             _mm256_fmadd_ps(_mm256_set1_ps(d[c][2 * j]), lo, acc[c]));
                } else {
                    __m256 t = _mm256_mul_ps(v[0], x0);
                    t = _mm256_fmadd_ps(v[1], x1, t);
                    t = _mm256_fmadd_ps(v[2], x2, t);
                    t = _mm256_fmadd_ps(v[3], x3, t);
                    acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d[c][j]), t, acc[c]);
                }
                if (has_offset(type) && split)
                    offset[c] =
                        fmaf(m[c][2 * j + 1], sx[(2 * s + 1) * ss], fmaf(m[c][2 * j], sx[2 * s * ss], offset[c]));
                else if (has_offset(type))
                    offset[c] = fmaf(m[c][j], sx[s * ss], offset[c]);
            }
        }
    }
    for (int c = 0; c < cols; c++)
        res[c] = vector_total(acc[c], offset[c]);
}

/* ---- int16 rows (quants.c says how; quants.h the order). Each sub-block's integer sums are exact, so the
 * tiles add them in whatever order suits them; the float operations per sub-block are the portable ones. */

/* Outputs of a few-row int16 tile, and of the group tiles (AVX2, AVX-512): as many as keep their sums and
 * totals in registers. */
#define Q16_ROW_COLS 8
#define Q16_COLS 4
#define Q16_WIDE_COLS 8
/* Bytes of a few-row tile's weights above which the next tile is prefetched into the L2 cache only. */
#define Q16_L1_TILE 8192
/* Activation bytes of a chunk of rows: it is read again for every Q16_COLS outputs, so it should stay in the
 * L2 cache; its outputs' sub-blocks are widened once per chunk. */
#define Q16_CHUNK_BYTES (1 << 20)

/* int32 lanes plus the products of a's and b's int16 pairs: one vpdpwssd where the build has VNNI for
 * 256-bit registers (AVX-VNNI, or AVX-512 VNNI with VL), else a multiply-add of pairs and an addition. */
static ALWAYS_INLINE __m256i dot_pairs8(__m256i acc, __m256i a, __m256i b)
{
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif HAVE_AVX512_VNNI && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

#if HAVE_AVX512_VBMI
/* Sub-block j's quants as 32 int16 in one register, plus `q16_bias(type)`: the byte-permute decoding's
 * biased bytes widened (Q8_0's bytes are its quants), one operation more than the bytes. */
static ALWAYS_INLINE int q16_bias(int type) { return type == TYPE_Q8_0 ? 0 : quant_bias(type); }

static ALWAYS_INLINE __m512i q16_quants(int type, const uint8_t *row, int64_t j)
{
    if (type == TYPE_Q8_0)
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + 34 * j + 2)));
    return _mm512_cvtepu8_epi16(x86_biased(type, row, j));
}

/* Whether the few-row tiles take the type's biased quants as bytes (VNNI for 256-bit registers): those below
 * 128, a signed byte as well as an unsigned one (not Q8_0's nor IQ4's, biased by 128). An int16
 * activation a is 256 h + l, l its low byte (unsigned) and h its high one (signed), so that a quant w
 * times a is 256 (w h) + w l: two byte dot products (vpdpbusd, four products per lane) of the quants
 * as they are decoded, where widening them to int16 takes one more operation on twice the width. Exact
 * (|256 (w h)| <= 4 * 127 * 128 * 256 per lane, the total at most 4 * 127 * 32767), so the same sums. */
static ALWAYS_INLINE int q16_bytes(int type)
{
#if defined(__AVX512VL__) && HAVE_AVX512_VNNI
    return type != TYPE_Q8_0 && quant_bias(type) < 128;
#else
    (void)type;
    return 0;
#endif
}

/* A sub-block's 32 int16 activations as bytes: the low ones (unsigned) in the low 256 bits, the high ones
 * (signed) in the high 256 bits. */
static ALWAYS_INLINE __m512i q16_split(__m512i x)
{
    const __m512i order = _mm512_set_epi8(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11,
        9, 7, 5, 3, 1, 62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24, 22, 20, 18,
        16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutexvar_epi8(order, x);
}

#if defined(__AVX512VL__) && HAVE_AVX512_VNNI
/* Eight int32 lanes (lane i: elements 4i .. 4i + 3) of byte quants q (0..127) times int16 activations split
 * as q16_split: 256 times q's products with the high bytes, plus the low bytes' products with q. */
static ALWAYS_INLINE __m256i dot_bytes8(__m256i q, __m512i x)
{
    const __m256i high = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, _mm512_extracti64x4_epi64(x, 1));
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(high, 8), _mm512_castsi512_si256(x), q);
}

/* Byte i of half h's bytes (q16_split_half): element 16 h + i % 16's low byte (i < 32) or high byte. */
static const uint8_t SPLIT_HALF[2][64] __attribute__((aligned(64))) = {
    {
     0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
     0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
     1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
     1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
    },
    {
     32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
     32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63,
     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63,
    },
};

/* Half `half` (elements 16 half .. 16 half + 15) of a sub-block's 32 int16 activations as bytes for
 * `dot_paired8`: their low bytes (unsigned) in both 128-bit quarters of the low 256 bits, their high
 * bytes (signed) in both of the high 256 bits. */
static ALWAYS_INLINE __m512i q16_split_half(__m512i x, int half)
{
    return _mm512_permutexvar_epi8(_mm512_load_si512((const void *)SPLIT_HALF[half]), x);
}

/* Two outputs' sums side by side, four int32 lanes each (`q16_rows_tile`'s pairing): q0 holds output a's
 * elements 0..15 in its low 128 bits and output b's in its high 128 bits, q1 their elements 16..31; x0
 * and x1 are the activations' halves as q16_split_half. The high bytes' products over the 32 elements
 * first, once shifted, then the low bytes': four byte dot products and a shift for two outputs, where
 * dot_bytes8 takes three operations for each. Exact: a lane's high sum is at most 8 * 127 * 128 before
 * the shift, its total at most 8 * 127 * 32767. */
static ALWAYS_INLINE __m256i dot_paired8(__m256i q0, __m256i q1, __m512i x0, __m512i x1)
{
    __m256i high = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q0, _mm512_extracti64x4_epi64(x0, 1));
    high = _mm256_dpbusd_epi32(high, q1, _mm512_extracti64x4_epi64(x1, 1));
    const __m256i low = _mm256_dpbusd_epi32(_mm256_slli_epi32(high, 8), _mm512_castsi512_si256(x0), q0);
    return _mm256_dpbusd_epi32(low, _mm512_castsi512_si256(x1), q1);
}
#endif
#endif

/* The first level of two vectors' lane sums, per 128 bits: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]. Exact
 * integers, so any order of the sums gives the same bits; two unpacks and an add, where vphaddd takes two
 * cycles a time here (AMD Zen 4: its throughput was a quarter of an unpack's). */
static ALWAYS_INLINE __m256i pair_sums(__m256i a, __m256i b)
{
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* The next level, of two `pair_sums` (outputs a, b, then c, d): per 128 bits, each output's four lanes'
 * sum, [a, b, c, d]. */
static ALWAYS_INLINE __m256i quad_sums(__m256i ab, __m256i cd)
{
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* Eight vectors' lane sums, vector c's in lane c, from h[i] = pair_sums(v[2i], v[2i + 1]). */
static ALWAYS_INLINE __m256i sum_pairs8(const __m256i h[4])
{
    const __m256i q = quad_sums(h[0], h[1]), r = quad_sums(h[2], h[3]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(q, r, 0x20), _mm256_permute2x128_si256(q, r, 0x31));
}

/* From h[i] = pair_sums(v[2i], v[2i + 1]) of eight vectors whose lanes 0..3 hold a low half's sums and 4..7
 * a high half's: vector c's low sum in lane c of *lo, its high sum in lane c of *hi (`sum_pairs8` is their
 * sum). */
static ALWAYS_INLINE void sum_halves8(const __m256i h[4], __m256i *lo, __m256i *hi)
{
    const __m256i q = quad_sums(h[0], h[1]), r = quad_sums(h[2], h[3]);
    *lo = _mm256_permute2x128_si256(q, r, 0x20);
    *hi = _mm256_permute2x128_si256(q, r, 0x31);
}

#if HAVE_AVX512_VBMI
/* vphaddd on 16 lanes: per 128 bits, a's adjacent pairs' sums then b's. */
static ALWAYS_INLINE __m512i hadd16(__m512i a, __m512i b)
{
    const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0x88)),
                            _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0xdd)));
}

/* `sum_pairs8` on eight vectors of 16 lanes, their low eight lanes (a low half's pair sums) and high eight
 * summed apart: vector c's low sum in lane c of *lo, its high sum in lane c of *hi. */
static ALWAYS_INLINE void sum_pairs16(const __m512i h[4], __m256i *lo, __m256i *hi)
{
    const __m512i q = hadd16(h[0], h[1]), r = hadd16(h[2], h[3]);
    /* Per 128 bits, q holds vectors 0..3's partial sums, r 4..7's; the low halves' in its first two. */
    const __m512i sum = _mm512_add_epi32(_mm512_shuffle_i32x4(q, r, 0x88), _mm512_shuffle_i32x4(q, r, 0xdd));
    *lo = _mm512_castsi512_si256(_mm512_shuffle_i32x4(sum, sum, 0x08));
    *hi = _mm512_castsi512_si256(_mm512_shuffle_i32x4(sum, sum, 0x0d));
}
#endif

/* Columns col0 .. col0 + 7 of eight outputs' scales (in[c][k]) as out[k][c]: one vector per column. */
static ALWAYS_INLINE void transpose8(float in[][16], int col0, float out[][8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        const __m256 a = _mm256_loadu_ps(&in[2 * i][col0]), b = _mm256_loadu_ps(&in[2 * i + 1][col0]);
        t[2 * i] = _mm256_unpacklo_ps(a, b);
        t[2 * i + 1] = _mm256_unpackhi_ps(a, b);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_ps(out[k], _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
        _mm256_storeu_ps(out[k + 4], _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
    }
}

/* The types with blocks of 32 whose scale (and offset) are float16 fields at the block's start. */
static ALWAYS_INLINE int f16_scales(int type)
{
    return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q5_0 || type == TYPE_Q5_1 ||
           type == TYPE_Q8_0 || type == TYPE_IQ4_NL;
}

/* Eight outputs' float16 fields at `at` of their rows (`rs` apart) as floats: sub_scales' values. */
static ALWAYS_INLINE __m256 f16_fields8(const uint8_t *w, size_t rs, size_t at)
{
    return _mm256_cvtph_ps(_mm_setr_epi16((short)read_u16(w + at), (short)read_u16(w + rs + at),
                                          (short)read_u16(w + 2 * rs + at), (short)read_u16(w + 3 * rs + at),
                                          (short)read_u16(w + 4 * rs + at), (short)read_u16(w + 5 * rs + at),
                                          (short)read_u16(w + 6 * rs + at), (short)read_u16(w + 7 * rs + at)));
}

/* Eight outputs' MXFP4 scale bytes at `at` of their rows (`rs` apart) as floats: e8m0_half's values. */
static ALWAYS_INLINE __m256 e8m0_fields8(const uint8_t *w, size_t rs, size_t at)
{
    const __m256i e = _mm256_setr_epi32(w[at], w[rs + at], w[2 * rs + at], w[3 * rs + at], w[4 * rs + at],
                                        w[5 * rs + at], w[6 * rs + at], w[7 * rs + at]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* Sixteen bytes at `at` of eight outputs' rows (`rs` apart) as four vectors: vector k holds each output's
 * bytes 4k .. 4k + 3 in its lane c. */
static ALWAYS_INLINE void dwords8(const uint8_t *w, size_t rs, size_t at, __m256i v[4])
{
    __m256i a[4];
    for (int c = 0; c < 4; c++)
        a[c] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(w + (c + 4) * rs + at)),
                                _mm_loadu_si128((const __m128i *)(w + c * rs + at)));
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* super_scales of eight outputs' super-blocks at w (`rs` apart), output c's in lane c: sdt[k][c] and
 * smt[k][c] are its d[k] and m[k]. The same products (each integer scale converted, times the float16
 * field; the offsets times the negated field, the same bits as negating the product), computed for the
 * eight outputs side by side, where super_scales and a transpose took one output at a time. Q4_K, Q5_K
 * and Q6_K. */
static ALWAYS_INLINE void super_scales8(int type, const uint8_t *w, size_t rs, float sdt[][Q16_ROW_COLS],
                                        float smt[][Q16_ROW_COLS])
{
    __m256i v[4];
    if (type == TYPE_Q6_K) {
        dwords8(w, rs, 192, v);
        const __m256 d = f16_fields8(w, rs, 208);
        for (int k = 0; k < 16; k++) {
            const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(v[k / 4], 24 - 8 * (k % 4)), 24);
            _mm256_storeu_ps(sdt[k], _mm256_mul_ps(_mm256_cvtepi32_ps(sc), d));
        }
        return;
    }
    /* Q4_K, Q5_K: v[0] is the float16 d and dmin, v[1], v[2], v[3] the packed scales' bytes 0-3, 4-7 and
     * 8-11 (super_scales' w[0..2]). The eight 6-bit scales and offsets are put together bytewise first,
     * four to a lane (byte j % 4 of sc[j / 4], mn[j / 4]), then each taken out by one byte shuffle. */
    dwords8(w, rs, 0, v);
#if defined(__AVX512VL__)
    const __m256 d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(v[0]));
    const __m256 dmin = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(v[0], 16)));
#else
    const __m256 d = f16_fields8(w, rs, 0), dmin = f16_fields8(w, rs, 2);
#endif
    const __m256 neg_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f));
    const __m256i six = _mm256_set1_epi8(0x3f), four = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    const __m256i sc[2] = {_mm256_and_si256(v[1], six),
                           _mm256_or_si256(_mm256_and_si256(v[3], four),
                                           _mm256_and_si256(_mm256_srli_epi32(v[1], 2), top))};
    const __m256i mn[2] = {_mm256_and_si256(v[2], six),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v[3], 4), four),
                                           _mm256_and_si256(_mm256_srli_epi32(v[2], 2), top))};
    for (int j = 0; j < 8; j++) {
        const char k = (char)(j % 4), z = (char)0x80;
        const __m256i pick = _mm256_setr_epi8(k, z, z, z, k + 4, z, z, z, k + 8, z, z, z, k + 12, z, z, z, k, z, z,
                                              z, k + 4, z, z, z, k + 8, z, z, z, k + 12, z, z, z);
        _mm256_storeu_ps(sdt[j], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(sc[j / 4], pick)), d));
        _mm256_storeu_ps(smt[j], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(mn[j / 4], pick)), neg_dmin));
    }
}

/* `rows` int16 rows (Q16_FEW_ROWS at most, `xs` apart) x `cols` outputs (Q16_ROW_COLS, or 1 for the last
 * outputs), decoded from the file once for all the rows: per sub-block each output's quants times each
 * row's by pairs, the eight outputs' lanes summed into one lane each per row (two outputs at a time, so
 * that few sums stay live), and each row's float chains (and offset terms) side by side in one vector.
 * res[r * Q16_ROW_COLS + c]. With AVX-512 VBMI the quants are the byte-permute decoding's, biased
 * (quant_bias): the bias times the row's sum over the sub-block (or half, `xsum`) is taken off the integer
 * sums, exactly (at most 32 * 255 * 32767 < 2^31); the types whose biased quants are below 128 multiply
 * them as bytes (q16_bytes, with VNNI), the others widened to int16, the split types' two halves then
 * summed in one 16-lane register. */
static ALWAYS_INLINE void q16_rows_tile(int type, int rows, int cols, const uint8_t *w, size_t rs, int64_t ns,
                                        const int16_t *xq, int64_t xs, const float *dx, const float *sx,
                                        const int32_t *xsum, int64_t ss, float *res)
{
    const uint8_t *next = w + cols * rs;
    const size_t step = (cols * rs + (size_t)ns - 1) / (size_t)ns;
    const int split = split_scales(type);
    __m256 acc[Q16_FEW_ROWS], offset[Q16_FEW_ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = offset[r] = _mm256_setzero_ps();
    /* The super-block types a super-block at a time, its eight sub-blocks unrolled (their place in it a
     * constant: decode.h's bit positions and scales fold). */
    const int spb = TYPE_INFO[type].elems == QK_K ? 8 : 1;
    const size_t ub = sub_offset(type, spb);
    /* The scales of the types super_scales reads, a super-block's for every output ahead of its sub-blocks
     * (the same values as sub_scales, in fewer operations). */
    const int together = type == TYPE_Q2_K || type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K;
    float sd[Q16_ROW_COLS][16], sm[Q16_ROW_COLS][16];
    /* With eight outputs, their scales and offsets side by side, one vector per sub-block (or half): the
     * K-quants' unpacked for the eight at once per super-block (Q2_K's one output at a time, then
     * transposed), the float16 and E8M0 fields of the blocks of 32 read eight at a time. */
    const int by_vector = cols == Q16_ROW_COLS && (together || f16_scales(type) || type == TYPE_MXFP4);
    float sdt[16][Q16_ROW_COLS], smt[16][Q16_ROW_COLS];
    /* The K-quants but Q2_K take their eight outputs' scales side by side (super_scales8). */
    const int side_by_side = by_vector && together && type != TYPE_Q2_K;
    /* The types taken as bytes without split scales, eight outputs at a time with their scales side by
     * side: outputs c and c + 4 share a vector (dot_paired8), so that each output's sum lies in four lanes,
     * not eight: the lanes' sums then take a third of the operations (two levels of `pair_sums` and
     * `quad_sums` for the eight, in output order). */
#if HAVE_AVX512_VBMI && defined(__AVX512VL__) && HAVE_AVX512_VNNI
    const int paired = q16_bytes(type) && !split && by_vector;
#endif
    for (int64_t u = 0; u < ns / spb; u++) {
        if (side_by_side)
            super_scales8(type, w + u * ub, rs, sdt, smt);
        for (int c = 0; together && !side_by_side && c < cols; c++)
            super_scales(type, w + c * rs + u * ub, sd[c], sm[c]);
        for (int k0 = 0; together && by_vector && !side_by_side && k0 < (split ? 16 : 8); k0 += 8) {
            transpose8(sd, k0, sdt + k0);
            if (has_offset(type))
                transpose8(sm, k0, smt + k0);
        }
#pragma GCC unroll 8
        for (int j = 0; j < spb; j++) {
            const int64_t s = u * spb + j;
            if (cols * rs > Q16_L1_TILE)
                prefetch_tile_l2(next, s, step);
            else
                prefetch_tile(next, s, step);
            /* Each row's activations as two halves of 16, and (VBMI) its sums over each half, for the bias. */
            __m256i x_lo[Q16_FEW_ROWS], x_hi[Q16_FEW_ROWS];
#if HAVE_AVX512_VBMI
            __m512i x16[Q16_FEW_ROWS], x8[Q16_FEW_ROWS];
#if defined(__AVX512VL__) && HAVE_AVX512_VNNI
            __m512i x8_0[Q16_FEW_ROWS], x8_1[Q16_FEW_ROWS];
#endif
#endif
            for (int r = 0; r < rows; r++) {
                const int16_t *xb = xq + r * xs + s * QK;
                x_lo[r] = _mm256_loadu_si256((const __m256i *)xb);
                x_hi[r] = _mm256_loadu_si256((const __m256i *)(xb + 16));
#if HAVE_AVX512_VBMI
                x16[r] = _mm512_loadu_si512((const void *)xb);
#if defined(__AVX512VL__) && HAVE_AVX512_VNNI
                if (paired) {
                    x8_0[r] = q16_split_half(x16[r], 0);
                    x8_1[r] = q16_split_half(x16[r], 1);
                    continue;
                }
#endif
                if (q16_bytes(type))
                    x8[r] = q16_split(x16[r]);
#endif
            }
            /* Per row, the outputs' pair sums after the first level of the lanes' sums (h: the low half, or
             * the whole sub-block; h_hi: the high half of a split type without VBMI; h16: both halves of a
             * split type with VBMI). */
            __m256i h[Q16_FEW_ROWS][Q16_ROW_COLS / 2];
#if HAVE_AVX512_VBMI
            __m512i h16[Q16_FEW_ROWS][Q16_ROW_COLS / 2];
#else
            __m256i h_hi[Q16_FEW_ROWS][Q16_ROW_COLS / 2];
#endif
            float d0[Q16_ROW_COLS] = {0}, d1[Q16_ROW_COLS] = {0}, m0[Q16_ROW_COLS] = {0}, m1[Q16_ROW_COLS] = {0};
#if HAVE_AVX512_VBMI && defined(__AVX512VL__) && HAVE_AVX512_VNNI
            /* Paired: h[r][0] holds outputs 0, 1, 4, 5 after the first level, h[r][1] outputs 2, 3, 6, 7
             * (their scales are read below, eight at a time). */
            for (int k2 = 0; paired && k2 < 2; k2++) {
                __m256i lo[Q16_FEW_ROWS][2];
                for (int e = 0; e < 2; e++) {
                    const int c = 2 * k2 + e;
                    const __m256i a = x86_biased(type, w + c * rs + u * ub, j);
                    const __m256i b = x86_biased(type, w + (c + 4) * rs + u * ub, j);
                    const __m256i q0 = _mm256_permute2x128_si256(a, b, 0x20);
                    const __m256i q1 = _mm256_permute2x128_si256(a, b, 0x31);
                    for (int r = 0; r < rows; r++)
                        lo[r][e] = dot_paired8(q0, q1, x8_0[r], x8_1[r]);
                }
                for (int r = 0; r < rows; r++)
                    h[r][k2] = pair_sums(lo[r][0], lo[r][1]);
            }
            for (int c2 = 0; !paired && c2 < Q16_ROW_COLS / 2; c2++) {
#else
            for (int c2 = 0; c2 < Q16_ROW_COLS / 2; c2++) {
#endif
                __m256i lo[Q16_FEW_ROWS][2];
#if HAVE_AVX512_VBMI
                __m512i both[Q16_FEW_ROWS][2];
#else
                __m256i hi[Q16_FEW_ROWS][2];
#endif
                for (int e = 0; e < 2; e++) {
                    const int c = 2 * c2 + e;
                    if (c >= cols) {
                        for (int r = 0; r < rows; r++) {
                            lo[r][e] = _mm256_setzero_si256();
#if HAVE_AVX512_VBMI
                            both[r][e] = _mm512_setzero_si512();
#else
                            hi[r][e] = _mm256_setzero_si256();
#endif
                        }
                        continue;
                    }
                    const uint8_t *row = w + c * rs + u * ub;
#if HAVE_AVX512_VBMI
#if defined(__AVX512VL__) && HAVE_AVX512_VNNI
                    if (q16_bytes(type)) {
                        const __m256i q = x86_biased(type, row, j);
                        for (int r = 0; r < rows; r++)
                            lo[r][e] = dot_bytes8(q, x8[r]);
                    }
#endif
                    const __m512i q = q16_bytes(type) ? _mm512_setzero_si512() : q16_quants(type, row, j);
                    for (int r = 0; r < rows && !q16_bytes(type); r++) {
                        if (split)
                            both[r][e] = _mm512_madd_epi16(q, x16[r]);
                        else
                            lo[r][e] = dot_pairs8(_mm256_madd_epi16(_mm512_castsi512_si256(q), x_lo[r]),
                                                  _mm512_extracti64x4_epi64(q, 1), x_hi[r]);
                    }
#else
                    __m128i b_lo, b_hi;
                    x86_quants(type, row, j, &b_lo, &b_hi);
                    const __m256i q_lo = _mm256_cvtepi8_epi16(b_lo), q_hi = _mm256_cvtepi8_epi16(b_hi);
                    for (int r = 0; r < rows; r++) {
                        lo[r][e] = _mm256_madd_epi16(q_lo, x_lo[r]);
                        if (split)
                            hi[r][e] = _mm256_madd_epi16(q_hi, x_hi[r]);
                        else
                            lo[r][e] = dot_pairs8(lo[r][e], q_hi, x_hi[r]);
                    }
#endif
                    float d[2], m[2];
                    if (by_vector) {
                        continue;
                    } else if (together) {
                        const int k = split ? 2 * j : j, k1 = split ? k + 1 : k;
                        d[0] = sd[c][k];
                        d[1] = sd[c][k1];
                        m[0] = sm[c][k];
                        m[1] = sm[c][k1];
                    } else {
                        sub_scales(type, row, j, d, m);
                    }
                    d0[c] = d[0];
                    d1[c] = d[1];
                    m0[c] = m[0];
                    m1[c] = m[1];
                }
                for (int r = 0; r < rows; r++) {
#if HAVE_AVX512_VBMI
                    if (split && !q16_bytes(type))
                        h16[r][c2] = hadd16(both[r][0], both[r][1]);
                    else
                        h[r][c2] = pair_sums(lo[r][0], lo[r][1]);
#else
                    h[r][c2] = pair_sums(lo[r][0], lo[r][1]);
                    if (split)
                        h_hi[r][c2] = pair_sums(hi[r][0], hi[r][1]);
#endif
                }
            }
            __m256 d0v = _mm256_loadu_ps(d0), d1v = _mm256_loadu_ps(d1);
            __m256 m0v = _mm256_loadu_ps(m0), m1v = _mm256_loadu_ps(m1);
            if (by_vector && together) {
                const int k = split ? 2 * j : j, k1 = split ? k + 1 : k;
                d0v = _mm256_loadu_ps(sdt[k]);
                d1v = _mm256_loadu_ps(sdt[k1]);
                if (has_offset(type)) {
                    m0v = _mm256_loadu_ps(smt[k]);
                    m1v = _mm256_loadu_ps(smt[k1]);
                }
            } else if (by_vector) {
                const size_t at = (size_t)u * ub;
                d0v = d1v = type == TYPE_MXFP4 ? e8m0_fields8(w, rs, at) : f16_fields8(w, rs, at);
                if (has_offset(type))
                    m0v = m1v = f16_fields8(w, rs, at + 2);
            }
            for (int r = 0; r < rows; r++) {
                __m256i sum_lo, sum_hi = _mm256_setzero_si256();
#if HAVE_AVX512_VBMI
#if defined(__AVX512VL__) && HAVE_AVX512_VNNI
                if (paired)
                    sum_lo = quad_sums(h[r][0], h[r][1]);
                else
#endif
                if (split && q16_bytes(type))
                    sum_halves8(h[r], &sum_lo, &sum_hi);
                else if (split)
                    sum_pairs16(h16[r], &sum_lo, &sum_hi);
                else
                    sum_lo = sum_pairs8(h[r]);
                const int32_t x_lo_sum = xsum[2 * s * ss + r], x_hi_sum = xsum[(2 * s + 1) * ss + r];
                if (q16_bias(type) && split) {
                    sum_lo = _mm256_sub_epi32(sum_lo, _mm256_set1_epi32(q16_bias(type) * x_lo_sum));
                    sum_hi = _mm256_sub_epi32(sum_hi, _mm256_set1_epi32(q16_bias(type) * x_hi_sum));
                } else if (q16_bias(type)) {
                    sum_lo = _mm256_sub_epi32(sum_lo, _mm256_set1_epi32(q16_bias(type) * (x_lo_sum + x_hi_sum)));
                }
#else
                (void)xsum;
                sum_lo = sum_pairs8(h[r]);
                if (split)
                    sum_hi = sum_pairs8(h_hi[r]);
#endif
                const __m256 x_scale = _mm256_set1_ps(dx[s * ss + r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lo), _mm256_mul_ps(d0v, x_scale), acc[r]);
                if (split)
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_hi), _mm256_mul_ps(d1v, x_scale), acc[r]);
                /* Each output's offset chain in its lane: the same fused multiply-adds as one at a time. */
                if (has_offset(type) && split) {
                    offset[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(sx[2 * s * ss + r]), offset[r]);
                    offset[r] = _mm256_fmadd_ps(m1v, _mm256_set1_ps(sx[(2 * s + 1) * ss + r]), offset[r]);
                } else if (has_offset(type)) {
                    offset[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(sx[s * ss + r]), offset[r]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float lanes[Q16_ROW_COLS], off[Q16_ROW_COLS];
        _mm256_storeu_ps(lanes, acc[r]);
        _mm256_storeu_ps(off, offset[r]);
        for (int c = 0; c < cols; c++)
            res[r * Q16_ROW_COLS + c] = lanes[c] + off[c];
    }
}

/* `q16_rows_tile` with its rows and outputs as constants. */
static ALWAYS_INLINE void q16_rows_of(int type, int rows, int cols, const uint8_t *w, size_t rs, int64_t ns,
                                      const int16_t *xq, int64_t xs, const float *dx, const float *sx,
                                      const int32_t *xsum, int64_t ss, float *res)
{
#define Q16_ROWS(R)                                                                                       \
    do {                                                                                                 \
        if (cols == Q16_ROW_COLS)                                                                        \
            q16_rows_tile(type, R, Q16_ROW_COLS, w, rs, ns, xq, xs, dx, sx, xsum, ss, res);              \
        else                                                                                             \
            q16_rows_tile(type, R, 1, w, rs, ns, xq, xs, dx, sx, xsum, ss, res);                         \
    } while (0)
    _Static_assert(Q16_FEW_ROWS == 4 || Q16_FEW_ROWS == 5, "one case per row count");
    if (rows == 1)
        Q16_ROWS(1);
    else if (rows == 2)
        Q16_ROWS(2);
    else if (rows == 3)
        Q16_ROWS(3);
    else if (rows == 4 || Q16_FEW_ROWS == 4)
        Q16_ROWS(4);
    else
        Q16_ROWS(Q16_FEW_ROWS);
#undef Q16_ROWS
}

/* `cols` outputs' sub-blocks widened to int16 once for the row groups of a chunk: output c's pair k of
 * sub-block s (elements 2k, 2k + 1 as one int32) at wb[c * n_in / 2 + 16 s + k], its halves' scales and
 * offsets at db and mb [(c * ns + s) * 2 + h]. */
static ALWAYS_INLINE void q16_widen(int type, int cols, const uint8_t *w, size_t rs, int64_t ns, int32_t *wb,
                                    float *db, float *mb)
{
    const int spb = TYPE_INFO[type].elems == QK_K ? 8 : 1;
    const size_t ub = sub_offset(type, spb);
    const int together = type == TYPE_Q2_K || type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K;
    const int split = split_scales(type);
    for (int c = 0; c < cols; c++)
        for (int64_t u = 0; u < ns / spb; u++) {
            /* As in q16_rows_tile: the K-quants' scales a super-block at a time. */
            float sd[16], sm[16] = {0};
            if (together)
                super_scales(type, w + c * rs + u * ub, sd, sm);
#pragma GCC unroll 8
            for (int j = 0; j < spb; j++) {
                const int64_t s = u * spb + j, at = (c * ns + s) * 2;
                const uint8_t *row = w + c * rs + u * ub;
                int32_t *to = wb + (c * ns + s) * (QK / 2);
#if HAVE_AVX512_VBMI
                _mm512_storeu_si512((void *)to,
                                    _mm512_sub_epi16(q16_quants(type, row, j), _mm512_set1_epi16((short)q16_bias(type))));
#else
                __m128i q_lo, q_hi;
                x86_quants(type, row, j, &q_lo, &q_hi);
                _mm256_storeu_si256((__m256i *)to, _mm256_cvtepi8_epi16(q_lo));
                _mm256_storeu_si256((__m256i *)(to + 8), _mm256_cvtepi8_epi16(q_hi));
#endif
                float d[2], m[2];
                if (together) {
                    const int k = split ? 2 * j : j, k1 = split ? k + 1 : k;
                    d[0] = sd[k];
                    d[1] = sd[k1];
                    m[0] = sm[k];
                    m[1] = sm[k1];
                } else {
                    sub_scales(type, row, j, d, m);
                }
                db[at] = d[0];
                db[at + 1] = d[1];
                mb[at] = m[0];
                mb[at + 1] = m[1];
            }
        }
}

/* The outputs' offset terms for the lanes' rows: each output's m times the rows' sums, in sub-block order,
 * the outputs' chains side by side (one chain at a time waits on each fused multiply-add's latency). */
#define Q16_OFFSETS(VEC, SET1, LOAD, FMADD, off)                                                         \
    do {                                                                                                 \
        for (int64_t s = 0; s < ns; s++) {                                                               \
            if (split_scales(type)) {                                                                    \
                const VEC lo = LOAD(sx + 2 * s * ss), hi = LOAD(sx + (2 * s + 1) * ss);                  \
                for (int c = 0; c < cols; c++) {                                                         \
                    const float *m = mb + (c * ns + s) * 2;                                              \
                    off[c] = FMADD(SET1(m[0]), lo, off[c]);                                              \
                    off[c] = FMADD(SET1(m[1]), hi, off[c]);                                              \
                }                                                                                        \
            } else {                                                                                     \
                const VEC all = LOAD(sx + s * ss);                                                       \
                for (int c = 0; c < cols; c++)                                                           \
                    off[c] = FMADD(SET1(mb[(c * ns + s) * 2]), all, off[c]);                             \
            }                                                                                            \
        }                                                                                                \
    } while (0)

/* Eight int16 rows (one per lane; half a group of xt) x `cols` widened outputs: per sub-block and pair k,
 * the rows' pairs times output c's pair broadcast (dot_pairs8), added in int32; then each output's float
 * chain for the eight rows side by side. res[c * 8 + l]. */
static ALWAYS_INLINE void q16_group8(int type, int cols, const int32_t *wb, const float *db, const float *mb,
                                     int64_t ns, const int32_t *xt, const float *dx, const float *sx,
                                     int64_t ss, float *res)
{
    const int halves = split_scales(type) ? 2 : 1, per = (QK / 2) / halves;
    __m256 acc[Q16_COLS];
    for (int c = 0; c < cols; c++)
        acc[c] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        const __m256 x_scale = _mm256_loadu_ps(dx + s * ss);
        const int32_t *xs = xt + s * (QK / 2) * Q16_GROUP;
        for (int h = 0; h < halves; h++) {
            __m256i sum[Q16_COLS];
            for (int c = 0; c < cols; c++)
                sum[c] = _mm256_setzero_si256();
            for (int k = h * per; k < (h + 1) * per; k++) {
                const __m256i xk = _mm256_loadu_si256((const __m256i *)(xs + k * Q16_GROUP));
                for (int c = 0; c < cols; c++)
                    sum[c] = dot_pairs8(sum[c], xk, _mm256_set1_epi32(wb[(c * ns + s) * (QK / 2) + k]));
            }
            for (int c = 0; c < cols; c++)
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[c]),
                                         _mm256_mul_ps(_mm256_set1_ps(db[(c * ns + s) * 2 + h]), x_scale), acc[c]);
        }
    }
    __m256 off[Q16_COLS];
    for (int c = 0; c < cols; c++)
        off[c] = _mm256_setzero_ps();
    if (has_offset(type))
        Q16_OFFSETS(__m256, _mm256_set1_ps, _mm256_loadu_ps, _mm256_fmadd_ps, off);
    for (int c = 0; c < cols; c++)
        _mm256_storeu_ps(res + c * 8, _mm256_add_ps(acc[c], off[c]));
}

#if HAVE_AVX512
/* int32 lanes plus the products of a's and b's int16 pairs: one vpdpwssd with VNNI. */
static ALWAYS_INLINE __m512i dot_pairs(__m512i acc, __m512i a, __m512i b)
{
#if HAVE_AVX512_VNNI
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* `q16_group8` on a whole group of Q16_GROUP rows in 16-lane registers: the same operations per lane.
 * res[c * 16 + l]. */
static ALWAYS_INLINE void q16_group16(int type, int cols, const int32_t *wb, const float *db, const float *mb,
                                      int64_t ns, const int32_t *xt, const float *dx, const float *sx,
                                      int64_t ss, float *res)
{
    const int halves = split_scales(type) ? 2 : 1, per = (QK / 2) / halves;
    __m512 acc[Q16_WIDE_COLS];
    for (int c = 0; c < cols; c++)
        acc[c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        const __m512 x_scale = _mm512_loadu_ps(dx + s * ss);
        const int32_t *xs = xt + s * (QK / 2) * Q16_GROUP;
        for (int h = 0; h < halves; h++) {
            __m512i sum[Q16_WIDE_COLS];
            for (int c = 0; c < cols; c++)
                sum[c] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int k = h * per; k < (h + 1) * per; k++) {
                const __m512i xk = _mm512_loadu_si512((const void *)(xs + k * Q16_GROUP));
                for (int c = 0; c < cols; c++)
                    sum[c] = dot_pairs(sum[c], xk, _mm512_set1_epi32(wb[(c * ns + s) * (QK / 2) + k]));
            }
            for (int c = 0; c < cols; c++)
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[c]),
                                         _mm512_mul_ps(_mm512_set1_ps(db[(c * ns + s) * 2 + h]), x_scale), acc[c]);
        }
    }
    __m512 off[Q16_WIDE_COLS];
    for (int c = 0; c < cols; c++)
        off[c] = _mm512_setzero_ps();
    if (has_offset(type))
        Q16_OFFSETS(__m512, _mm512_set1_ps, _mm512_loadu_ps, _mm512_fmadd_ps, off);
    for (int c = 0; c < cols; c++)
        _mm512_storeu_ps(res + c * 16, _mm512_add_ps(acc[c], off[c]));
}
#endif

/* The AVX-512 tile: up to WR rows x WP pairs of outputs (2 * WP of them: COL_TILE). Its WR * WP 16-lane
 * half sums and running totals stay in registers (24 of the 32); the decoded sub-blocks are read from a
 * buffer. */
#define WR 6 /* at most res's eight rows in vector_range */
#define WP (COL_TILE / 2)
/* Below two full tiles' rows, decoding into the buffer costs more than the AVX2 tiles lose. */
#define WIDE_MIN (2 * WR)
/* Floats per sub-block in the buffer: per pair four value vectors and two scale vectors, then the four
 * outputs' low-half offsets and their high-half offsets (padded to a vector). */
#define WIDE_BLOCK ((WP * 6 + 1) * 16)

#if HAVE_AVX512
/* Two 8-lane vectors side by side: a in the low half, b in the high half. */
static inline __m512 pair(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

/* COL_TILE rows' ns sub-blocks (rows `rs` bytes apart) decoded once into `buf` (64-byte aligned, ns *
 * WIDE_BLOCK floats) for every row tile of a row chunk: per pair, vector k holds the two outputs' values
 * 8k..8k+7 side by side, and the scales likewise. The values are exact, so reading them back is the same
 * as decoding in registers. */
static ALWAYS_INLINE void widen(int type, const uint8_t *w, size_t rs, int64_t ns, float *buf)
{
    const uint8_t *next = w + COL_TILE * rs;
    const size_t step = (COL_TILE * rs + (size_t)ns - 1) / (size_t)ns;
    const int spb = TYPE_INFO[type].elems == QK_K ? 8 : 1;
    const size_t ub = sub_offset(type, spb);
    for (int64_t u = 0; u < ns / spb; u++)
#pragma GCC unroll 1
        for (int j = 0; j < spb; j++) {
            const int64_t s = u * spb + j;
            prefetch_tile(next, s, step);
            float *fb = buf + s * WIDE_BLOCK, *m = fb + WP * 6 * 16;
            for (int h = 0; h < WP; h++) {
                const uint8_t *lo_row = w + 2 * h * rs + u * ub, *hi_row = lo_row + rs;
                __m256 a[4], c[4];
                x86_values(type, lo_row, j, a);
                x86_values(type, hi_row, j, c);
                for (int k = 0; k < 4; k++)
                    _mm512_store_ps(fb + (h * 6 + k) * 16, pair(a[k], c[k]));
                float d[2][2], mm[2][2];
                sub_scales(type, lo_row, j, d[0], mm[0]);
                sub_scales(type, hi_row, j, d[1], mm[1]);
                for (int i = 0; i < 2; i++) {
                    m[2 * h + i] = mm[i][0];
                    m[COL_TILE + 2 * h + i] = mm[i][1];
                }
                _mm512_store_ps(fb + (h * 6 + 4) * 16, pair(_mm256_set1_ps(d[0][0]), _mm256_set1_ps(d[1][0])));
                _mm512_store_ps(fb + (h * 6 + 5) * 16, pair(_mm256_set1_ps(d[0][1]), _mm256_set1_ps(d[1][1])));
            }
        }
}

/* WR rows x 2 * WP outputs decoded by `widen`. Each 16-lane accumulator holds two outputs' eight lanes
 * side by side, so every lane takes exactly the operations of `vector_tile` (the same products, fused
 * multiply-adds and scales, in the same order): the same bits. Within a sub-block the value vectors are
 * the outer loop, so that each is loaded once for WR rows and each row's activations once for 2 * WP
 * outputs; the WR * WP half sums and running totals stay in registers. */
static ALWAYS_INLINE void wide_tile(int type, int rows, const float *buf, int64_t ns, const float *x,
                                    int64_t x_stride, const float *sx, int64_t ss, float *res)
{
    __m512 acc[WR][WP], t[WR][WP];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < WP; h++)
            acc[r][h] = t[r][h] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        const float *fb = buf + s * WIDE_BLOCK, *xb = x + s * QK;
        for (int k = 0; k < 4; k++) {
            /* A fresh sum per sub-block, or per half with a scale per 16. */
            const int fresh = k == 0 || (split_scales(type) && k == 2);
            __m512 w[WP];
            for (int h = 0; h < WP; h++)
                w[h] = _mm512_load_ps(fb + (h * 6 + k) * 16);
            for (int r = 0; r < rows; r++) {
                const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xb + r * x_stride + 8 * k));
                for (int h = 0; h < WP; h++)
                    t[r][h] = fresh ? _mm512_mul_ps(w[h], xv) : _mm512_fmadd_ps(w[h], xv, t[r][h]);
            }
            /* The sum is whole: times its scale (with a scale per 16, d0 for the low half, d1 high). */
            if (k == 3 || (split_scales(type) && k == 1)) {
                const int scale = split_scales(type) && k == 3 ? 5 : 4;
                for (int h = 0; h < WP; h++) {
                    const __m512 d = _mm512_load_ps(fb + (h * 6 + scale) * 16);
                    for (int r = 0; r < rows; r++)
                        acc[r][h] = _mm512_fmadd_ps(d, t[r][h], acc[r][h]);
                }
            }
        }
    }
    /* The offset term in sub-block order, as `vector_tile` sums it (the rows' chains side by side). */
    __m128 offset[WR];
    for (int r = 0; r < rows; r++)
        offset[r] = _mm_setzero_ps();
    if (has_offset(type))
        for (int64_t s = 0; s < ns; s++) {
            const float *m = buf + s * WIDE_BLOCK + WP * 6 * 16;
            const __m128 m0 = _mm_load_ps(m), m1 = _mm_load_ps(m + COL_TILE);
            for (int r = 0; r < rows; r++) {
                if (split_scales(type)) {
                    offset[r] = _mm_fmadd_ps(m0, _mm_set1_ps(sx[2 * s * ss + r]), offset[r]);
                    offset[r] = _mm_fmadd_ps(m1, _mm_set1_ps(sx[(2 * s + 1) * ss + r]), offset[r]);
                } else {
                    offset[r] = _mm_fmadd_ps(m0, _mm_set1_ps(sx[s * ss + r]), offset[r]);
                }
            }
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
static ALWAYS_INLINE void wide_rows(int type, int rows, const float *buf, int64_t ns, const float *x,
                                    int64_t x_stride, const float *sx, int64_t ss, float *res)
{
    switch (rows) {
    case 1:
        wide_tile(type, 1, buf, ns, x, x_stride, sx, ss, res);
        break;
    case 2:
        wide_tile(type, 2, buf, ns, x, x_stride, sx, ss, res);
        break;
    case 3:
        wide_tile(type, 3, buf, ns, x, x_stride, sx, ss, res);
        break;
    case 4:
        wide_tile(type, 4, buf, ns, x, x_stride, sx, ss, res);
        break;
    case 5:
        wide_tile(type, 5, buf, ns, x, x_stride, sx, ss, res);
        break;
    default:
        wide_tile(type, WR, buf, ns, x, x_stride, sx, ss, res);
        break;
    }
}
#endif

typedef void (*tile_fn)(const uint8_t *, size_t, int64_t, const float *, int64_t, const float *, int64_t,
                        float *);
typedef void (*q16_rows_fn)(int, int, const uint8_t *, size_t, int64_t, const int16_t *, int64_t,
                            const float *, const float *, const int32_t *, int64_t, float *);
typedef void (*q16_widen_fn)(int, const uint8_t *, size_t, int64_t, int32_t *, float *, float *);
typedef void (*q16_group_fn)(const int32_t *, const float *, const float *, int64_t, const int32_t *,
                             const float *, const float *, int64_t, float *);
typedef void (*widen_fn)(const uint8_t *, size_t, int64_t, float *);
typedef void (*wide_fn)(int, const float *, int64_t, const float *, int64_t, const float *, int64_t, float *);

/* One block type's tiles. */
struct tiles {
    /* Float rows: eight rows of one output, four rows, one row of COL_TILE outputs, one of one. */
    tile_fn rows8, rows4, cols, one;
    /* int16 rows: 1..Q16_FEW_ROWS rows of Q16_ROW_COLS outputs or of one; the outputs widened; half a group
     * of rows of Q16_COLS outputs, of one; a whole group of Q16_WIDE_COLS outputs, of one (NULL without
     * AVX-512). */
    q16_rows_fn q16_rows;
    q16_widen_fn q16_widen;
    q16_group_fn group8, group8_one, group16, group16_one;
    /* AVX-512: COL_TILE outputs' sub-blocks decoded into the buffer, then 1..WR rows of them
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
    }
#define DEFINE_Q16_TILES(NAME, TYPE)                                                                      \
    static void NAME##_q16_rows(int rows, int cols, const uint8_t *w, size_t rb, int64_t nb,            \
                                const int16_t *x, int64_t xs, const float *dx, const float *sx,           \
                                const int32_t *xsum, int64_t ss, float *res)                              \
    {                                                                                                    \
        q16_rows_of(TYPE, rows, cols, w, rb, nb, x, xs, dx, sx, xsum, ss, res);                          \
    }                                                                                                    \
    static void NAME##_q16_widen(int cols, const uint8_t *w, size_t rb, int64_t nb, int32_t *wb,         \
                                 float *db, float *mb)                                                   \
    {                                                                                                    \
        q16_widen(TYPE, cols, w, rb, nb, wb, db, mb);                                                    \
    }                                                                                                    \
    static void NAME##_group8(const int32_t *wb, const float *db, const float *mb, int64_t nb,           \
                              const int32_t *xt, const float *dx, const float *sx, int64_t ss, float *res) \
    {                                                                                                    \
        q16_group8(TYPE, Q16_COLS, wb, db, mb, nb, xt, dx, sx, ss, res);                                 \
    }                                                                                                    \
    static void NAME##_group8_one(const int32_t *wb, const float *db, const float *mb, int64_t nb,       \
                                  const int32_t *xt, const float *dx, const float *sx, int64_t ss,       \
                                  float *res)                                                            \
    {                                                                                                    \
        q16_group8(TYPE, 1, wb, db, mb, nb, xt, dx, sx, ss, res);                                        \
    }
#if HAVE_AVX512
#define DEFINE_Q16_WIDE_TILES(NAME, TYPE)                                                                 \
    static void NAME##_group16(const int32_t *wb, const float *db, const float *mb, int64_t nb,          \
                               const int32_t *xt, const float *dx, const float *sx, int64_t ss,          \
                               float *res)                                                               \
    {                                                                                                    \
        q16_group16(TYPE, Q16_WIDE_COLS, wb, db, mb, nb, xt, dx, sx, ss, res);                           \
    }                                                                                                    \
    static void NAME##_group16_one(const int32_t *wb, const float *db, const float *mb, int64_t nb,      \
                                   const int32_t *xt, const float *dx, const float *sx, int64_t ss,      \
                                   float *res)                                                           \
    {                                                                                                    \
        q16_group16(TYPE, 1, wb, db, mb, nb, xt, dx, sx, ss, res);                                       \
    }
#define Q16_WIDE_TILES_OF(NAME) NAME##_group16, NAME##_group16_one
#else
#define Q16_WIDE_TILES_OF(NAME) NULL, NULL
#endif
#define DEFINE_ROW_TILE(NAME, TYPE)                                                                       \
    static void NAME##_row(const uint8_t *w, size_t rb, int64_t nb, const float *x, int64_t xs,          \
                           const float *sx, int64_t ss, float *res)                                      \
    {                                                                                                    \
        (void)xs;                                                                                        \
        row_tile(TYPE, ROW_COLS, w, rb, nb, x, sx, ss, res);                                             \
    }
/* Every type's float tiles; the integer types' int16 tiles; the row tiles of the types whose decode rows
 * take them: those faster than `vector_tile` on one row (Q2_K, Q4_K, Q5_K and Q6_K, with or without
 * AVX-512; blocks of 32 were slower there, Q3_K's scales are not computed together: docs/benchmarks.md). */
#define FOR_INTEGER_TYPES(X)                                                                              \
    X(q4_0, TYPE_Q4_0)                                                                                   \
    X(q4_1, TYPE_Q4_1)                                                                                   \
    X(q5_0, TYPE_Q5_0)                                                                                   \
    X(q5_1, TYPE_Q5_1)                                                                                   \
    X(q8_0, TYPE_Q8_0)                                                                                   \
    X(q2_k, TYPE_Q2_K)                                                                                   \
    X(q3_k, TYPE_Q3_K)                                                                                   \
    X(q4_k, TYPE_Q4_K)                                                                                   \
    X(q5_k, TYPE_Q5_K)                                                                                   \
    X(q6_k, TYPE_Q6_K)                                                                                   \
    X(iq4_nl, TYPE_IQ4_NL)                                                                               \
    X(iq4_xs, TYPE_IQ4_XS)                                                                               \
    X(mxfp4, TYPE_MXFP4)
#define FOR_FLOAT_TYPES(X)                                                                                \
    X(f32, TYPE_F32)                                                                                     \
    X(f16, TYPE_F16)                                                                                     \
    X(bf16, TYPE_BF16)
FOR_INTEGER_TYPES(DEFINE_TILES)
FOR_FLOAT_TYPES(DEFINE_TILES)
FOR_INTEGER_TYPES(DEFINE_Q16_TILES)
#if HAVE_AVX512
FOR_INTEGER_TYPES(DEFINE_Q16_WIDE_TILES)
#endif
#define FOR_ROW_TILED_TYPES(X)                                                                            \
    X(q2_k, TYPE_Q2_K)                                                                                   \
    X(q4_k, TYPE_Q4_K)                                                                                   \
    X(q5_k, TYPE_Q5_K)                                                                                   \
    X(q6_k, TYPE_Q6_K)
FOR_ROW_TILED_TYPES(DEFINE_ROW_TILE)

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
FOR_INTEGER_TYPES(DEFINE_WIDE_TILES)
FOR_FLOAT_TYPES(DEFINE_WIDE_TILES)
#define WIDE_TILES_OF(NAME) NAME##_widen, NAME##_wide
#else
#define WIDE_TILES_OF(NAME) NULL, NULL
#endif

/* Every type's tiles, indexed by the type's id (the float types have no int16 tiles). */
#define INTEGER_TILES(NAME, TYPE)                                                                         \
    [TYPE] = {NAME##_rows8,     NAME##_rows4,        NAME##_cols,   NAME##_one,                           \
              NAME##_q16_rows,  NAME##_q16_widen,                                                     \
              NAME##_group8,    NAME##_group8_one,   Q16_WIDE_TILES_OF(NAME), WIDE_TILES_OF(NAME)},
#define FLOAT_TILES(NAME, TYPE)                                                                           \
    [TYPE] = {NAME##_rows8, NAME##_rows4, NAME##_cols, NAME##_one, NULL, NULL, NULL, NULL, NULL, NULL,        \
              WIDE_TILES_OF(NAME)},
static const struct tiles TILES[TYPE_COUNT] = {FOR_INTEGER_TYPES(INTEGER_TILES) FOR_FLOAT_TYPES(FLOAT_TILES)};

/* The row tile of a type, NULL where its decode rows take `vector_tile`. */
static tile_fn row_tile_of(int type)
{
    switch (type) {
#define ROW_TILE_CASE(NAME, TYPE)                                                                         \
    case TYPE:                                                                                           \
        return NAME##_row;
        FOR_ROW_TILED_TYPES(ROW_TILE_CASE)
    default:
        return NULL;
    }
}

/* Rows [t0, t1) by the few-row tiles, Q16_FEW_ROWS at a time, across Q16_ROW_COLS outputs at a time (the
 * last outputs one at a time). */
static void q16_few_rows(const struct product *p, int64_t t0, int64_t t1, int64_t o0, int64_t o1)
{
    const struct tiles *k = &TILES[p->type];
    const int64_t n = p->n_in;
    float res[Q16_FEW_ROWS * Q16_ROW_COLS];
    for (int64_t t = t0; t < t1; t += Q16_FEW_ROWS) {
        const int rows = t1 - t < Q16_FEW_ROWS ? (int)(t1 - t) : Q16_FEW_ROWS;
        for (int64_t o = o0; o < o1;) {
            const int cols = o + Q16_ROW_COLS <= o1 ? Q16_ROW_COLS : 1;
            k->q16_rows(rows, cols, row_of(p, o), p->row_bytes, p->ns, p->xq + t * n, n, p->dx + t, p->sx + t,
                        p->xsum + t, p->ss, res);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < cols; c++)
                    store(p, t + r, o + c, res[r * Q16_ROW_COLS + c]);
            o += cols;
        }
    }
}

/* Fewer than Q16_GROUP_MIN rows: the few-row tiles, each sub-block decoded from the file once per
 * Q16_FEW_ROWS rows. More: the rows by group (AVX-512: whole groups; AVX2: halves, the padding's skipped)
 * across Q16_WIDE_COLS or Q16_COLS outputs at a time, widened once per chunk of rows, the last outputs one
 * at a time; where the rows past the last whole group (or half) are at most Q16_FEW_ROWS, they take the
 * few-row tiles instead of a padded group (measured faster: docs/benchmarks.md). */
void q16_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide)
{
    const struct tiles *k = &TILES[p->type];
    const int64_t ns = p->ns, n = p->n_in, ss = p->ss;
    const size_t rs = p->row_bytes;
    if (!p->xt) {
        q16_few_rows(p, 0, rows, o0, o1);
        return;
    }
    const int groups16 = wide && k->group16 != NULL;
    const int most = groups16 ? Q16_WIDE_COLS : Q16_COLS;
    const int64_t rest = rows % (groups16 ? Q16_GROUP : Q16_GROUP / 2);
    if (rest <= Q16_FEW_ROWS) {
        q16_few_rows(p, rows - rest, rows, o0, o1);
        rows -= rest;
    }
    int32_t *wb = malloc(sizeof(int32_t) * (size_t)(most * n / 2) + sizeof(float) * (size_t)(4 * most * ns));
    if (!wb) {
        scalar_range(p, rows, o0, o1);
        return;
    }
    float *db = (float *)(wb + most * n / 2), *mb = db + 2 * most * ns;
    float res[Q16_WIDE_COLS * Q16_GROUP];
    int64_t chunk = Q16_CHUNK_BYTES / (n * (int64_t)sizeof(int16_t)) / Q16_GROUP * Q16_GROUP;
    chunk = chunk < Q16_GROUP ? Q16_GROUP : chunk;
    for (int64_t t0 = 0; t0 < rows; t0 += chunk) {
        const int64_t t1 = t0 + chunk < rows ? t0 + chunk : rows;
        for (int64_t o = o0; o < o1;) {
            const int cols = o + most <= o1 ? most : 1;
            k->q16_widen(cols, row_of(p, o), rs, ns, wb, db, mb);
            for (int64_t t = t0; t < t1; t += Q16_GROUP) {
                const int32_t *xt = p->xt + t / Q16_GROUP * ns * (QK / 2) * Q16_GROUP;
                const int64_t n_rows = t1 - t < Q16_GROUP ? t1 - t : Q16_GROUP;
                if (groups16 && n_rows > Q16_GROUP / 2) {
                    (cols > 1 ? k->group16 : k->group16_one)(wb, db, mb, ns, xt, p->dx + t, p->sx + t, ss, res);
                    /* Row by row: each row's outputs lie side by side. */
                    for (int64_t r = 0; r < n_rows; r++)
                        for (int c = 0; c < cols; c++)
                            store(p, t + r, o + c, res[c * Q16_GROUP + r]);
                    continue;
                }
                /* Half groups (the AVX2 tiles, or a last group of at most half a group's rows), Q16_COLS
                 * outputs at a time of the `cols` widened. */
                for (int64_t h = 0; h < n_rows; h += Q16_GROUP / 2)
                    for (int c0 = 0, n; c0 < cols; c0 += n) {
                        n = cols - c0 < Q16_COLS ? 1 : Q16_COLS;
                        (n > 1 ? k->group8 : k->group8_one)(wb + c0 * ns * (QK / 2), db + 2 * c0 * ns,
                                                            mb + 2 * c0 * ns, ns, xt + h, p->dx + t + h,
                                                            p->sx + t + h, ss, res);
                        for (int64_t r = h; r < n_rows && r < h + Q16_GROUP / 2; r++)
                            for (int c = 0; c < n; c++)
                                store(p, t + r, o + c0 + c, res[c * (Q16_GROUP / 2) + r - h]);
                    }
            }
            o += cols;
        }
    }
    free(wb);
}

void vector_range(const struct product *p, int64_t rows, int64_t o0, int64_t o1, int wide)
{
    const struct tiles *k = &TILES[p->type];
    const tile_fn row = wide ? row_tile_of(p->type) : NULL;
    /* The decoded sub-blocks of COL_TILE outputs; without it (no AVX-512, or not `wide`), the AVX2 tiles. */
    const size_t buf_bytes = ((size_t)p->ns * WIDE_BLOCK * sizeof(float) + 63) / 64 * 64;
    float *buf = wide && k->wide && rows >= WIDE_MIN ? aligned_alloc(64, buf_bytes) : NULL;
    /* Up to eight rows (the AVX-512 tile) x COL_TILE outputs. */
    float res[8 * COL_TILE];
    /* Rows in chunks, so that a chunk's activations stay in cache while the outputs' weights stream: for
     * the row tiles, as many rows as fit in the L1 data cache beside the blocks (at least one tile). */
    int64_t chunk = buf ? ROW_CHUNK : L1_ROWS_BYTES / (p->n_in * (int64_t)sizeof(float)) / ROW_TILE * ROW_TILE;
    chunk = chunk < ROW_TILE ? ROW_TILE : chunk > ROW_CHUNK ? ROW_CHUNK : chunk;
    for (int64_t t0 = 0; t0 < rows; t0 += chunk) {
        const int64_t t1 = t0 + chunk < rows ? t0 + chunk : rows;
        for (int64_t o = o0; o < o1;) {
            int64_t t = t0;
            const uint8_t *w = row_of(p, o);
            const size_t rs = p->row_bytes;
            if (buf && t1 - t0 >= WIDE_MIN && o + COL_TILE <= o1) {
                /* COL_TILE outputs WR rows at a time, the last tile taking the rows that are left. */
                k->widen(w, rs, p->ns, buf);
                for (; t < t1;) {
                    const int n = t1 - t < WR ? (int)(t1 - t) : WR;
                    k->wide(n, buf, p->ns, p->x + t * p->n_in, p->n_in, p->sx + t, p->ss, res);
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
                    (n == FLOAT_ROW_TILE ? k->rows8 : k->rows4)(w, rs, p->ns, p->x + t * p->n_in, p->n_in,
                                                                p->sx + t, p->ss, res);
                    for (int r = 0; r < n; r++)
                        store(p, t + r, o, res[r]);
                    t += n;
                }
                for (; t < t1; t++) {
                    k->one(w, rs, p->ns, p->x + t * p->n_in, p->n_in, p->sx + t, p->ss, res);
                    store(p, t, o, res[0]);
                }
                o += 1;
            } else if (row && o + ROW_COLS <= o1) {
                for (; t < t1; t++) {
                    row(w, rs, p->ns, p->x + t * p->n_in, p->n_in, p->sx + t, p->ss, res);
                    for (int c = 0; c < ROW_COLS; c++)
                        store(p, t, o + c, res[c]);
                }
                o += ROW_COLS;
            } else {
                for (; t < t1; t++) {
                    k->cols(w, rs, p->ns, p->x + t * p->n_in, p->n_in, p->sx + t, p->ss, res);
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
