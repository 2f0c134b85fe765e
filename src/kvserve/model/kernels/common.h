/* What every kernel source shares: the instruction sets this build may use, and small inline helpers.
 *
 * The libraries are compiled with -march=native on the machine that runs them (native_build.py keys each
 * build by the CPU's feature flags), so these flags are the machine's own, chosen when it first loads
 * the kernels. Only instruction sets named here are used: AMX, which some Xeons report and then fault on,
 * never is. Every vector path has a portable twin that gives the same bits (products) or the same values
 * up to rounding (attention, built with -ffast-math).
 */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The vector paths: AVX2 with FMA and F16C. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* The products' wide tiles (arch/x86/quants.c) on top of the AVX2 path. */
#if HAVE_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* Byte permutes and byte masks (AVX-512 VBMI, BW and VL): the x86 tiles decode a sub-block's quants straight
 * into float vectors with them (arch/x86/decode.h); the same values as the AVX2 decoding. */
#if HAVE_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define HAVE_AVX512_VBMI 1
#else
#define HAVE_AVX512_VBMI 0
#endif

/* AVX-512 VNNI: the int16 tiles' products of pairs added into int32 in one instruction (vpdpwssd); without
 * it, a multiply-add of pairs then an addition, the same integers. */
#if HAVE_AVX512 && defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1
#else
#define HAVE_AVX512_VNNI 0
#endif

#if defined(__F16C__)
#define HAVE_F16C 1
#else
#define HAVE_F16C 0
#endif

/* The compiler's _Float16: the float16 KV cache is read and written through it. */
#if defined(__FLT16_MAX__)
#define HAVE_FLOAT16 1
#else
#define HAVE_FLOAT16 0
#endif

/* Functions that one library's sources share and Python never calls: not exported. */
#define INTERNAL __attribute__((visibility("hidden")))

/* Forces a helper with constant arguments into its caller, so that its loops over them unroll. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

static inline uint16_t read_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float read_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* float16 bits to float, exactly, in plain C (the vector paths' F16C conversion gives the same values). */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        /* Subnormal: normalize the mantissa. */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
