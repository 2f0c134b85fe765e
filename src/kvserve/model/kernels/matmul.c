/* The products' entry point: one call per product of one or more parts (q, k and v of different types),
 * the activations' int16 quants (row by row, and by group of rows) and sums per 16 computed once for every
 * part, the outputs split between OpenMP threads, each output summed by one thread by the portable
 * reference (quants.c) or the x86 tiles (arch/x86/quants.c). Also the rows' dequantization (embedding lookups). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "quants.h"

int quant_linear_vectorized(void) { return HAVE_AVX2; }

int quant_type_supported(int type) { return type_known(type); }

/* The activations' forms the paths read (struct product), written once per product. */
struct prepared {
    float *sx32, *sx16, *dx;
    int32_t *xt, *xsum;
    int16_t *xq;
    int64_t ss;
};

/* Rows [t0, t1) of x in every form of `pr` it has: their sums per 32 and per 16, their int16 quants, scales
 * and quants' sums per 16, and their quants again by group of Q16_GROUP rows (xt; t0 and t1 whole groups
 * or the last rows). A row's forms depend on that row alone, so the rows may be split among threads. */
static void prepare_rows(const float *x, int64_t n_in, int64_t t0, int64_t t1, const struct prepared *pr)
{
    const int64_t ns = n_in / QK, ss = pr->ss;
    for (int size = QK; size >= QK / 2; size /= 2) {
        float *sx = size == QK ? pr->sx32 : pr->sx16;
        for (int64_t t = t0; sx && t < t1; t++)
            for (int64_t u = 0; u < n_in / size; u++) {
                const float *xb = x + t * n_in + u * size;
                float s = 0;
                for (int j = 0; j < size; j++)
                    s += xb[j];
                sx[u * ss + t] = s;
            }
    }
    for (int64_t t = t0; pr->xq && t < t1; t++) {
        int16_t *xq = pr->xq + t * n_in;
        quantize_q16(x + t * n_in, ns, xq, pr->dx + t, ss);
        for (int64_t u = 0; u < 2 * ns; u++) {
            int32_t sum = 0;
            for (int j = 0; j < QK / 2; j++)
                sum += xq[u * (QK / 2) + j];
            pr->xsum[u * ss + t] = sum;
        }
        /* Pair k (elements 2k, 2k + 1) of sub-block s of row 16g + l at xt[((g * ns + s) * 16 + k) * 16 + l]. */
        const int64_t g = t / Q16_GROUP, l = t % Q16_GROUP;
        for (int64_t s = 0; pr->xt && s < ns; s++)
            for (int k = 0; k < QK / 2; k++)
                memcpy(&pr->xt[((g * ns + s) * (QK / 2) + k) * Q16_GROUP + l], xq + s * QK + 2 * k, sizeof(int32_t));
    }
}

/* A run's column tiles for a part of `tiles` tiles of `row_bytes` weight bytes per output: about RUN_BYTES of
 * weights (fewer hand-offs), yet at least RUNS_PER_THREAD runs per thread to share out; whole CHUNK_TILES. */
static int64_t run_tiles(int64_t row_bytes, int64_t tiles, int threads)
{
    int64_t chunk = RUN_BYTES / (row_bytes * COL_TILE);
    const int64_t most = tiles / ((int64_t)threads * RUNS_PER_THREAD);
    chunk = (chunk < most ? chunk : most) / CHUNK_TILES * CHUNK_TILES;
    return chunk > CHUNK_TILES ? chunk : CHUNK_TILES;
}

/* Run r of the product's parts: its outputs of its part, by the path `portable` picks. */
static void run_part(const struct product *p, const int64_t *runs_before, const int64_t *chunks, int64_t r,
                     int64_t rows, int portable)
{
    int64_t i = 0;
    while (r >= runs_before[i + 1])
        i++;
    const struct product *pp = &p[i];
    const int64_t o0 = (r - runs_before[i]) * chunks[i] * COL_TILE, o1e = o0 + chunks[i] * COL_TILE;
    const int64_t o1 = o1e < pp->n_out ? o1e : pp->n_out;
#if HAVE_AVX2
    if (portable != 1) {
        if (pp->q16)
            q16_range(pp, rows, o0, o1, portable != 2);
        else
            vector_range(pp, rows, o0, o1, portable != 2);
    } else
#endif
        scalar_range(pp, rows, o0, o1);
}

