// The portable path of block_matmul: plain C++, no intrinsics, the same arithmetic per output
// element as the AVX2 path (exact integer dot per block, then the block's float scales, one
// float accumulator), written for clarity rather than speed. Used on CPUs without AVX2 and
// tested on every machine (set_cpu_path("portable")) against the same reference.
//
// Every kernel: rows [r0, r1) of one weight (row_bytes apart) against tokens t0..t0+TT-1,
// writing y[t * ldy + r]. Each block is decoded once per tile of TT tokens.
#pragma once

#include "block_formats.h"

namespace ember_blocks::portable {

// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0. The stored quants are unsigned (Q8_0: signed); the offset of
// Q4_0/Q5_0 (8/16) is taken off via the block's sum of x (dot(q - o, x) = dot(q, x) - o*sum x),
// the min of Q4_1/Q5_1 is m * (d_x * sum x).
template <int TYPE>
struct Small {
    static constexpr int TILE = 4;  // tokens per tile (block_matmul.cpp)
    static constexpr int OFFSET = TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : 0;
    static constexpr bool HAS_MIN = TYPE == Q4_1 || TYPE == Q5_1;

    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int bytes = TYPES[type_index(TYPE)].bytes;
        const int64_t K = a.K, nb = K / 32;
        int32_t q[32];
        for (int64_t r = r0; r < r1; ++r) {
            float acc[TT] = {};
            for (int64_t b = 0; b < nb; ++b) {
                float d, m;
                decode32(TYPE, w + r * row_bytes + b * bytes, q, d, m);
                for (int t = 0; t < TT; ++t) {
                    const int64_t xb = (t0 + t) * nb + b;
                    const int8_t* xq = a.q32 + xb * 32;
                    int32_t p = 0;
                    for (int i = 0; i < 32; ++i) p += q[i] * xq[i];
                    p -= OFFSET * a.s32[xb];
                    acc[t] = std::fma(float(p), d * a.d32[xb], acc[t]);
                    if (HAS_MIN) acc[t] = std::fma(m, a.ds32[xb], acc[t]);
                }
            }
            for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
};

// Q4_K/Q5_K: per 256 values isum = sum_j sc_j * dot_j and msum = sum_j mn_j * sum32_j (int32),
// then acc += isum * (d * d_x), acc -= msum * (dmin * d_x) (two fmas). Q6_K: isum = sum_j sc_j *
// (dot_j - 32 * sum16_j), then acc += isum * (d * d_x). The AVX2 kernels do the very same.
template <int TYPE>
struct KQuant {
    static constexpr int TILE = 4;
    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int bytes = TYPES[type_index(TYPE)].bytes;
        const int64_t K = a.K, nb = K / 256;
        int32_t q[256], sc[16], mn[8];
        for (int64_t r = r0; r < r1; ++r) {
            float acc[TT] = {};
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = w + r * row_bytes + b * bytes;
                decode_k(TYPE, blk, q, sc, mn);
                for (int t = 0; t < TT; ++t) {
                    const int64_t tok = t0 + t;
                    const int8_t* xq = a.qk + tok * K + b * 256;
                    const float dx = a.dk[tok * nb + b];
                    if (TYPE == Q6_K) {
                        const int16_t* s16 = a.sk16 + tok * (K / 16) + b * 16;
                        int32_t isum = 0;
                        for (int j = 0; j < 16; ++j) {
                            int32_t p = 0;
                            for (int l = 0; l < 16; ++l) p += q[16 * j + l] * xq[16 * j + l];
                            isum += sc[j] * (p - 32 * s16[j]);
                        }
                        acc[t] = std::fma(float(isum), fp16(blk + 208) * dx, acc[t]);
                    } else {
                        const int16_t* s32 = a.sk32 + tok * (K / 32) + b * 8;
                        int32_t isum = 0, msum = 0;
                        for (int j = 0; j < 8; ++j) {
                            int32_t p = 0;
                            for (int l = 0; l < 32; ++l) p += q[32 * j + l] * xq[32 * j + l];
                            isum += sc[j] * p;
                            msum += mn[j] * s32[j];
                        }
                        acc[t] = std::fma(float(isum), fp16(blk) * dx, acc[t]);
                        acc[t] = std::fma(float(-msum), fp16(blk + 2) * dx, acc[t]);
                    }
                }
            }
            for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
};

// F32/F16/BF16: one fma per value, in order.
template <int TYPE>
struct Float {
    static constexpr int TILE = 4;
    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int64_t K = a.K;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            float acc[TT] = {};
            for (int64_t k = 0; k < K; ++k) {
                const float v = float_value(TYPE, row, k);
                for (int t = 0; t < TT; ++t) acc[t] = std::fma(v, a.xf[(t0 + t) * K + k], acc[t]);
            }
            for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
};

}  // namespace ember_blocks::portable
