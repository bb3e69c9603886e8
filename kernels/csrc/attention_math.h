// The arithmetic every attention path computes (attention.cpp), written out in plain C++: the
// portable path runs it as is, and the vector paths (attention_simd.h) compute the very same
// operations in the same order, 8 or 16 lanes at a time. So a row gets the same bits on every
// path, alone or in any tile, on any number of threads.
//
// One query head against the keys of one chunk (attention.cpp: CHUNK positions, aligned):
//   score  s = tree16(lane sums) * scale, lane l summing q[d] * k[d] for d = l (mod 16) by one
//          fma chain in d order from 0 (a vector register's lanes), then a fixed tree
//          (l + 8, then + 4, + 2, + 1); softcap > 0: s = cap * tanh(s / cap)
//   m      max of the chunk's scores (exact in any order)
//   p      exp(s - m), one formula per value (exp_neg)
//   l      sum of p: lane l of a 16-lane accumulator takes the keys at positions = l (mod 16),
//          in position order from 0, then tree16
//   o      sum of p v per output value: one fma chain in position order from 0
// and the chunks folded in position order (merge): the running (M, L, O) and a chunk's
// (m, l, o): if m <= M, b = exp(m - M), L = fma(l, b, L), O = fma(o, b, O); else
// a = exp(M - m), L = fma(L, a, l), O = fma(O, a, o), M = m. At the end out = O * (1 / L).
//
// A bfloat16 pool (--kv-type bf16) computes what AVX512_BF16's dot-product instruction
// (vdpbf16ps) computes, so that CPUs with it run it natively and the rest give the same bits:
// q and p are rounded to bfloat16 (bf16_round) first, and a score lane l sums, 32 dims at a
// time in d order, q[2l+1] k[2l+1] and then q[2l] k[2l] of those 32 (one fma each: a product
// of two bfloat16 is exact in float, so the instruction's add of it is that fma). The float
// vector paths read a key as two 16-value halves per 32 dims, odd dims then even
// (bf16_key_dim); l sums the rounded p, and values are the fma chain above with them (the
// instruction's pairs of positions make the same chain: a pair's empty half weighs 0 and
// adds nothing). The instruction also flushes subnormal sums to zero where an fma keeps
// them: the two would part only for sums within 1.2e-38 of zero.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_formats.h"  // bf16: a bfloat16's value, as the weights' kernels read it

namespace ember_attention {

constexpr int LANES = 16;
// A Q8_0 block (KV pools, --kv-type q8_0): a float16 scale d, then 32 int8 q; value q * d,
// whether converted into a copy (from_int8) or in registers as it loads (Q8Row).
constexpr int Q8_VALUES = 32, Q8_BYTES = 34;

// A KV head's Q8_0 blocks in a pool row (only ever pointed to: the kernels read it in place).
struct Q8Row;

// The block holding value i of row r; a block's scale as float16 bits; its values from i.
inline const uint8_t* q8_block(const Q8Row* r, int64_t i) {
    return reinterpret_cast<const uint8_t*>(r) + i / Q8_VALUES * Q8_BYTES;
}
inline short q8_scale_bits(const uint8_t* block) {
    short bits;
    std::memcpy(&bits, block, 2);  // 34-byte blocks: not 2-byte aligned
    return bits;
}
inline const int8_t* q8_values(const uint8_t* block, int64_t i = 0) {
    return reinterpret_cast<const int8_t*>(block + 2 + i % Q8_VALUES);
}

// bfloat16 (--kv-type bf16): a float's upper 16 bits, rounded to nearest even. Subnormals
// become signed zeros: vdpbf16ps reads them as zero, so none may reach the kernels.
inline uint16_t bf16_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u & 0x80000000u) >> 16);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t bits) { return ember_blocks::bf16(reinterpret_cast<const uint8_t*>(&bits)); }
inline float bf16_round(float x) { return bf16_value(bf16_bits(x)); }

// A KV head's bfloat16 values in a pool row (only ever pointed to: read in place).
struct Bf16Row;
constexpr int BF16_PAIRS = 32;  // dims a vdpbf16ps register takes: 16 lanes of 2

// Value i of a key as the score lanes take it: dims in groups of 32, each as its odd dims
// (2l + 1, lane l), then its even ones (2l).
inline int64_t bf16_key_dim(int64_t i) {
    const int64_t g = i / BF16_PAIRS * BF16_PAIRS, j = i % BF16_PAIRS;
    return j < LANES ? g + 2 * j + 1 : g + 2 * (j - LANES);
}

// exp(x) for x <= 0 (scores shifted by their max): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a
// degree-7 polynomial (the classic single-precision minimax fit, ~1 ulp), times 2^n by
// adding n to the exponent bits. Below -87 (exp < 1.6e-38, past float's normal range) 0.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_C[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float EXP_MIN = -87.0f;

inline float exp_neg(float x) {
    if (!(x >= EXP_MIN)) return 0.f;  // also NaN -> 0: never from finite scores
    const float n = std::nearbyint(x * LOG2E);
    const float r = std::fma(n, -LN2_LO, std::fma(n, -LN2_HI, x));
    float p = EXP_C[0];
    for (int i = 1; i < 6; ++i) p = std::fma(p, r, EXP_C[i]);
    const float y = std::fma(p, r * r, r) + 1.f;
    int32_t bits;
    std::memcpy(&bits, &y, 4);
    bits += static_cast<int32_t>(n) << 23;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

// The fixed tree over 16 lane sums: distance 8, then 4, 2, 1.
inline float tree16(const float* a) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// q . k as above (any head dim: lanes past hd % 16 take one term fewer).
inline float dot(const float* q, const float* k, int64_t hd) {
    float a[LANES] = {};
    for (int64_t d = 0; d < hd; ++d) a[d % LANES] = std::fma(q[d], k[d], a[d % LANES]);
    return tree16(a);
}

inline float softcapped(float s, float cap) { return cap > 0.f ? cap * std::tanh(s / cap) : s; }

// How a chunk's partial joins the running one (see the top): the coefficient is b or a.
enum class Merge { FIRST, SCALE_CHUNK, SCALE_RUNNING };

struct Fold {
    Merge how;
    float coef;
};

// Joins a chunk's (m, l) to the running (M, L, started); says how its o joins O.
inline Fold fold(float m, float l, float& M, float& L, bool& started) {
    if (!started) {
        started = true;
        M = m, L = l;
        return {Merge::FIRST, 1.f};
    }
    if (m <= M) {
        const float b = exp_neg(m - M);
        L = std::fma(l, b, L);
        return {Merge::SCALE_CHUNK, b};
    }
    const float a = exp_neg(M - m);
    L = std::fma(L, a, l);
    M = m;
    return {Merge::SCALE_RUNNING, a};
}

// O (n values) joined with a chunk's o, as `f` says.
inline void merge_values(float* O, const float* o, int64_t n, Fold f) {
    switch (f.how) {
        case Merge::FIRST: std::memcpy(O, o, n * sizeof(float)); break;
        case Merge::SCALE_CHUNK: for (int64_t i = 0; i < n; ++i) O[i] = std::fma(o[i], f.coef, O[i]); break;
        case Merge::SCALE_RUNNING: for (int64_t i = 0; i < n; ++i) O[i] = std::fma(O[i], f.coef, o[i]); break;
    }
}

// The kernels' scores run a hook ahead of each tile of keys, given the tile's keys a..b-1
// (attention.cpp prefetches there); this one runs nothing.
struct NoHook {
    void operator()(int, int) const {}
};

}  // namespace ember_attention
