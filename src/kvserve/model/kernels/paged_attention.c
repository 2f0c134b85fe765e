/* Paged attention for the CPU, decode rows and prefill rows alike, loaded through ctypes by
 * kvserve/model/native_attention.py.
 *
 * Each query row attends to the first `lens[r]` positions of its own sequence, read in place from the
 * paged cache (slot = block * block_size + offset, layout [slots, kv_heads, head_dim]): no context is
 * gathered into a copy and no row is padded to the longest one. Every reduction runs in a fixed order that
 * depends only on the row's own query, context and length: never on the other rows of the step or on the
 * thread count. That is what makes a row, a decode's or a prefill token's, bitwise batch-invariant.
 *
 * The generic code (a row is one task, computed by one thread from start to end with reductions in
 * position order) is built for float and double (double serves the float64 reference runs of the tests),
 * and for float with a float16 cache (KV): each cached position's row is widened to float as it is read
 * (exactly, with F16C where the CPU has it), and every product and sum stays in float. Float rows with a
 * head size of 64 or 128 take a vector path instead (`fast_*`, below).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The float rows' vector path (AVX2, FMA, F16C; head_dim 64 or 128). A row's context is cut into chunks
 * of whole blocks (CHUNK_BYTES of K and V, or one block where blocks are larger), every head of the row.
 * A task is one chunk, of one row or of every row whose chunk covers the same whole blocks (a prefix they
 * share through the cache: read once a step, however many decodes share it). Each task first reads its
 * blocks through (`touch_blocks`), then computes its rows from cache: the query heads that share a KV head
 * (HG at a time) read and widen each cached row once between them. Each row keeps, per head, its chunk's
 * softmax partial (highest score, sum of exps, weighted values); a second pass merges a head's chunks in
 * chunk order. Chunk bounds depend on the block size and the model's shape alone, and a row's arithmetic
 * is the same whichever task computes it, so its bits do not depend on the other rows or on the thread
 * count, and one long row spreads over every thread.
 * Scores: a position's dot products for the heads are accumulated side by side, eight positions reduced
 * together (one add tree for eight sums). Values: the heads' outputs stay in registers, four vectors of
 * each at a time. `fast_*(NULL, ...)` says whether this path takes the shape; where it does not (other
 * head sizes, no AVX2), the generic row runs.
 * Measured against the path before it (a task per query head, reading as it computed), interleaved in one
 * process on 2 cores: a decode step of one stream at 1,500-1,900 positions 14.1 -> 11.1 ms, eight streams
 * of their own 1,500 positions 51 -> 42 ms; eight streams sharing one 1,500-position prefix 42 -> 39.5 ms
 * (even before the rows that share a chunk became one task: those blocks were in cache already). */
/* A chunk's K and V: read through into L2 and computed from there (128 positions of the default model's
 * float16 cache). */
#define CHUNK_BYTES (96 * 1024)
/* The chunk partials one call holds at a time. */
#define WAVE_BYTES (8 << 20)
#define HG 4

/* Blocks per chunk, for this block size and `row_bytes` of K (as of V) per position. */
static inline int64_t chunk_blocks(int64_t block_size, size_t row_bytes)
{
    const int64_t blocks = (int64_t)(CHUNK_BYTES / (2 * row_bytes)) / block_size;
    return blocks < 1 ? 1 : blocks;
}

/* Scores s[0, n) -> exp(score - highest), in place: `mx` the highest, `sum` the exps' sum in position
 * order. */
#define EXP_SCORES(EXP, s, n, mx, sum)                                                                   \
    do {                                                                                                 \
        mx = (s)[0];                                                                                     \
        for (int64_t p_ = 1; p_ < (n); p_++)                                                             \
            mx = (s)[p_] > mx ? (s)[p_] : mx;                                                            \
        sum = 0;                                                                                         \
        for (int64_t p_ = 0; p_ < (n); p_++) {                                                           \
            (s)[p_] = EXP((s)[p_] - mx);                                                                 \
            sum += (s)[p_];                                                                              \
        }                                                                                                \
    } while (0)

