/* Paged attention for the CPU, for prefill and decode rows alike (loaded through ctypes by
 * kvserve/model/native_attention.py; the decoder layers call it through its address).
 *
 * Each query row attends to the first `lens[r]` positions of its own sequence (with a window, only the
 * last `window` of them), read in place from the paged cache (slot = block * block_size + offset, layout
 * [slots, kv_heads, head_dim]): no context is gathered into a copy and no row is padded to the longest
 * one. Every reduction runs in a fixed order that depends only on the row's own query, context, window
 * and length: never on the other rows of the step or on the thread count. That is what makes a row bitwise batch-invariant.
 *
 * The generic code (a row is one task, computed by one thread from start to end with reductions in
 * position order) is built for float and double (double serves the float64 reference runs of the tests),
 * for float with a float16 cache (KV): each cached position's row is widened to float as it is read
 * (exactly, with F16C where the CPU has it), and every product and sum stays in float; and for float and
 * double over a q8_0 cache (llama.cpp's block_q8_0: per 32 values of a head, a float16 scale d and 32
 * int8 quants, 34 bytes; a cached position's row is kv_heads * dim / 32 blocks), each row dequantized
 * (q * d, exact) as it is read. Float rows with a head size of 64, 128 or 256 take the vector path instead
 * (`fast_attention`, below), which dequantizes eight values at a time in registers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"
#include "kvserve.h"

/* A chunk's K and V: read through into L2 and computed from there (128 positions of the default model's
 * float16 cache), yet at least CHUNK_POSITIONS: each (row, chunk) pair costs a partial and its merge, and
 * wide KV rows made chunks of 16 positions (Qwen3-0.6B's 2 KiB rows: a prefill of 2,000 tokens 8% longer
 * than with 96 positions, docs/benchmarks.md). */
#define CHUNK_BYTES (96 * 1024)
#define CHUNK_POSITIONS 96
/* The chunk partials one call holds at a time. */
#define WAVE_BYTES (8 << 20)
/* Query heads that read each cached row of their KV head together. */
#define HG 4

/* The first position a row of context length n attends to: with a window (> 0), the token at position
 * n - 1 sees itself and the window - 1 positions before it (transformers' sliding window); 0 without.
 * Blocks wholly before it are never read, so a caller may leave any block id there. */
static inline int64_t window_start(int64_t n, int64_t window)
{
    return window > 0 && n > window ? n - window : 0;
}

/* q8_0: values per block and the block's bytes (a float16 scale, then the quants). */
#define QK 32
#define Q8_BYTES (2 + QK)

/* ---- The generic rows ----
 *
 * DEFINE_ROWS(NAME, T, KV, EXP, WIDEN, ROW) defines, for rows of T over a cache of KV:
 * NAME##_exp_scores: scores s[0, n) -> exp(score - highest) in place, `mx` the highest, `sum` the exps'
 *   sum in position order;
 * NAME##_row: every head of one row over its whole context;
 * NAME##_rows: the rows as tasks of OpenMP threads, with the signature of `attention_kernel`.
 * WIDEN(src, wide, n) gives a cached position's row of n values as T (the cache's own row when KV is
 * T); ROW(n) is how many KV elements such a row takes. */
