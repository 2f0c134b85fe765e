/* gelu with the tanh approximation, one element in plain C: the portable reference, whose operations
 * arch/x86/activation.h repeats lane by lane, in the same order with the same fused multiply-adds, so
 * that every path gives the same bits.
 *
 * 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3): one exp and one
 * correctly rounded division, and no cancellation in 1 + tanh(u) for negative x. t = -2u = x (C1 + C3 x^2);
 * exp(t) = 2^n exp(r), n = t / ln 2 rounded to nearest (the 1.5 * 2^23 trick), r = t - n ln 2 in two fused
 * steps (|r| <= ln 2 / 2), exp(r) a degree-6 polynomial fitted to it (relative error 4e-9), 2^n built in
 * the exponent bits. t is clamped to [T_MIN, T_MAX] first (a NaN clamps too: x carries it through the
 * division): n = -127 makes 2^n zero (x / 1 = x, as tanh saturates), n = 128 makes it infinite (x / inf
 * = +-0, as torch's 1 + tanh(u) = 0; -inf / inf = NaN, as torch's gelu(-inf)). The clamps are written as
 * the vector min and max compare (a < b ? a : b), so a NaN takes the same branch on every path.
 */
#ifndef KVSERVE_ACTIVATION_H
#define KVSERVE_ACTIVATION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* -2 sqrt(2 / pi) and -2 sqrt(2 / pi) 0.044715, rounded to float. */
#define GELU_C1 (-0x1.988454p+0f)
#define GELU_C3 (-0x1.2444f2p-4f)
#define GELU_T_MIN (-88.0f)
#define GELU_T_MAX (89.0f)
#define GELU_LOG2E 0x1.715476p+0f
#define GELU_ROUND 0x1.8p+23f
#define GELU_LN2_HI 0x1.62e430p-1f
#define GELU_LN2_LO (-0x1.05c610p-29f)
/* exp(r) = 1 + r + r^2 (P2 + r (P3 + r (P4 + r (P5 + r P6)))) on |r| <= ln 2 / 2. */
#define GELU_P2 0x1.fffffcp-2f
#define GELU_P3 0x1.555492p-3f
#define GELU_P4 0x1.5558f2p-5f
#define GELU_P5 0x1.1239e2p-7f
#define GELU_P6 0x1.6a2434p-10f

static inline float gelu_tanh_one(float x)
{
    float t = x * fmaf(GELU_C3, x * x, GELU_C1);
    t = t < GELU_T_MAX ? t : GELU_T_MAX;
    t = t > GELU_T_MIN ? t : GELU_T_MIN;
    const float k = fmaf(t, GELU_LOG2E, GELU_ROUND), n = k - GELU_ROUND;
    float r = fmaf(-n, GELU_LN2_HI, t);
    r = fmaf(-n, GELU_LN2_LO, r);
    float p = fmaf(GELU_P6, r, GELU_P5);
    p = fmaf(p, r, GELU_P4);
    p = fmaf(p, r, GELU_P3);
    p = fmaf(p, r, GELU_P2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    /* k's bits are those of 1.5 * 2^23 plus n: shifted into the exponent, only n + 127 stays. */
    uint32_t bits;
    memcpy(&bits, &k, sizeof bits);
    bits = (bits + 127u) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x / (1.0f + p * scale);
}

#endif
