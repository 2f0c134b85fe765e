/* The gated MLP's activations over a buffer (gelu_tanh_rows, silu_rows): activation.h's functions by the
 * widest vector path the build has (arch/x86/activation.h) or, where `portable` asks, by the portable
 * one; every path and every split among threads gives each element the same bits. */
#include <stdint.h>

#include "activation.h"
#include "arch/x86/activation.h"
#include "common.h"
#include "kvserve.h"

/* Elements per thread's turn: a multiple of every vector width. */
#define CHUNK 4096

enum { GELU, SILU };

/* Inlined into each loop with `act` a constant. */
static ALWAYS_INLINE void act_range(int act, const float *x, float *out, int64_t i, int64_t end, int portable)
{
#if HAVE_AVX512
    if (portable == 0)
        for (; i + 16 <= end; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            _mm512_storeu_ps(out + i, act == GELU ? gelu_tanh16(v) : silu16(v));
        }
#endif
#if HAVE_AVX2
    if (portable != 1)
        for (; i + 8 <= end; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            _mm256_storeu_ps(out + i, act == GELU ? gelu_tanh8(v) : silu8(v));
        }
#endif
    for (; i < end; i++)
        out[i] = act == GELU ? gelu_tanh_one(x[i]) : silu_one(x[i]);
}

static ALWAYS_INLINE void act_rows(int act, const float *x, float *out, int64_t n, int threads, int portable)
{
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;
        act_range(act, x, out, c * CHUNK, end, portable);
    }
}

void gelu_tanh_rows(const float *x, float *out, int64_t n, int threads, int portable)
{
    act_rows(GELU, x, out, n, threads, portable);
}

void silu_rows(const float *x, float *out, int64_t n, int threads, int portable)
{
    act_rows(SILU, x, out, n, threads, portable);
}
