/* The gated MLP's activations, one element in plain C: the portable reference, whose operations
 * arch/x86/activation.h repeats lane by lane, in the same order with the same fused multiply-adds, so that
 * every path gives the same bits.
 *
 * Both are x / (1 + exp(t)): silu with t = -x; gelu(tanh) 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u =
 * sqrt(2 / pi) (x + 0.044715 x^3), so t = -2u = x (C1 + C3 x^2) (no cancellation in 1 + tanh(u) for
 * negative x). One exp and one correctly rounded division: exp(t) = 2^n exp(r), n = t / ln 2 rounded to
 * nearest (the 1.5 * 2^23 trick), r = t - n ln 2 in two fused steps (|r| <= ln 2 / 2), exp(r) a degree-6
 * polynomial fitted to it (relative error 4e-9), 2^n built in the exponent bits. t is clamped to
 * [EXP_T_MIN, EXP_T_MAX] first (a NaN clamps too: x carries it through the division): n = -127 makes 2^n
 * zero (x / 1 = x), n = 128 infinite (x / inf = +-0, as torch's 1 + tanh(u) = 0 or 1 + exp(-x) = inf; -inf
 * / inf = NaN, as torch's gelu(-inf) and silu(-inf)). The clamps are written as the vector min and max
 * compute them (a < b ? a : b, a > b ? a : b), so a NaN takes the same branch on every path. Over every
 * float, both are within 2 ulp of x of the exact value and 3 of torch's (test_activation_kernel.py).
 */
#ifndef KVSERVE_ACTIVATION_H
#define KVSERVE_ACTIVATION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* -2 sqrt(2 / pi) and -2 sqrt(2 / pi) 0.044715, rounded to float. */
#define GELU_C1 (-0x1.988454p+0f)
#define GELU_C3 (-0x1.2444f2p-4f)
#define EXP_T_MIN (-88.0f)
#define EXP_T_MAX (89.0f)
#define EXP_LOG2E 0x1.715476p+0f
#define EXP_ROUND 0x1.8p+23f
#define EXP_LN2_HI 0x1.62e430p-1f
#define EXP_LN2_LO (-0x1.05c610p-29f)
/* exp(r) = 1 + r + r^2 (P2 + r (P3 + r (P4 + r (P5 + r P6)))) on |r| <= ln 2 / 2. */
#define EXP_P2 0x1.fffffcp-2f
#define EXP_P3 0x1.555492p-3f
#define EXP_P4 0x1.5558f2p-5f
#define EXP_P5 0x1.1239e2p-7f
#define EXP_P6 0x1.6a2434p-10f

/* x / (1 + exp(t)). */
static inline float x_over_one_plus_exp(float x, float t)
{
    t = t < EXP_T_MAX ? t : EXP_T_MAX;
    t = t > EXP_T_MIN ? t : EXP_T_MIN;
    const float k = fmaf(t, EXP_LOG2E, EXP_ROUND), n = k - EXP_ROUND;
    float r = fmaf(-n, EXP_LN2_HI, t);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = fmaf(EXP_P6, r, EXP_P5);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P2);
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

static inline float gelu_tanh_one(float x) { return x_over_one_plus_exp(x, x * fmaf(GELU_C3, x * x, GELU_C1)); }

static inline float silu_one(float x) { return x_over_one_plus_exp(x, -x); }

#endif