/* One chunk of one row: the vector path's unit of work. */
struct unit {
    int64_t row, chunk;
    /* Whole chunks (every block full): a hash of their block ids; the row's last, partial chunk: none. */
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
static int64_t plan_units(const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows,
                          int64_t block_size, int64_t cb, const int64_t *first, struct unit *units,
                          int64_t *starts)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < first[r + 1] - first[r]; c++) {
            struct unit *u = &units[first[r] + c];
            u->row = r, u->chunk = c;
            u->whole = (c + 1) * cb * block_size <= lens[r];
            /* FNV-1a over the chunk's block ids. */
            u->key = 14695981039346656037ull;
            for (int64_t b = c * cb; u->whole && b < (c + 1) * cb; b++)
                u->key = (u->key ^ (uint64_t)tables[r * table_stride + b]) * 1099511628211ull;
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

#define DEFINE_NO_FAST(NAME, T, KV)                                                                      \
    static int NAME(const T *q, const KV *kc, const KV *vc, const int64_t *table, int64_t n, int64_t b0, \
                    int64_t b1, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, T scale, \
                    T *scores, T *part, int64_t part_stride, int touch)                                  \
    {                                                                                                    \
        (void)q, (void)kc, (void)vc, (void)table, (void)n, (void)b0, (void)b1, (void)heads;              \
        (void)kv_heads, (void)dim, (void)block_size, (void)scale, (void)scores, (void)part;              \
        (void)part_stride, (void)touch;                                                                  \
        return 0;                                                                                        \
    }
DEFINE_NO_FAST(no_fast_f64, double, double)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
#ifdef __FLT16_MAX__
static inline __m256 load8_f16(const _Float16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* Blocks [b0, b1) of both caches (each block's rows of every KV head lie together in the pool), read
 * once through before the chunk is computed, so that the computing passes find them in cache. Blocks sit
 * anywhere in the pool, and a pass that computes as it reads has too few misses in flight to keep memory
 * busy; this loop has nothing but independent loads. Prefetch instructions ahead of the passes did not
 * help here (measured on an AMD EPYC): the loads nearly halved attention's time at 1,500 positions. */
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

/* Lane i: the sum of v[i]'s eight lanes. */
static inline __m256 sum8(const __m256 v[8])
{
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* Scores of `hg` query heads (q: their rows, C * 8 floats each, back to back) at the `len` positions of
 * one block (k: the KV head's row at its first position), into sh[h * width + i]. hg and C are constants
 * at each call, so the loops over them unroll into registers. */
#define DEFINE_FAST_SCORES(NAME, KV, LOAD8)                                                              \
    static inline __attribute__((always_inline)) void NAME(const int hg, const int C, const float *restrict q, \
                                                           const KV *restrict k, int64_t len, int64_t stride, \
                                                           __m256 sv, float *restrict sh, int64_t width)  \
    {                                                                                                    \
        for (int64_t i0 = 0; i0 < len; i0 += 8) {                                                        \
            const int64_t m = len - i0 < 8 ? len - i0 : 8;                                               \
            __m256 acc[HG][8];                                                                           \
            for (int i = 0; i < 8; i++) {                                                                \
                /* Past the block's end, the last position again: computed, never stored. */             \
                const KV *kr = k + (i0 + (i < m ? i : m - 1)) * stride;                                  \
                __m256 kv = LOAD8(kr), a[HG];                                                            \
                for (int h = 0; h < hg; h++)                                                             \
                    a[h] = _mm256_mul_ps(_mm256_loadu_ps(q + h * C * 8), kv);                             \
                for (int c = 1; c < C; c++) {                                                            \
                    kv = LOAD8(kr + 8 * c);                                                              \
                    for (int h = 0; h < hg; h++)                                                         \
                        a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * C * 8 + 8 * c), kv, a[h]);         \
                }                                                                                        \
                for (int h = 0; h < hg; h++)                                                             \
                    acc[h][i] = a[h];                                                                    \
            }                                                                                            \
            for (int h = 0; h < hg; h++) {                                                               \
                const __m256 s = _mm256_mul_ps(sum8(acc[h]), sv);                                        \
                float *dst = sh + h * width + i0;                                                        \
                if (m == 8) {                                                                            \
                    _mm256_storeu_ps(dst, s);                                                            \
                } else {                                                                                 \
                    float lanes[8];                                                                      \
                    _mm256_storeu_ps(lanes, s);                                                          \
                    for (int64_t i = 0; i < m; i++)                                                      \
                        dst[i] = lanes[i];                                                               \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

/* The `hg` heads' weighted values over the `len` positions of one block (v: the KV head's row at its first
 * position; w[h * width + i]: head h's weight of position i), added in position order to o[h * o_stride]
 * (C * 8 floats each), four vectors of each head at a time. */
#define DEFINE_FAST_VALUES(NAME, KV, LOAD8)                                                              \
    static inline __attribute__((always_inline)) void NAME(const int hg, const int C, const KV *restrict v, \
                                                           int64_t len, int64_t stride, const float *restrict w, \
                                                           int64_t width, float *restrict o, int64_t o_stride) \
    {                                                                                                    \
        for (int c0 = 0; c0 < C; c0 += 4) {                                                              \
            __m256 acc[HG][4];                                                                           \
            for (int h = 0; h < hg; h++)                                                                 \
                for (int c = 0; c < 4; c++)                                                              \
                    acc[h][c] = _mm256_loadu_ps(o + h * o_stride + 8 * (c0 + c));                        \
            for (int64_t i = 0; i < len; i++) {                                                          \
                __m256 wv[HG];                                                                           \
                for (int h = 0; h < hg; h++)                                                             \
                    wv[h] = _mm256_set1_ps(w[h * width + i]);                                            \
                for (int c = 0; c < 4; c++) {                                                            \
                    const __m256 x = LOAD8(v + i * stride + 8 * (c0 + c));                               \
                    for (int h = 0; h < hg; h++)                                                         \
                        acc[h][c] = _mm256_fmadd_ps(wv[h], x, acc[h][c]);                                \
                }                                                                                        \
            }                                                                                            \
            for (int h = 0; h < hg; h++)                                                                 \
                for (int c = 0; c < 4; c++)                                                              \
                    _mm256_storeu_ps(o + h * o_stride + 8 * (c0 + c), acc[h][c]);                        \
        }                                                                                                \
    }

/* One call per constant (hg, C) pair, so that each unrolls into registers. */
#define FAST_CASES(CALL, FN, C) CALL(FN, 1, C) CALL(FN, 2, C) CALL(FN, 3, C) CALL(FN, 4, C)
#define FAST_SWITCH(CALL, FN)                                                                            \
    if (dim == 64) {                                                                                     \
        switch (hg) { FAST_CASES(CALL, FN, 8) }                                                          \
    } else {                                                                                             \
        switch (hg) { FAST_CASES(CALL, FN, 16) }                                                         \
    }
/* In FAST_PASS: `kv` the KV head's row at the block's first position, `w` the heads' scores there. */
#define SCORES_CALL(FN, G, C)                                                                            \
    case G:                                                                                              \
        FN(G, C, q + h0 * dim, kv, len, stride, sv, w, width);                                           \
        break;
#define VALUES_CALL(FN, G, C)                                                                            \
    case G:                                                                                              \
        FN(G, C, kv, len, stride, w, width, part + h0 * part_stride + 2, part_stride);                   \
        break;
/* One pass of DEFINE_FAST over its blocks, each KV head of a block, that head's query heads HG at a time:
 * CALL with FN per (block, KV head, query heads). */
#define FAST_PASS(KV, CACHE, CALL, FN)                                                                     \
    for (int64_t b = b0; b < b1; b++) {                                                                  \
        const int64_t len = n - b * block_size < block_size ? n - b * block_size : block_size;           \
        for (int64_t g = 0; g < kv_heads; g++) {                                                         \
            const KV *kv = (CACHE) + table[b] * block_size * stride + g * dim;                           \
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HG) {                               \
                const int hg = (g + 1) * group - h0 < HG ? (int)((g + 1) * group - h0) : HG;             \
                float *w = scores + h0 * width + b * block_size - p0;                                    \
                FAST_SWITCH(CALL, FN)                                                                    \
            }                                                                                            \
        }                                                                                                \
    }

/* Every head of one row (q: its [heads, dim] rows) over blocks [b0, b1) of its context (the chunk): per
 * head h, part[h * part_stride] = the chunk's highest score, then the sum of exp(score - highest), then the
 * values weighted by those exps. A block's rows for every KV head lie together in the pool, so each block
 * is read whole, once by the scores and once by the values; `scores` holds heads * (b1 - b0) * block_size
 * floats. With q NULL, only whether this path takes the shape. */
#define DEFINE_FAST(NAME, KV, LOAD8)                                                                     \
    DEFINE_FAST_SCORES(NAME##_scores, KV, LOAD8)                                                         \
    DEFINE_FAST_VALUES(NAME##_values, KV, LOAD8)                                                         \
    static int NAME(const float *q, const KV *kc, const KV *vc, const int64_t *table, int64_t n,        \
                    int64_t b0, int64_t b1, int64_t heads, int64_t kv_heads, int64_t dim,                \
                    int64_t block_size, float scale, float *scores, float *part, int64_t part_stride,   \
                    int touch)                                                                           \
    {                                                                                                    \
        if (dim != 64 && dim != 128)                                                                     \
            return 0;                                                                                    \
        if (!q)                                                                                          \
            return 1;                                                                                    \
        const int64_t group = heads / kv_heads, stride = kv_heads * dim, width = (b1 - b0) * block_size; \
        const int64_t p0 = b0 * block_size, m_all = (n < b1 * block_size ? n : b1 * block_size) - p0;    \
        const size_t row_bytes = (size_t)stride * sizeof(KV);                                            \
        const __m256 sv = _mm256_set1_ps(scale);                                                         \
        if (touch)                                                                                       \
            touch_blocks(kc, vc, table, b0, b1, n, block_size, row_bytes);                               \
        FAST_PASS(KV, kc, SCORES_CALL, NAME##_scores)                                                    \
        for (int64_t h = 0; h < heads; h++) {                                                            \
            float *s = scores + h * width, *ph = part + h * part_stride, mx, sum;                        \
            EXP_SCORES(expf, s, m_all, mx, sum);                                                         \
            ph[0] = mx;                                                                                  \
            ph[1] = sum;                                                                                 \
            for (int64_t d = 0; d < dim; d++)                                                            \
                ph[2 + d] = 0;                                                                           \
        }                                                                                                \
        FAST_PASS(KV, vc, VALUES_CALL, NAME##_values)                                                    \
        return 1;                                                                                        \
    }
DEFINE_FAST(fast_f32, float, load8_f32)
#ifdef __FLT16_MAX__
DEFINE_FAST(fast_f16, _Float16, load8_f16)
#endif
#else
DEFINE_NO_FAST(fast_f32, float, float)
#ifdef __FLT16_MAX__
DEFINE_NO_FAST(fast_f16, float, _Float16)
#endif
#endif

/* The row of a cached position as T: the cache's own row when KV is T. */
#define SAME_ROW(src, wide, n) (src)

#define DEFINE_PAGED_ATTENTION(T, KV, EXP, NAME, ROW, FAST)                                                     \
    static void NAME##_row(const T *restrict q, T *restrict out, const KV *restrict kc,              \
                           const KV *restrict vc, const int64_t *restrict table, int64_t n,          \
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,       \
                           T scale, T *restrict scores, T *restrict acc)                             \
    {                                                                                                 \
        const int64_t group = heads / kv_heads, stride = kv_heads * dim;                              \
        T wide[stride];                                                                               \
        (void)wide;                                                                                   \
        for (int64_t start = 0; start < n; start += block_size) {                                     \
            const int64_t len = n - start < block_size ? n - start : block_size;                      \
            const KV *k = kc + table[start / block_size] * block_size * stride;                        \
            for (int64_t i = 0; i < len; i++, k += stride) {                                          \
                const T *kr = ROW(k, wide, stride);                                                   \
                for (int64_t h = 0; h < heads; h++) {                                                 \
                    const T *qh = q + h * dim;                                                        \
                    const T *kh = kr + (h / group) * dim;                                             \
                    T s = 0;                                                                          \
                    for (int64_t d = 0; d < dim; d++)                                                 \
                        s += qh[d] * kh[d];                                                           \
                    scores[h * n + start + i] = s * scale;                                            \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int64_t h = 0; h < heads; h++) {                                                         \
            T *sh = scores + h * n, m, sum;                                                           \
            EXP_SCORES(EXP, sh, n, m, sum);                                                           \
            const T inv = 1 / sum;                                                                    \
            for (int64_t p = 0; p < n; p++)                                                           \
                sh[p] *= inv;                                                                         \
        }                                                                                             \
        for (int64_t j = 0; j < heads * dim; j++)                                                     \
            acc[j] = 0;                                                                               \
        for (int64_t start = 0; start < n; start += block_size) {                                     \
            const int64_t len = n - start < block_size ? n - start : block_size;                      \
            const KV *v = vc + table[start / block_size] * block_size * stride;                        \
            for (int64_t i = 0; i < len; i++, v += stride) {                                          \
                const T *vr = ROW(v, wide, stride);                                                   \
                for (int64_t h = 0; h < heads; h++) {                                                 \
                    const T w = scores[h * n + start + i];                                            \
                    const T *vh = vr + (h / group) * dim;                                             \
                    T *ah = acc + h * dim;                                                            \
                    for (int64_t d = 0; d < dim; d++)                                                 \
                        ah[d] += w * vh[d];                                                           \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int64_t j = 0; j < heads * dim; j++)                                                     \
            out[j] = acc[j];                                                                          \
    }                                                                                                 \
                                                                                                      \
    /* The vector path: tasks are chunks (of one row, or of the rows that share its blocks, see         \
     * `plan_units`), then each (row, head) merges its chunks' partials in chunk order; one chunk     \
     * needs only its sum's inverse. Returns 0, or -1 when scratch memory could not be allocated. */  \
    static int NAME##_chunks(const T *q, int64_t q_stride, T *out, const KV *k_cache, const KV *v_cache, \
                             const int64_t *tables, int64_t table_stride, const int64_t *lens,         \
                             int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,              \
                             int64_t block_size, T scale, int threads)                                \
    {                                                                                                 \
        const int64_t cb = chunk_blocks(block_size, sizeof(KV) * (size_t)(kv_heads * dim));           \
        const int64_t part_size = dim + 2;                                                            \
        /* first[r]: row r's first chunk; its partials start at first[r] * heads. */                  \
        int64_t *first = malloc(sizeof(int64_t) * (size_t)(rows + 1));                                \
        if (!first)                                                                                   \
            return -1;                                                                                \
        first[0] = 0;                                                                                 \
        for (int64_t r = 0; r < rows; r++)                                                            \
            first[r + 1] = first[r] + (lens[r] + block_size * cb - 1) / (block_size * cb);            \
        const int64_t units_n = first[rows], nt = threads < 1 ? 1 : threads;                         \
        const size_t scores_n = (size_t)(heads * cb * block_size);                                    \
        T *parts = malloc(sizeof(T) * (size_t)(units_n * heads * part_size));                         \
        struct unit *units = malloc(sizeof(struct unit) * (size_t)units_n);                           \
        int64_t *starts = malloc(sizeof(int64_t) * (size_t)(units_n + 1));                            \
        T *scores_all = malloc(sizeof(T) * scores_n * (size_t)nt);                                    \
        const int ok = parts && units && starts && scores_all;                                        \
        const int64_t tasks = ok ? plan_units(tables, table_stride, lens, rows, block_size, cb, first, \
                                              units, starts)                                          \
                                 : 0;                                                                 \
        const int64_t merges = ok ? rows * heads : 0;                                                 \
        _Pragma("omp parallel num_threads(nt) if (ok)")                                               \
        {                                                                                             \
            T *scores = ok ? scores_all + (size_t)omp_get_thread_num() * scores_n : NULL;             \
            _Pragma("omp for schedule(dynamic, 1)")                                                   \
            for (int64_t t = 0; t < tasks; t++)                                                       \
                for (int64_t i = starts[t]; i < starts[t + 1]; i++) {                                 \
                    const int64_t r = units[i].row, c = units[i].chunk;                               \
                    const int64_t chunks = first[r + 1] - first[r];                                   \
                    const int64_t blocks = (lens[r] + block_size - 1) / block_size;                   \
                    const int64_t b1 = (c + 1) * cb < blocks ? (c + 1) * cb : blocks;                 \
                    FAST(q + r * q_stride, k_cache, v_cache, tables + r * table_stride, lens[r], c * cb, \
                         b1, heads, kv_heads, dim, block_size, scale, scores,                         \
                         parts + (first[r] * heads + c) * part_size, chunks * part_size, i == starts[t]); \
                }                                                                                     \
            _Pragma("omp for schedule(static)")                                                       \
            for (int64_t rh = 0; rh < merges; rh++) {                                                 \
                const int64_t r = rh / heads, h = rh % heads, chunks = first[r + 1] - first[r];       \
                const T *part = parts + (first[r] * heads + h * chunks) * part_size;                  \
                T *o = out + rh * dim;                                                                \
                T mx = part[0];                                                                       \
                for (int64_t c = 1; c < chunks; c++)                                                  \
                    mx = part[c * part_size] > mx ? part[c * part_size] : mx;                         \
                T sum = 0;                                                                            \
                for (int64_t d = 0; d < dim; d++)                                                     \
                    o[d] = 0;                                                                         \
                for (int64_t c = 0; c < chunks; c++) {                                                \
                    const T *pc = part + c * part_size;                                               \
                    const T e = chunks == 1 ? 1 : EXP(pc[0] - mx);                                    \
                    sum += pc[1] * e;                                                                 \
                    for (int64_t d = 0; d < dim; d++)                                                 \
                        o[d] += pc[2 + d] * e;                                                        \
                }                                                                                     \
                const T inv = 1 / sum;                                                                \
                for (int64_t d = 0; d < dim; d++)                                                     \
                    o[d] *= inv;                                                                      \
            }                                                                                         \
        }                                                                                             \
        free(scores_all);                                                                             \
        free(starts);                                                                                 \
        free(units);                                                                                  \
        free(parts);                                                                                  \
        free(first);                                                                                  \
        return ok ? 0 : -1;                                                                           \
    }                                                                                                 \
                                                                                                      \
    /* q: rows of [heads, dim], `q_stride` elements apart; out: [rows, heads, dim] contiguous;        \
     * tables: row r's block ids from tables + r * table_stride (0: every row reads one table, as a    \
     * prefill chunk's tokens do); lens: [rows] context lengths, each >= 1.                           \
     * Returns 0, or -1 when scratch memory could not be allocated. */                                \
    int NAME(const T *q, int64_t q_stride, T *out, const KV *k_cache, const KV *v_cache,              \
             const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows,           \
             int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, double scale,          \
             int threads)                                                                             \
    {                                                                                                 \
        if (FAST(NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0, dim, 0, 0, NULL, NULL, 0, 0)) {                  \
            /* Rows in waves whose chunk partials fit in WAVE_BYTES (at least one row each): a long    \
             * prefill chunk's rows would otherwise hold tens of MiB of partials at once. */          \
            const int64_t span = block_size * chunk_blocks(block_size, sizeof(KV) * (size_t)(kv_heads * dim)); \
            const int64_t unit_bytes = heads * (dim + 2) * (int64_t)sizeof(T);                        \
            for (int64_t r0 = 0, r1; r0 < rows; r0 = r1) {                                            \
                int64_t bytes = 0;                                                                    \
                for (r1 = r0; r1 < rows; r1++) {                                                      \
                    bytes += (lens[r1] + span - 1) / span * unit_bytes;                               \
                    if (r1 > r0 && bytes > WAVE_BYTES)                                                \
                        break;                                                                        \
                }                                                                                     \
                if (NAME##_chunks(q + r0 * q_stride, q_stride, out + r0 * heads * dim, k_cache, v_cache, \
                                  tables + r0 * table_stride, table_stride, lens + r0, r1 - r0, heads, \
                                  kv_heads, dim, block_size, (T)scale, threads))                      \
                    return -1;                                                                        \
            }                                                                                         \
            return 0;                                                                                 \
        }                                                                                             \
        int64_t longest = 0;                                                                          \
        for (int64_t r = 0; r < rows; r++)                                                            \
            longest = lens[r] > longest ? lens[r] : longest;                                          \
        int failed = 0;                                                                               \
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)")                            \
        {                                                                                             \
            T *scores = malloc(sizeof(T) * (size_t)(heads * (longest + dim)));                        \
            _Pragma("omp for schedule(dynamic, 1)")                                                   \
            for (int64_t r = 0; r < rows; r++) {                                                      \
                if (!scores) {                                                                        \
                    failed = 1;                                                                       \
                    continue;                                                                         \
                }                                                                                     \
                NAME##_row(q + r * q_stride, out + r * heads * dim, k_cache, v_cache,                 \
                           tables + r * table_stride, lens[r], heads, kv_heads, dim, block_size,       \
                           (T)scale, scores, scores + heads * longest);                               \
            }                                                                                         \
            free(scores);                                                                             \
        }                                                                                             \
        return failed ? -1 : 0;                                                                       \
    }

DEFINE_PAGED_ATTENTION(float, float, expf, paged_attention_f32, SAME_ROW, fast_f32)
DEFINE_PAGED_ATTENTION(double, double, exp, paged_attention_f64, SAME_ROW, no_fast_f64)
/* Compilers without the _Float16 type build the rest; the caller then finds no float16 symbol. */
#ifdef __FLT16_MAX__
/* n float16 values widened to float into `wide` (exact either way, so both paths give the same bits). */
static inline const float *widen_f16(const _Float16 *restrict src, float *restrict wide, int64_t n)
{
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(wide + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        wide[i] = (float)src[i];
    return wide;
}
DEFINE_PAGED_ATTENTION(float, _Float16, expf, paged_attention_f32_kv16, widen_f16, fast_f16)
#endif