#define DEFINE_ROWS(NAME, T, KV, EXP, WIDEN, ROW)                                                        \
    static inline void NAME##_exp_scores(T *s, int64_t n, T *mx, T *sum)                                 \
    {                                                                                                    \
        T m = s[0], total = 0;                                                                           \
        for (int64_t p = 1; p < n; p++)                                                                  \
            m = s[p] > m ? s[p] : m;                                                                     \
        for (int64_t p = 0; p < n; p++) {                                                                \
            s[p] = EXP(s[p] - m);                                                                        \
            total += s[p];                                                                               \
        }                                                                                                \
        *mx = m;                                                                                         \
        *sum = total;                                                                                    \
    }                                                                                                    \
                                                                                                         \
    static void NAME##_row(const T *restrict q, T *restrict out, const KV *restrict kc,                  \
                           const KV *restrict vc, const int64_t *restrict table, int64_t n, int64_t lo,  \
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, T scale,    \
                           const float *sinks, T *restrict scores, T *restrict acc)                      \
    {                                                                                                    \
        const int64_t group = heads / kv_heads, stride = kv_heads * dim, row = ROW(stride);              \
        T wide[stride];                                                                                  \
        for (int64_t start = lo - lo % block_size; start < n; start += block_size) {                     \
            const int64_t len = n - start < block_size ? n - start : block_size;                         \
            const int64_t i0 = start < lo ? lo - start : 0;                                              \
            const KV *k = kc + (table[start / block_size] * block_size + i0) * row;                      \
            for (int64_t i = i0; i < len; i++, k += row) {                                               \
                const T *kr = WIDEN(k, wide, stride);                                                    \
                for (int64_t h = 0; h < heads; h++) {                                                    \
                    const T *qh = q + h * dim;                                                           \
                    const T *kh = kr + (h / group) * dim;                                                \
                    T s = 0;                                                                             \
                    for (int64_t d = 0; d < dim; d++)                                                    \
                        s += qh[d] * kh[d];                                                              \
                    scores[h * n + start + i] = s * scale;                                               \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t h = 0; h < heads; h++) {                                                            \
            T *sh = scores + h * n, m, sum;                                                              \
            NAME##_exp_scores(sh + lo, n - lo, &m, &sum);                                                \
            /* A sink joins the max and the denominator: the exps move to the new max by one factor. */  \
            T f = 1;                                                                                     \
            if (sinks) {                                                                                 \
                const T s = (T)sinks[h], top = s > m ? s : m;                                            \
                f = EXP(m - top);                                                                        \
                sum = sum * f + EXP(s - top);                                                            \
            }                                                                                            \
            const T inv = f / sum;                                                                       \
            for (int64_t p = lo; p < n; p++)                                                             \
                sh[p] *= inv;                                                                            \
        }                                                                                                \
        for (int64_t j = 0; j < heads * dim; j++)                                                        \
            acc[j] = 0;                                                                                  \
        for (int64_t start = lo - lo % block_size; start < n; start += block_size) {                     \
            const int64_t len = n - start < block_size ? n - start : block_size;                         \
            const int64_t i0 = start < lo ? lo - start : 0;                                              \
            const KV *v = vc + (table[start / block_size] * block_size + i0) * row;                      \
            for (int64_t i = i0; i < len; i++, v += row) {                                               \
                const T *vr = WIDEN(v, wide, stride);                                                    \
                for (int64_t h = 0; h < heads; h++) {                                                    \
                    const T w = scores[h * n + start + i];                                               \
                    const T *vh = vr + (h / group) * dim;                                                \
                    T *ah = acc + h * dim;                                                               \
                    for (int64_t d = 0; d < dim; d++)                                                    \
                        ah[d] += w * vh[d];                                                              \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t j = 0; j < heads * dim; j++)                                                        \
            out[j] = acc[j];                                                                             \
    }                                                                                                    \
                                                                                                         \
    static int NAME##_rows(const void *q, int64_t q_stride, void *out, const void *k_cache,              \
                           const void *v_cache, const int64_t *tables, int64_t table_stride,             \
                           const int64_t *lens, int64_t window, int64_t rows, int64_t heads,             \
                           int64_t kv_heads, int64_t dim, int64_t block_size, double scale,              \
                           const float *sinks, int threads)                                              \
    {                                                                                                    \
        int64_t longest = 0;                                                                             \
        for (int64_t r = 0; r < rows; r++)                                                               \
            longest = lens[r] > longest ? lens[r] : longest;                                             \
        int failed = 0;                                                                                  \
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)")                               \
        {                                                                                                \
            T *scores = malloc(sizeof(T) * (size_t)(heads * (longest + dim)));                           \
            _Pragma("omp for schedule(dynamic, 1)")                                                      \
            for (int64_t r = 0; r < rows; r++) {                                                         \
                if (!scores) {                                                                           \
                    failed = 1;                                                                          \
                    continue;                                                                            \
                }                                                                                        \
                NAME##_row((const T *)q + r * q_stride, (T *)out + r * heads * dim, k_cache, v_cache,    \
                           tables + r * table_stride, lens[r], window_start(lens[r], window), heads,     \
                           kv_heads, dim, block_size, (T)scale, sinks, scores, scores + heads * longest); \
            }                                                                                            \
            free(scores);                                                                                \
        }                                                                                                \
        return failed ? -1 : 0;                                                                          \
    }

static inline const float *same_f32(const float *src, float *wide, int64_t n)
{
    (void)wide, (void)n;
    return src;
}

static inline const double *same_f64(const double *src, double *wide, int64_t n)
{
    (void)wide, (void)n;
    return src;
}

/* A float cache's row takes one element per value; a q8_0 row one byte per quant and two per scale. */
#define VALUES(n) (n)
#define Q8_ROW(n) ((n) / QK * Q8_BYTES)

DEFINE_ROWS(f32, float, float, expf, same_f32, VALUES)
DEFINE_ROWS(f64, double, double, exp, same_f64, VALUES)

/* n values of q8_0 blocks dequantized into `wide`: q * d, exact in float and in double. */
#define DEFINE_WIDEN_Q8(NAME, T)                                                                         \
    static inline const T *NAME(const uint8_t *restrict src, T *restrict wide, int64_t n)                \
    {                                                                                                    \
        for (int64_t b = 0; b < n / QK; b++) {                                                           \
            const uint8_t *block = src + b * Q8_BYTES;                                                   \
            const T d = (T)half_to_float(read_u16(block));                                               \
            for (int64_t j = 0; j < QK; j++)                                                             \
                wide[b * QK + j] = (T)(int8_t)block[2 + j] * d;                                          \
        }                                                                                                \
        return wide;                                                                                     \
    }
DEFINE_WIDEN_Q8(widen_q8_f32, float)
DEFINE_WIDEN_Q8(widen_q8_f64, double)
DEFINE_ROWS(f32_q8, float, uint8_t, expf, widen_q8_f32, Q8_ROW)
DEFINE_ROWS(f64_q8, double, uint8_t, exp, widen_q8_f64, Q8_ROW)
#if HAVE_FLOAT16
/* n float16 values widened to float into `wide` (exact either way, so both paths give the same bits). */
static inline const float *widen_f16(const _Float16 *restrict src, float *restrict wide, int64_t n)
{
    int64_t i = 0;
#if HAVE_F16C
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(wide + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        wide[i] = (float)src[i];
    return wide;
}
DEFINE_ROWS(f32_kv16, float, _Float16, expf, widen_f16, VALUES)
#endif

#if HAVE_AVX2
/* ---- The float rows' vector path (AVX2, FMA, F16C; head_dim 64, 128 or 256) ----
 *
 * A row's context is cut into chunks of whole blocks (CHUNK_BYTES of K and V, or one block where blocks
 * are larger), every head of the row. A task is one chunk, of one row or of every row whose chunk covers
 * the same whole blocks (a prefix they share through the cache: read once a step, however many decodes
 * share it). Each task first reads its blocks through (`touch_blocks`), then computes its rows from
 * cache: the query heads that share a KV head (HG at a time) read and widen each cached row once between
 * them. Each row keeps, per head, its chunk's softmax partial (highest score, sum of exps, weighted
 * values); a second pass merges a head's chunks in chunk order. Chunk bounds depend on the block size and
 * the model's shape alone, and a row's arithmetic is the same whichever task computes it, so its bits do
 * not depend on the other rows or on the thread count, and one long row spreads over every thread.
 * Scores: a position's dot products for the heads are accumulated side by side, eight positions reduced
 * together (one add tree for eight sums). Values: the heads' outputs stay in registers, four vectors of
 * each at a time.
 *
 * The helpers take the cache's format (`kv`: KV_F32, KV_F16 or KV_Q8), the head group's size `hg` and
 * the head size in vectors `C` as constants at every call (`fast_chunk` spells each case out), so that
 * their loops unroll into registers. */

static inline int fast_takes(int64_t dim) { return dim == 64 || dim == 128 || dim == 256; }

/* Blocks per chunk, for this block size and `row_bytes` of K (as of V) per position. */
static inline int64_t chunk_blocks(int64_t block_size, size_t row_bytes)
{
    const int64_t fit = (int64_t)(CHUNK_BYTES / (2 * row_bytes));
    const int64_t blocks = (fit > CHUNK_POSITIONS ? fit : CHUNK_POSITIONS) / block_size;
    return blocks < 1 ? 1 : blocks;
}

/* The cache formats of the vector path. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2 };

/* The bytes of the first n values of a cache (n a multiple of QK for q8_0: whole blocks). */
static ALWAYS_INLINE size_t kv_bytes(const int kv, int64_t n)
{
    return kv == KV_Q8 ? (size_t)(n / QK * Q8_BYTES) : (size_t)n * (kv == KV_F16 ? 2 : 4);
}

/* Eight cached values as floats: vector c of the values from value r on (r a multiple of QK, so that a
 * q8_0 block's four vectors share its scale). */
static ALWAYS_INLINE __m256 load8(const int kv, const void *p, int64_t r, int c)
{
    if (kv == KV_Q8) {
        const uint8_t *block = (const uint8_t *)p + kv_bytes(KV_Q8, r) + (size_t)(c / 4) * Q8_BYTES;
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(read_u16(block)));
        const __m128i q = _mm_loadl_epi64((const __m128i *)(block + 2 + (c % 4) * 8));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
    if (kv == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + r + 8 * c)));
    return _mm256_loadu_ps((const float *)p + r + 8 * c);
}

/* Blocks [b0, b1) of both caches (each block's rows of every KV head lie together in the pool), read
 * once through before the chunk is computed, so that the computing passes find them in cache. Blocks sit
 * anywhere in the pool, and a pass that computes as it reads has too few misses in flight to keep memory
 * busy; this loop has nothing but independent loads (prefetch instructions ahead of the passes did not
 * help: docs/benchmarks.md). */
static inline void touch_blocks(const void *kc, const void *vc, const int64_t *table, int64_t b0, int64_t b1,
                                int64_t n, int64_t block_size, size_t row_bytes)
{
    __m256i sink = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; b++) {
        const int64_t len = n - b * block_size < block_size ? n - b * block_size : block_size;
        const size_t at = (size_t)(table[b] * block_size) * row_bytes;
        const char *k = (const char *)kc + at, *v = (const char *)vc + at;
        for (size_t line = 0; line < (size_t)len * row_bytes; line += 64) {
            sink = _mm256_or_si256(sink, _mm256_loadu_si256((const __m256i *)(k + line)));
            sink = _mm256_or_si256(sink, _mm256_loadu_si256((const __m256i *)(v + line)));
        }
    }
    /* The loads' only use: keeps them from being optimized away. */
    __asm__ volatile("" : : "x"(sink));
}

/* vhaddps's sums, per 128 bits [a0 + a1, a2 + a3, b0 + b1, b2 + b3], by two shuffles and an add: the same
 * additions, where vhaddps takes two cycles a time here (AMD Zen 4: a quarter of a shuffle's throughput). */
static inline __m256 hadd8(__m256 a, __m256 b)
{
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xdd));
}