int quant_linear(const struct qlinear *l, const float *x, const float *other, float *out, int64_t rows, int op,
                 int threads, int portable, int int16)
{
    const int64_t n_in = l->n_in, ns = n_in / QK;
    if (l->n_parts < 1 || l->n_parts > QLINEAR_PARTS || rows < 0)
        return -1;
    int offsets16 = 0, offsets32 = 0, integer = 0;
    int64_t total = 0;
    for (int64_t i = 0; i < l->n_parts; i++) {
        const struct qpart *q = &l->parts[i];
        if (!type_known(q->type) || row_bytes((int)q->type, n_in) == 0 || q->n_out < 0)
            return -1;
        offsets16 |= has_offset((int)q->type) && split_scales((int)q->type);
        offsets32 |= has_offset((int)q->type) && !split_scales((int)q->type);
        integer |= !is_float_type((int)q->type);
        total += q->n_out;
    }
    if (total != l->n_out)
        return -1;
    const int q16 = int16 && integer && rows > 0;
    const int grouped = q16 && rows >= Q16_GROUP_MIN;
    /* The rows as the sums and scales lay them out: padded to a whole group in int16 mode. */
    const int64_t ss = q16 ? (rows + Q16_GROUP - 1) / Q16_GROUP * Q16_GROUP : rows;
    /* One zeroed allocation: the rows' sums per 32 and per 16 (where a part has offsets), the int16 rows'
     * scales, then their quants (row by row, and by group where `grouped`). */
    const size_t sx32_n = offsets32 ? (size_t)(ss * ns) : 0, sx16_n = offsets16 ? (size_t)(ss * 2 * ns) : 0;
    const size_t dx_n = q16 ? (size_t)(ss * ns) : 0, xq_n = q16 ? (size_t)(rows * n_in) : 0;
    const size_t xt_n = grouped ? (size_t)(ss * n_in / 2) : 0, xsum_n = q16 ? (size_t)(ss * 2 * ns) : 0;
    float *scratch = calloc(1, sizeof(float) * (sx32_n + sx16_n + dx_n) + sizeof(int32_t) * (xt_n + xsum_n) +
                                   sizeof(int16_t) * xq_n + 1);
    if (!scratch)
        return -2;
    float *sx32 = scratch, *sx16 = sx32 + sx32_n, *dx = sx16 + sx16_n;
    int32_t *xt = (int32_t *)(dx + dx_n), *xsum = xt + xt_n;
    int16_t *xq = (int16_t *)(xsum + xsum_n);
    const struct prepared pr = {sx32_n ? sx32 : NULL, sx16_n ? sx16 : NULL, dx, grouped ? xt : NULL, xsum,
                                q16 ? xq : NULL, ss};
    struct product p[QLINEAR_PARTS];
    int nt = threads < 1 ? 1 : threads;
    /* Runs of chunks[i] column tiles of part i: runs_before[i] is the runs of the parts before i. */
    int64_t runs_before[QLINEAR_PARTS + 1] = {0}, column = 0, chunks[QLINEAR_PARTS];
    for (int64_t i = 0; i < l->n_parts; i++) {
        const struct qpart *q = &l->parts[i];
        const int type = (int)q->type;
        p[i] = (struct product){.type = type, .w = q->w, .row_bytes = (size_t)row_bytes(type, n_in), .ns = ns,
                                .n_in = n_in, .n_out = q->n_out, .rows = rows, .x = x,
                                .sx = split_scales(type) ? sx16 : sx32, .ss = ss,
                                .bias = q->bias, .other = other ? other + column : NULL, .out = out + column,
                                .out_stride = l->n_out, .op = op, .q16 = q16 && !is_float_type(type),
                                .xq = xq, .xt = grouped ? xt : NULL, .dx = dx, .xsum = xsum};
        const int64_t tiles = (q->n_out + COL_TILE - 1) / COL_TILE;
        chunks[i] = run_tiles((int64_t)p[i].row_bytes, tiles, nt);
        runs_before[i + 1] = runs_before[i] + (tiles + chunks[i] - 1) / chunks[i];
        column += q->n_out;
    }
    /* Each thread starts on a contiguous share of the runs and takes them in order, so it streams its own
     * stretch of memory (threads alternating runs read at one thread's speed); a thread done with its share
     * takes the runs left in the others' (a thread the OS preempts, the server's event loop sharing the
     * cores, then delays the product by one run, not by its share: one fixed share per thread made one
     * served stream 3x slower). Each output is still summed by one thread in one order: the same bits. */
    const int64_t runs = runs_before[l->n_parts];
    if (nt > runs)
        nt = runs < 1 ? 1 : (int)runs;
    int64_t next[MAX_THREADS];
    if (nt > MAX_THREADS)
        nt = MAX_THREADS;
    for (int t = 0; t < nt; t++)
        next[t] = runs * t / nt;
    /* The rows' forms first, by whole groups of rows among the threads (each row's its own), then the runs. */
    const int64_t groups = (rows + Q16_GROUP - 1) / Q16_GROUP;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            prepare_rows(x, n_in, g * Q16_GROUP, g * Q16_GROUP + Q16_GROUP < rows ? g * Q16_GROUP + Q16_GROUP : rows,
                         &pr);
        const int me = omp_get_thread_num();
        for (int k = 0; k < nt; k++) {
            const int owner = (me + k) % nt;
            const int64_t end = runs * (owner + 1) / nt;
            for (int64_t r; (r = __atomic_fetch_add(&next[owner], 1, __ATOMIC_RELAXED)) < end;)
                run_part(p, runs_before, chunks, r, rows, portable);
        }
    }
    free(scratch);
    return 0;
}

int dequantize_rows(int type, const uint8_t *w, int64_t n_rows, int64_t n_in, const int64_t *index, int64_t n,
                    float *out, int threads)
{
    if (!type_known(type) || row_bytes(type, n_in) == 0 || n < 0)
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= n_rows)
            return -1;
    const size_t rb = (size_t)row_bytes(type, n_in);
    int nt = threads < 1 ? 1 : threads;
    if (nt > n)
        nt = n < 1 ? 1 : (int)n;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < n; i++)
        dequantize_row(type, w + (size_t)index[i] * rb, n_in, out + i * n_in);
    return 0;
}
