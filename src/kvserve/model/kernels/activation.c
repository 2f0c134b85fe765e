/* The gated MLP's gelu (gelu_tanh_rows): activation.h's function over a buffer, by the widest vector path
 * the build has (arch/x86/activation.h) or, where `portable` asks, by the portable one; every path and
 * every split among threads gives each element the same bits. */
#include <stdint.h>

#include "activation.h"
#include "arch/x86/activation.h"
#include "common.h"
#include "kvserve.h"

/* Elements per thread's turn: a multiple of every vector width. */
#define GELU_CHUNK 4096

static void gelu_range(const float *x, float *out, int64_t i, int64_t end, int portable)
{
#if HAVE_AVX512
    if (portable == 0)
        for (; i + 16 <= end; i += 16)
            _mm512_storeu_ps(out + i, gelu_tanh16(_mm512_loadu_ps(x + i)));
#endif
#if HAVE_AVX2
    if (portable != 1)
        for (; i + 8 <= end; i += 8)
            _mm256_storeu_ps(out + i, gelu_tanh8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < end; i++)
        out[i] = gelu_tanh_one(x[i]);
}

void gelu_tanh_rows(const float *x, float *out, int64_t n, int threads, int portable)
{
    const int64_t chunks = (n + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * GELU_CHUNK < n ? (c + 1) * GELU_CHUNK : n;
        gelu_range(x, out, c * GELU_CHUNK, end, portable);
    }
}
