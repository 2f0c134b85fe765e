/* Paged decode attention for the CPU, loaded through ctypes by kvserve/model/native_attention.py.
 *
 * Each query row attends to the first `lens[r]` positions of its own sequence, read in place from the
 * paged cache (slot = block * block_size + offset, layout [slots, kv_heads, head_dim]): no context is
 * gathered into a copy and no row is padded to the longest one. A row is one task, computed by one
 * thread from start to end with reductions in position order, so its result depends only on its query,
 * its context and its length: never on the other rows of the step or on the thread count. That is what
 * makes decodes bitwise batch-invariant.
 *
 * The generic code is built for float and double (double serves the float64 reference runs of the tests),
 * and for float with a float16 cache (KV): each cached position's row is widened to float as it is
 * read (exactly, with F16C where the CPU has it: a conversion per element in the inner loop kept it from
 * vectorizing and doubled the decode time at long contexts), and every product and sum stays in float.
 * Float rows with a head size of 64 or 128 take a vector path instead (`fast_row_*`, below), 1.7-2x the
 * generic code at 1,500-2,000 positions with a float16 cache (one row, one thread, side by side).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The float rows' fast path (AVX2, FMA, F16C; head_dim 64 or 128): the same three passes, ordered for
 * registers. Heads go one at a time, grouped by KV head so that a KV head's keys and values stay in L2
 * across the query heads that share them. Scores: the query head's vectors stay in registers, eight
 * positions' dot products are accumulated side by side (widening float16 as they load) and reduced
 * together, one add tree for eight sums instead of eight horizontal sums. Values: the head's output
 * stays in registers across every position. Each row is still one task, computed start to end by one
 * thread, so its bits depend on its query, context and length alone. Returns 0 where it does not apply
 * (other head sizes, no AVX2), and the generic row runs. */
#define DEFINE_NO_FAST_ROW(NAME, T, KV)                                                                  \
    static int NAME(const T *q, T *out, const KV *kc, const KV *vc, const int64_t *table, int64_t n,      \
                    int64_t h0, int64_t h1, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, \
                    T scale, T *scores)                                                                  \
    {                                                                                                    \
        (void)q, (void)out, (void)kc, (void)vc, (void)table, (void)n, (void)h0, (void)h1, (void)heads;   \
        (void)kv_heads, (void)dim, (void)block_size, (void)scale, (void)scores;                          \
        return 0;                                                                                        \
    }
DEFINE_NO_FAST_ROW(no_fast_row_f64, double, double)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
#ifdef __FLT16_MAX__
static inline __m256 load8_f16(const _Float16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* A head's rows of block `b` of the table (`row_bytes` at each of the block's positions, `elem` bytes an
 * element), fetched into cache ahead of use: blocks sit anywhere in the pool, so the hardware
 * prefetcher loses the stream at every block boundary. */
#define AHEAD 2
static inline void prefetch_block(const void *head, const int64_t *table, int64_t b, int64_t n,
                                  int64_t block_size, int64_t stride, size_t elem, size_t row_bytes)
{
    if (b * block_size >= n)
        return;
    const int64_t len = n - b * block_size < block_size ? n - b * block_size : block_size;
    const char *row = (const char *)head + (size_t)(table[b] * block_size * stride) * elem;
    for (int64_t i = 0; i < len; i++, row += (size_t)stride * elem)
        for (size_t line = 0; line < row_bytes; line += 64)
            _mm_prefetch(row + line, _MM_HINT_T0);
}