/* Lane i: the sum of v[i]'s eight lanes. */
static inline __m256 sum8(const __m256 v[8])
{
    const __m256 ab = hadd8(hadd8(v[0], v[1]), hadd8(v[2], v[3]));
    const __m256 cd = hadd8(hadd8(v[4], v[5]), hadd8(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* Scores of `hg` query heads (q: their rows, C * 8 floats each, back to back) at the `len` positions of
 * one block (k: the KV head's row at its first position), into sh[h * width + i]. */
static ALWAYS_INLINE void fast_scores(const int kv, const int hg, const int C, const float *restrict q,
                                      const void *restrict k, int64_t len, int64_t stride, __m256 sv,
                                      float *restrict sh, int64_t width)
{
    for (int64_t i0 = 0; i0 < len; i0 += 8) {
        const int64_t m = len - i0 < 8 ? len - i0 : 8;
        __m256 acc[HG][8];
        for (int i = 0; i < 8; i++) {
            /* Past the block's end, the last position again: computed, never stored. */
            const int64_t kr = (i0 + (i < m ? i : m - 1)) * stride;
            __m256 x = load8(kv, k, kr, 0), a[HG];
            for (int h = 0; h < hg; h++)
                a[h] = _mm256_mul_ps(_mm256_loadu_ps(q + h * C * 8), x);
            for (int c = 1; c < C; c++) {
                x = load8(kv, k, kr, c);
                for (int h = 0; h < hg; h++)
                    a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * C * 8 + 8 * c), x, a[h]);
            }
            for (int h = 0; h < hg; h++)
                acc[h][i] = a[h];
        }
        for (int h = 0; h < hg; h++) {
            const __m256 s = _mm256_mul_ps(sum8(acc[h]), sv);
            float *dst = sh + h * width + i0;
            if (m == 8) {
                _mm256_storeu_ps(dst, s);
            } else {
                float lanes[8];
                _mm256_storeu_ps(lanes, s);
                for (int64_t i = 0; i < m; i++)
                    dst[i] = lanes[i];
            }
        }
    }
}

/* The `hg` heads' weighted values over the `len` positions of one block (v: the KV head's row at its first
 * position; w[h * width + i]: head h's weight of position i), added in position order to o[h * o_stride]
 * (C * 8 floats each), four vectors of each head at a time. */
static ALWAYS_INLINE void fast_values(const int kv, const int hg, const int C, const void *restrict v,
                                      int64_t len, int64_t stride, const float *restrict w, int64_t width,
                                      float *restrict o, int64_t o_stride)
{
    for (int c0 = 0; c0 < C; c0 += 4) {
        __m256 acc[HG][4];
        for (int h = 0; h < hg; h++)
            for (int c = 0; c < 4; c++)
                acc[h][c] = _mm256_loadu_ps(o + h * o_stride + 8 * (c0 + c));
        for (int64_t i = 0; i < len; i++) {
            __m256 wv[HG];
            for (int h = 0; h < hg; h++)
                wv[h] = _mm256_set1_ps(w[h * width + i]);
            for (int c = 0; c < 4; c++) {
                const __m256 x = load8(kv, v, i * stride, c0 + c);
                for (int h = 0; h < hg; h++)
                    acc[h][c] = _mm256_fmadd_ps(wv[h], x, acc[h][c]);
            }
        }
        for (int h = 0; h < hg; h++)
            for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(o + h * o_stride + 8 * (c0 + c), acc[h][c]);
    }
}

/* What one pass over a chunk's blocks needs besides the block: the row's queries, the scale, the scores
 * (weights, for the values) and the partials. */
struct pass {
    const float *q;
    __m256 sv;
    float *scores;
    int64_t width;
    float *part;
    int64_t part_stride;
};

/* One head group's `hg` heads, from h0, at one block of their KV head (kv: its row at the block's first
 * position, `len` positions): their scores, or (`values`) their weighted values. */
static ALWAYS_INLINE void fast_heads(const int kvf, const int values, const int hg, const int C,
                                     const struct pass *s, int64_t h0, const void *kv, int64_t len,
                                     int64_t stride, float *w)
{
    if (values)
        fast_values(kvf, hg, C, kv, len, stride, w, s->width, s->part + h0 * s->part_stride + 2,
                    s->part_stride);
    else
        fast_scores(kvf, hg, C, s->q + h0 * C * 8, kv, len, stride, s->sv, w, s->width);
}

/* One pass over blocks [b0, b1) of one cache: each KV head of a block, that head's query heads HG at a
 * time. */
static ALWAYS_INLINE void fast_pass(const int kvf, const int values, const int C, const struct pass *s,
                                    const void *cache, const int64_t *table, int64_t n, int64_t lo, int64_t b0,
                                    int64_t b1, int64_t kv_heads, int64_t group, int64_t block_size)
{
    const int64_t dim = C * 8, stride = kv_heads * dim, p0 = b0 * block_size;
    for (int64_t b = lo / block_size; b < b1; b++) {
        /* Positions [first, first + len) of the block: from the window's start, to the context's end. */
        const int64_t first = b * block_size < lo ? lo - b * block_size : 0;
        const int64_t len = (n - b * block_size < block_size ? n - b * block_size : block_size) - first;
        for (int64_t g = 0; g < kv_heads; g++) {
            const void *kv =
                (const char *)cache + kv_bytes(kvf, (table[b] * block_size + first) * stride + g * dim);
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HG) {
                const int hg = (g + 1) * group - h0 < HG ? (int)((g + 1) * group - h0) : HG;
                float *w = s->scores + h0 * s->width + b * block_size + first - p0;
                switch (hg) {
                case 1:
                    fast_heads(kvf, values, 1, C, s, h0, kv, len, stride, w);
                    break;
                case 2:
                    fast_heads(kvf, values, 2, C, s, h0, kv, len, stride, w);
                    break;
                case 3:
                    fast_heads(kvf, values, 3, C, s, h0, kv, len, stride, w);
                    break;
                default:
                    fast_heads(kvf, values, HG, C, s, h0, kv, len, stride, w);
                    break;
                }
            }
        }
    }
}

/* Every head of one row (q: its [heads, dim] rows) over blocks [b0, b1) of its context (the chunk), from
 * position `lo` on (the row's window start, when it falls in the chunk): per head h, part[h * part_stride]
 * = the chunk's highest score, then the sum of exp(score - highest), then the values weighted by those
 * exps. A block's rows for every KV head lie together in the pool, so each block
 * is read whole, once by the scores and once by the values; `scores` holds heads * (b1 - b0) * block_size
 * floats. `touch`: read the blocks through first (the task's first row). */
static ALWAYS_INLINE void fast_chunk(const int kv, const int C, const float *q, const void *kc,
                                     const void *vc, const int64_t *table, int64_t n, int64_t lo, int64_t b0,
                                     int64_t b1, int64_t heads, int64_t kv_heads, int64_t block_size,
                                     float scale, float *scores, float *part, int64_t part_stride, int touch)
{
    const int64_t group = heads / kv_heads, width = (b1 - b0) * block_size, p0 = b0 * block_size;
    const int64_t from = lo > p0 ? lo : p0;
    const int64_t m_all = (n < b1 * block_size ? n : b1 * block_size) - from;
    const struct pass s = {q, _mm256_set1_ps(scale), scores, width, part, part_stride};
    if (touch)
        touch_blocks(kc, vc, table, from / block_size, b1, n, block_size,
                     kv_bytes(kv, kv_heads * C * 8));
    fast_pass(kv, 0, C, &s, kc, table, n, from, b0, b1, kv_heads, group, block_size);
    for (int64_t h = 0; h < heads; h++) {
        float *ph = part + h * part_stride;
        f32_exp_scores(scores + h * width + from - p0, m_all, &ph[0], &ph[1]);
        for (int64_t d = 0; d < C * 8; d++)
            ph[2 + d] = 0;
    }
    fast_pass(kv, 1, C, &s, vc, table, n, from, b0, b1, kv_heads, group, block_size);
}

typedef void chunk_fn(const float *q, const void *kc, const void *vc, const int64_t *table, int64_t n,
                      int64_t lo, int64_t b0, int64_t b1, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, float scale, float *scores, float *part, int64_t part_stride, int touch);

/* `fast_chunk` for each cache type, with the head size as a constant. */
static void chunk_f32(const float *q, const void *kc, const void *vc, const int64_t *table, int64_t n,
                      int64_t lo, int64_t b0, int64_t b1, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, float scale, float *scores, float *part, int64_t part_stride, int touch)
{
    if (dim == 64)
        fast_chunk(KV_F32, 8, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
    else if (dim == 128)
        fast_chunk(KV_F32, 16, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
    else
        fast_chunk(KV_F32, 32, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
}

#if HAVE_FLOAT16
static void chunk_f16(const float *q, const void *kc, const void *vc, const int64_t *table, int64_t n,
                      int64_t lo, int64_t b0, int64_t b1, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, float scale, float *scores, float *part, int64_t part_stride, int touch)
{
    if (dim == 64)
        fast_chunk(KV_F16, 8, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
    else if (dim == 128)
        fast_chunk(KV_F16, 16, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
    else
        fast_chunk(KV_F16, 32, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
}
#endif

static void chunk_q8(const float *q, const void *kc, const void *vc, const int64_t *table, int64_t n,
                     int64_t lo, int64_t b0, int64_t b1, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t block_size, float scale, float *scores, float *part, int64_t part_stride,
                     int touch)
{
    if (dim == 64)
        fast_chunk(KV_Q8, 8, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
    else if (dim == 128)
        fast_chunk(KV_Q8, 16, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
    else
        fast_chunk(KV_Q8, 32, q, kc, vc, table, n, lo, b0, b1, heads, kv_heads, block_size, scale, scores,
                   part, part_stride, touch);
}

/* One chunk of one row: the vector path's unit of work. `chunk` counts from the context's start, so a
 * row with a window has no units before the chunk its window starts in. */
struct unit {
    int64_t row, chunk;
    /* Whole chunks (every block full and inside the window): a hash of their block ids; the row's last,
     * partial chunk and the chunk its window starts in: none. */
    int whole;
    uint64_t key;
};

static int unit_order(const void *pa, const void *pb)
{
    const struct unit *a = pa, *b = pb;
    if (a->chunk != b->chunk)
        return a->chunk < b->chunk ? -1 : 1;
    if (a->whole != b->whole)
        return a->whole > b->whole ? -1 : 1;
    if (a->key != b->key)
        return a->key < b->key ? -1 : 1;
    return a->row < b->row ? -1 : a->row > b->row;
}

/* The units of every row (row r's chunks are first[r] .. first[r + 1] - 1), ordered so that the rows
 * whose chunk covers the same whole blocks (a prefix they share through the cache) lie together; each
 * such run is one task (`starts[i]`: task i's first unit; returns the number of tasks). A task reads its
 * blocks through once and computes every row of it from cache, so a prefix that eight decodes share is
 * read once a step, not eight times. Each row's arithmetic is the same either way: the bits do not
 * change. */
static int64_t plan_units(const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t window,
                          int64_t rows, int64_t block_size, int64_t cb, const int64_t *first, struct unit *units,
                          int64_t *starts)
{
    const int64_t span = cb * block_size;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t lo = window_start(lens[r], window), c0 = lo / span;
        for (int64_t i = 0; i < first[r + 1] - first[r]; i++) {
            const int64_t c = c0 + i;
            struct unit *u = &units[first[r] + i];
            u->row = r, u->chunk = c;
            u->whole = (c + 1) * span <= lens[r] && c * span >= lo;
            /* FNV-1a over the chunk's block ids. */
            u->key = 14695981039346656037ull;
            for (int64_t b = c * cb; u->whole && b < (c + 1) * cb; b++)
                u->key = (u->key ^ (uint64_t)tables[r * table_stride + b]) * 1099511628211ull;
        }
    }
    const int64_t n = first[rows];
    qsort(units, (size_t)n, sizeof(struct unit), unit_order);
    int64_t tasks = 0;
    for (int64_t i = 0; i < n; i++) {
        const struct unit *u = &units[i], *lead = tasks ? &units[starts[tasks - 1]] : NULL;
        const int joins = lead && u->whole && lead->whole && u->chunk == lead->chunk && u->key == lead->key &&
                          !memcmp(tables + u->row * table_stride + u->chunk * cb,
                                  tables + lead->row * table_stride + lead->chunk * cb,
                                  sizeof(int64_t) * (size_t)cb);
        if (!joins)
            starts[tasks++] = i;
    }
    starts[tasks] = n;
    return tasks;
}

/* The rows by `chunk` (`plan_units` makes the tasks), then each (row, head) merges its chunks' partials in
 * chunk order; one chunk needs only its sum's inverse. Returns 0, or -1 when scratch memory could not be
 * allocated. */
static int fast_rows(chunk_fn *chunk, size_t row_bytes, const float *q, int64_t q_stride, float *out,
                     const void *k_cache, const void *v_cache, const int64_t *tables, int64_t table_stride,
                     const int64_t *lens, int64_t window, int64_t rows, int64_t heads, int64_t kv_heads,
                     int64_t dim, int64_t block_size, float scale, const float *sinks, int threads)
{
    const int64_t cb = chunk_blocks(block_size, row_bytes);
    const int64_t part_size = dim + 2, span = block_size * cb;
    /* first[r]: row r's first unit; its partials start at first[r] * heads. */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (!first)
        return -1;
    first[0] = 0;
    for (int64_t r = 0; r < rows; r++)
        first[r + 1] = first[r] + (lens[r] + span - 1) / span - window_start(lens[r], window) / span;
    const int64_t units_n = first[rows], nt = threads < 1 ? 1 : threads;
    const size_t scores_n = (size_t)(heads * cb * block_size);
    float *parts = malloc(sizeof(float) * (size_t)(units_n * heads * part_size));
    struct unit *units = malloc(sizeof(struct unit) * (size_t)units_n);
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(units_n + 1));
    float *scores_all = malloc(sizeof(float) * scores_n * (size_t)nt);
    const int ok = parts && units && starts && scores_all;
    const int64_t tasks =
        ok ? plan_units(tables, table_stride, lens, window, rows, block_size, cb, first, units, starts) : 0;
    const int64_t merges = ok ? rows * heads : 0;
#pragma omp parallel num_threads(nt) if (ok)
    {
        float *scores = ok ? scores_all + (size_t)omp_get_thread_num() * scores_n : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++)
            for (int64_t i = starts[t]; i < starts[t + 1]; i++) {
                const int64_t r = units[i].row, c = units[i].chunk, lo = window_start(lens[r], window);
                const int64_t chunks = first[r + 1] - first[r], own = c - lo / span;
                const int64_t blocks = (lens[r] + block_size - 1) / block_size;
                const int64_t b1 = (c + 1) * cb < blocks ? (c + 1) * cb : blocks;
                chunk(q + r * q_stride, k_cache, v_cache, tables + r * table_stride, lens[r], lo, c * cb, b1,
                      heads, kv_heads, dim, block_size, scale, scores,
                      parts + (first[r] * heads + own) * part_size, chunks * part_size, i == starts[t]);
            }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < merges; rh++) {
            const int64_t r = rh / heads, h = rh % heads, chunks = first[r + 1] - first[r];
            const float *part = parts + (first[r] * heads + h * chunks) * part_size;
            float *o = out + rh * dim;
            float mx = part[0];
            for (int64_t c = 1; c < chunks; c++)
                mx = part[c * part_size] > mx ? part[c * part_size] : mx;
            /* A sink joins the max and the denominator, first. */
            mx = sinks && sinks[h] > mx ? sinks[h] : mx;
            float sum = sinks ? expf(sinks[h] - mx) : 0;
            for (int64_t d = 0; d < dim; d++)
                o[d] = 0;
            for (int64_t c = 0; c < chunks; c++) {
                const float *pc = part + c * part_size;
                const float e = chunks == 1 && !sinks ? 1 : expf(pc[0] - mx);
                sum += pc[1] * e;
                for (int64_t d = 0; d < dim; d++)
                    o[d] += pc[2 + d] * e;
            }
            const float inv = 1 / sum;
            for (int64_t d = 0; d < dim; d++)
                o[d] *= inv;
        }
    }
    free(scores_all);
    free(starts);
    free(units);
    free(parts);
    free(first);
    return ok ? 0 : -1;
}

/* The vector path over every row, in waves whose chunk partials fit in WAVE_BYTES (at least one row
 * each): a long prefill chunk's rows would otherwise hold tens of MiB of partials at once. */
static int fast_attention(chunk_fn *chunk, size_t row_bytes, const float *q, int64_t q_stride, float *out,
                          const void *k_cache, const void *v_cache, const int64_t *tables, int64_t table_stride,
                          const int64_t *lens, int64_t window, int64_t rows, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t block_size, double scale, const float *sinks, int threads)
{
    const int64_t span = block_size * chunk_blocks(block_size, row_bytes);
    const int64_t unit_bytes = heads * (dim + 2) * (int64_t)sizeof(float);
    for (int64_t r0 = 0, r1; r0 < rows; r0 = r1) {
        int64_t bytes = 0;
        for (r1 = r0; r1 < rows; r1++) {
            bytes += ((lens[r1] + span - 1) / span - window_start(lens[r1], window) / span) * unit_bytes;
            if (r1 > r0 && bytes > WAVE_BYTES)
                break;
        }
        if (fast_rows(chunk, row_bytes, q + r0 * q_stride, q_stride, out + r0 * heads * dim, k_cache, v_cache,
                      tables + r0 * table_stride, table_stride, lens + r0, window, r1 - r0, heads, kv_heads,
                      dim, block_size, (float)scale, sinks, threads))
            return -1;
    }
    return 0;
}
#endif

/* ---- The kernels (kvserve.h declares their type once: `attention_kernel`) ---- */

int paged_attention_f32(const void *q, int64_t q_stride, void *out, const void *k_cache, const void *v_cache,
                        const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t window,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                        double scale, const float *sinks, int threads)
{
#if HAVE_AVX2
    if (fast_takes(dim))
        return fast_attention(chunk_f32, kv_bytes(KV_F32, kv_heads * dim), q, q_stride, out, k_cache, v_cache,
                              tables, table_stride, lens, window, rows, heads, kv_heads, dim, block_size, scale,
                              sinks, threads);
#endif
    return f32_rows(q, q_stride, out, k_cache, v_cache, tables, table_stride, lens, window, rows, heads,
                    kv_heads, dim, block_size, scale, sinks, threads);
}

int paged_attention_f64(const void *q, int64_t q_stride, void *out, const void *k_cache, const void *v_cache,
                        const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t window,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                        double scale, const float *sinks, int threads)
{
    return f64_rows(q, q_stride, out, k_cache, v_cache, tables, table_stride, lens, window, rows, heads,
                    kv_heads, dim, block_size, scale, sinks, threads);
}

#if HAVE_FLOAT16
int paged_attention_f32_kv16(const void *q, int64_t q_stride, void *out, const void *k_cache,
                             const void *v_cache, const int64_t *tables, int64_t table_stride,
                             const int64_t *lens, int64_t window, int64_t rows, int64_t heads, int64_t kv_heads,
                             int64_t dim, int64_t block_size, double scale, const float *sinks, int threads)
{
#if HAVE_AVX2
    if (fast_takes(dim))
        return fast_attention(chunk_f16, kv_bytes(KV_F16, kv_heads * dim), q, q_stride, out, k_cache, v_cache,
                              tables, table_stride, lens, window, rows, heads, kv_heads, dim, block_size, scale,
                              sinks, threads);
#endif
    return f32_kv16_rows(q, q_stride, out, k_cache, v_cache, tables, table_stride, lens, window, rows, heads,
                         kv_heads, dim, block_size, scale, sinks, threads);
}
#endif

int paged_attention_f32_q8(const void *q, int64_t q_stride, void *out, const void *k_cache, const void *v_cache,
                           const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t window,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           double scale, const float *sinks, int threads)
{
#if HAVE_AVX2
    if (fast_takes(dim))
        return fast_attention(chunk_q8, kv_bytes(KV_Q8, kv_heads * dim), q, q_stride, out, k_cache, v_cache,
                              tables, table_stride, lens, window, rows, heads, kv_heads, dim, block_size, scale,
                              sinks, threads);
#endif
    return f32_q8_rows(q, q_stride, out, k_cache, v_cache, tables, table_stride, lens, window, rows, heads,
                       kv_heads, dim, block_size, scale, sinks, threads);
}

int paged_attention_f64_q8(const void *q, int64_t q_stride, void *out, const void *k_cache, const void *v_cache,
                           const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t window,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           double scale, const float *sinks, int threads)
{
    return f64_q8_rows(q, q_stride, out, k_cache, v_cache, tables, table_stride, lens, window, rows, heads,
                       kv_heads, dim, block_size, scale, sinks, threads);
}
