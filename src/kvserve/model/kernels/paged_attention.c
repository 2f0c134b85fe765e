/* Paged decode attention for the CPU, loaded through ctypes by kvserve/model/native_attention.py.
 *
 * Each query row attends to the first `lens[r]` positions of its own sequence, read in place from the
 * paged cache (slot = block * block_size + offset, layout [slots, kv_heads, head_dim]): no context is
 * gathered into a copy and no row is padded to the longest one. A row is one task, computed by one
 * thread from start to end with reductions in position order, so its result depends only on its query,
 * its context and its length: never on the other rows of the step or on the thread count. That is what
 * makes decodes bitwise batch-invariant.
 *
 * The same code is built for float and double (double serves the float64 reference runs of the tests),
 * and for float with a float16 cache (KV): each cached position's row is widened to float as it is
 * read (exactly, with F16C where the CPU has it: a conversion per element in the inner loop kept it from
 * vectorizing and doubled the decode time at long contexts), and every product and sum stays in float.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* The row of a cached position as T: the cache's own row when KV is T. */
#define SAME_ROW(src, wide, n) (src)

#define DEFINE_PAGED_ATTENTION(T, KV, EXP, NAME, ROW)                                                     \
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
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)")                            \
        {                                                                                             \
            T *scores = malloc(sizeof(T) * (size_t)(heads * (longest + dim)));                        \
            /* Every thread must reach the worksharing loop: a failed allocation only skips work. */  \
            _Pragma("omp for schedule(dynamic, 1)")                                                   \
            for (int64_t r = 0; r < rows; r++) {                                                      \
                if (!scores) {                                                                        \
                    failed = 1;                                                                       \
                    continue;                                                                         \
                }                                                                                     \
                NAME##_row(q + r * q_stride, out + r * heads * dim, k_cache, v_cache,                 \
                           tables + r * table_width, lens[r], heads, kv_heads, dim, block_size,       \
                           (T)scale, scores, scores + heads * longest);                               \
            }                                                                                         \
            free(scores);                                                                             \
        }                                                                                             \
        return failed ? -1 : 0;                                                                       \
    }

DEFINE_PAGED_ATTENTION(float, float, expf, paged_decode_attention_f32, SAME_ROW)
DEFINE_PAGED_ATTENTION(double, double, exp, paged_decode_attention_f64, SAME_ROW)
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
DEFINE_PAGED_ATTENTION(float, _Float16, expf, paged_decode_attention_f32_kv16, widen_f16)
#endif