/* Lane i: the sum of v[i]'s eight lanes. */
static inline __m256 sum8(const __m256 v[8])
{
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

#define DEFINE_FAST_HEAD(NAME, KV, LOAD8, D)                                                             \
    static void NAME(const float *restrict qh, float *restrict oh, const KV *restrict kc,                \
                     const KV *restrict vc, const int64_t *restrict table, int64_t n, int64_t stride,    \
                     int64_t block_size, float scale, float *restrict sh)                                \
    {                                                                                                   \
        enum { C = D / 8 };                                                                             \
        __m256 qv[C];                                                                                   \
        for (int c = 0; c < C; c++)                                                                     \
            qv[c] = _mm256_loadu_ps(qh + 8 * c);                                                        \
        const __m256 sv = _mm256_set1_ps(scale);                                                        \
        for (int64_t start = 0; start < n; start += block_size) {                                       \
            const int64_t len = n - start < block_size ? n - start : block_size;                        \
            const KV *k = kc + table[start / block_size] * block_size * stride;                         \
            prefetch_block(kc, table, start / block_size + AHEAD, n, block_size, stride, sizeof(KV), D * sizeof(KV)); \
            for (int64_t i0 = 0; i0 < len; i0 += 8) {                                                   \
                const int64_t m = len - i0 < 8 ? len - i0 : 8;                                          \
                __m256 acc[8];                                                                          \
                for (int i = 0; i < 8; i++) {                                                           \
                    /* Past the block's end, the last position again: computed, never stored. */        \
                    const KV *kr = k + (i0 + (i < m ? i : m - 1)) * stride;                             \
                    __m256 a = _mm256_mul_ps(qv[0], LOAD8(kr));                                         \
                    for (int c = 1; c < C; c++)                                                         \
                        a = _mm256_fmadd_ps(qv[c], LOAD8(kr + 8 * c), a);                               \
                    acc[i] = a;                                                                         \
                }                                                                                       \
                const __m256 s = _mm256_mul_ps(sum8(acc), sv);                                          \
                if (m == 8) {                                                                           \
                    _mm256_storeu_ps(sh + start + i0, s);                                               \
                } else {                                                                                \
                    float lanes[8];                                                                     \
                    _mm256_storeu_ps(lanes, s);                                                         \
                    for (int64_t i = 0; i < m; i++)                                                     \
                        sh[start + i0 + i] = lanes[i];                                                  \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        float mx = sh[0];                                                                               \
        for (int64_t p = 1; p < n; p++)                                                                 \
            mx = sh[p] > mx ? sh[p] : mx;                                                               \
        float sum = 0;                                                                                  \
        for (int64_t p = 0; p < n; p++) {                                                               \
            sh[p] = expf(sh[p] - mx);                                                                   \
            sum += sh[p];                                                                               \
        }                                                                                               \
        const float inv = 1 / sum;                                                                      \
        __m256 acc[C];                                                                                  \
        for (int c = 0; c < C; c++)                                                                     \
            acc[c] = _mm256_setzero_ps();                                                               \
        for (int64_t start = 0; start < n; start += block_size) {                                       \
            const int64_t len = n - start < block_size ? n - start : block_size;                        \
            const KV *v = vc + table[start / block_size] * block_size * stride;                         \
            prefetch_block(vc, table, start / block_size + AHEAD, n, block_size, stride, sizeof(KV), D * sizeof(KV)); \
            for (int64_t i = 0; i < len; i++, v += stride) {                                            \
                const __m256 w = _mm256_set1_ps(sh[start + i]);                                         \
                for (int c = 0; c < C; c++)                                                             \
                    acc[c] = _mm256_fmadd_ps(w, LOAD8(v + 8 * c), acc[c]);                              \
            }                                                                                           \
        }                                                                                               \
        const __m256 iv = _mm256_set1_ps(inv);                                                          \
        for (int c = 0; c < C; c++)                                                                     \
            _mm256_storeu_ps(oh + 8 * c, _mm256_mul_ps(acc[c], iv));                                    \
    }

#define DEFINE_FAST_ROW(NAME, KV, LOAD8)                                                                 \
    DEFINE_FAST_HEAD(NAME##_64, KV, LOAD8, 64)                                                          \
    DEFINE_FAST_HEAD(NAME##_128, KV, LOAD8, 128)                                                        \
    /* Heads [h0, h1) of one row; with q NULL, only whether this path takes the shape. Heads go in     \
     * order, so a KV head's group runs back to back. */                                                \
    static int NAME(const float *q, float *out, const KV *kc, const KV *vc, const int64_t *table,       \
                    int64_t n, int64_t h0, int64_t h1, int64_t heads, int64_t kv_heads, int64_t dim,     \
                    int64_t block_size, float scale, float *scores)                                      \
    {                                                                                                   \
        if (dim != 64 && dim != 128)                                                                    \
            return 0;                                                                                   \
        if (!q)                                                                                         \
            return 1;                                                                                   \
        const int64_t group = heads / kv_heads, stride = kv_heads * dim;                                \
        for (int64_t h = h0; h < h1; h++) {                                                             \
            const int64_t g = h / group;                                                                \
            (dim == 64 ? NAME##_64 : NAME##_128)(q + h * dim, out + h * dim, kc + g * dim, vc + g * dim, \
                                                 table, n, stride, block_size, scale, scores);          \
        }                                                                                               \
        return 1;                                                                                       \
    }
DEFINE_FAST_ROW(fast_row_f32, float, load8_f32)
#ifdef __FLT16_MAX__
DEFINE_FAST_ROW(fast_row_f16, _Float16, load8_f16)
#endif
#else
DEFINE_NO_FAST_ROW(fast_row_f32, float, float)
#ifdef __FLT16_MAX__
DEFINE_NO_FAST_ROW(fast_row_f16, float, _Float16)
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
            T *sh = scores + h * n;                                                                   \
            T m = sh[0];                                                                              \
            for (int64_t p = 1; p < n; p++)                                                           \
                m = sh[p] > m ? sh[p] : m;                                                            \
            T sum = 0;                                                                                \
            for (int64_t p = 0; p < n; p++) {                                                         \
                sh[p] = EXP(sh[p] - m);                                                               \
                sum += sh[p];                                                                         \
            }                                                                                         \
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
    /* q: rows of [heads, dim], `q_stride` elements apart; out: [rows, heads, dim] contiguous;        \
     * tables: [rows, table_width] block ids; lens: [rows] context lengths, each >= 1.                \
     * Returns 0, or -1 when scratch memory could not be allocated. */                                \
    int NAME(const T *q, int64_t q_stride, T *out, const KV *k_cache, const KV *v_cache,              \
             const int64_t *tables, int64_t table_width, const int64_t *lens, int64_t rows,           \
             int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, double scale,          \
             int threads)                                                                             \
    {                                                                                                 \
        int64_t longest = 0;                                                                          \
        for (int64_t r = 0; r < rows; r++)                                                            \
            longest = lens[r] > longest ? lens[r] : longest;                                          \
        int failed = 0;                                                                               \
        /* Fewer rows than threads (one stream): the vector path's heads are the tasks instead, each  \
         * still computed whole by one thread, so the bits do not change. */                          \
        const int by_head = rows < threads && FAST(NULL, NULL, NULL, NULL, NULL, 0, 0, 0, heads, kv_heads, \
                                                   dim, block_size, 0, NULL);                         \
        const int64_t tasks = by_head ? rows * heads : rows;                                          \
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)")                            \
        {                                                                                             \
            T *scores = malloc(sizeof(T) * (size_t)(heads * (longest + dim)));                        \
            /* Every thread must reach the worksharing loop: a failed allocation only skips work. */  \
            _Pragma("omp for schedule(dynamic, 1)")                                                   \
            for (int64_t t = 0; t < tasks; t++) {                                                     \
                if (!scores) {                                                                        \
                    failed = 1;                                                                       \
                    continue;                                                                         \
                }                                                                                     \
                const int64_t r = by_head ? t / heads : t, h0 = by_head ? t % heads : 0;              \
                if (!FAST(q + r * q_stride, out + r * heads * dim, k_cache, v_cache,                  \
                          tables + r * table_width, lens[r], h0, by_head ? h0 + 1 : heads, heads,     \
                          kv_heads, dim, block_size, (T)scale, scores))                               \
                    NAME##_row(q + r * q_stride, out + r * heads * dim, k_cache, v_cache,             \
                               tables + r * table_width, lens[r], heads, kv_heads, dim, block_size,   \
                               (T)scale, scores, scores + heads * longest);                           \
            }                                                                                         \
            free(scores);                                                                             \
        }                                                                                             \
        return failed ? -1 : 0;                                                                       \
    }

DEFINE_PAGED_ATTENTION(float, float, expf, paged_decode_attention_f32, SAME_ROW, fast_row_f32)
DEFINE_PAGED_ATTENTION(double, double, exp, paged_decode_attention_f64, SAME_ROW, no_fast_row_f64)
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
DEFINE_PAGED_ATTENTION(float, _Float16, expf, paged_decode_attention_f32_kv16, widen_f16, fast_row_f16)
#endif
