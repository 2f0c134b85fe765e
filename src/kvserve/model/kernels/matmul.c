/* The products' entry point: one call per product, its outputs split between OpenMP threads, each output
 * summed by one thread by the portable reference (quants.c) or the x86 tiles (arch/x86/quants.c). */
#include <stdint.h>
#include <stdlib.h>

#include "quants.h"

int quant_linear_vectorized(void) { return HAVE_AVX2; }

int quant_linear(int type, const uint8_t *w, const float *x, const float *bias, const float *other, float *out,
                 int64_t rows, int64_t n_in, int64_t n_out, int op, int threads, int portable, int64_t q16_rows)
{
    const int bb = block_bytes(type);
    if (bb == 0 || n_in % QK != 0 || q16_rows < 0 || q16_rows > rows)
        return -1;
    const int64_t nb = n_in / QK;
    /* One allocation: the rows' block sums of x (Q4_1, K8), then the int16 rows' scales and quants. */
    const size_t sx_n = has_offset(type) ? (size_t)(rows * nb) : 0;
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
    const struct product p = {.type = type, .w = w, .bb = (size_t)bb, .nb = nb, .n_in = n_in, .n_out = n_out,
                              .grouped = n_out / COL_TILE * COL_TILE, .rows = rows, .x = x, .sx = sx,
                              .bias = bias, .other = other, .out = out, .op = op, .q16_rows = q16_rows,
                              .xq = xq, .dx = dx};
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
