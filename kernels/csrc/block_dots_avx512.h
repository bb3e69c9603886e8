// The AVX-512 path of block_matmul (AVX-512 F/BW/VL and VNNI): the AVX2 row kernels with their
// integer dot products done by vpdpbusd (u8 x s8, four products summed into each int32 lane)
// and the sub-block scales applied by vpdpwssd, in place of the vpmaddubsw / vphaddw /
// vpmaddwd chains. Same interface as block_dots_avx2.h; weight blocks are unpacked by the same
// code (avx2::Small::unpack, avx2::KQuant::unpack).
//
// 256-bit vectors: vpdpbusd issues at the same rate per byte on 256 and 512 bits on the CPUs
// here (AMD Zen 4 runs 512-bit ops as two halves; Intel's server cores have one 512-bit VNNI
// port and two 256-bit ones), so the row kernels keep the AVX2 layouts. The prefill kernel,
// which puts 16 tokens in the lanes, is 512-bit (block_gemm_avx512.h).
//
// Every block's integer sum is exact and equals the AVX2 path's, and the float steps after it
// are the same instructions in the same order, so this path gives the AVX2 path's bits for
// every type (the tests check it), and stays batch-invariant as that one is.
//
// int16 bounds for vpdpwssd, which reads each int32 lane of a vpdpbusd result as 16 bits:
// four products of |x| <= 127 are at most 4*15*127 = 7620 (Q4_K), 4*31*127 = 15748 (Q5_K) and
// 4*63*127 = 32004 (Q6_K), so vpackssdw of two such results is exact.
#pragma once

#include <immintrin.h>

#include "block_dots_avx2.h"

namespace ember_blocks::avx512 {

using avx2::half;
using avx2::hsum;
using avx2::hsum_i32;
using avx2::load;
using avx2::load128;
using avx2::prefetch;

inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }

// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 in pair layout (see block_dots_avx2.h): per pair of blocks two
// vpdpbusd leave [A's 4 partial sums | B's 4] in int32, two vphaddd rounds the 8 blocks'
// sums in the scalars' order. Quants as stored, unsigned: 4/5-bit ones are; Q8_0's are made so
// by adding 128 (xor 0x80), and 128 times x's block sums come off, as 8 or 16 times them for
// Q4_0/Q5_0's offsets. No int16 stage, so 5-bit quants need no centring.
template <int TYPE>
struct Small {
    using Base = avx2::Small<TYPE>;
    static constexpr int BYTES = Base::BYTES, TILE = Base::TILE;
    static constexpr bool HAS_MIN = Base::HAS_MIN;
    static constexpr int OFFSET_SHIFT = TYPE == Q8_0 ? 7 : Base::OFFSET_SHIFT;

    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 32, ng = nb / 8;
        const __m256i zero = _mm256_setzero_si256(), flip = _mm256_set1_epi8(-128);
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            __m256 acc[TT];
            float tail[TT];
            for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps(), tail[t] = 0.f;
            for (int64_t g = 0; g < ng; ++g) {
                const uint8_t* blk = row + g * 8 * BYTES;
                prefetch(blk, 8 * BYTES);
                __m256i lo[4], hi[4], slo[4], shi[4];
                __m256 dw, mw;
                Base::unpack(blk, dw, mw, lo, hi, slo, shi);
                if constexpr (TYPE == Q8_0)
                    for (int p = 0; p < 4; ++p)
                        lo[p] = _mm256_xor_si256(slo[p], flip), hi[p] = _mm256_xor_si256(shi[p], flip);
                for (int t = 0; t < TT; ++t) {
                    const int64_t xb = (t0 + t) * nb + g * 8;
                    const int8_t* xq = a.q32 + xb * 32;
                    __m256i u[4];
                    for (int p = 0; p < 4; ++p)
                        u[p] = dot4(dot4(zero, lo[p], load(xq + 64 * p)), hi[p], load(xq + 64 * p + 32));
                    __m256i i8 = _mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3]));
                    if constexpr (OFFSET_SHIFT > 0)
                        i8 = _mm256_sub_epi32(i8, _mm256_slli_epi32(load(a.s32 + xb), OFFSET_SHIFT));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i8),
                                             _mm256_mul_ps(dw, _mm256_loadu_ps(a.d32 + xb)), acc[t]);
                    if (HAS_MIN) acc[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a.ds32 + xb), acc[t]);
                }
            }
            for (int64_t b = ng * 8; b < nb; ++b) {  // trailing blocks, natural layout
                const uint8_t* blk = row + b * BYTES;
                __m256i q = avx2::unpack_one<TYPE, Base::QS>(blk);
                if constexpr (TYPE == Q8_0) q = _mm256_xor_si256(q, flip);
                const float d = half(blk), m = HAS_MIN ? half(blk + 2) : 0.f;
                for (int t = 0; t < TT; ++t) {
                    const int64_t xb = (t0 + t) * nb + b;
                    int32_t p = hsum_i32(dot4(zero, q, load(a.q32 + xb * 32)));
                    if constexpr (OFFSET_SHIFT > 0) p -= (1 << OFFSET_SHIFT) * a.s32[xb];
                    tail[t] = std::fma(float(p), d * a.d32[xb], tail[t]);
                    if (HAS_MIN) tail[t] = std::fma(m, a.ds32[xb], tail[t]);
                }
            }
            for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = hsum(acc[t]) + tail[t];
        }
    }
};

// Q4_K/Q5_K/Q6_K, one 256-value block at a time. vpdpbusd of each 32-value vector of quants
// against x gives 8 int32 lanes of 4 products; two such vectors packed to int16 and one
// vpdpwssd against their scales add sc * (pair of lanes) into the block's sum. Lane order after
// vpackssdw of vectors i, i+1: [i 0-3, i+1 0-3 | i 4-7, i+1 4-7]; for Q4_K/Q5_K each vector is
// one 32-value sub-block, for Q6_K two 16-value ones (lanes 0-3 and 4-7), which gives
// avx2::KQuant's own Q6_K scale layout. Then the AVX2 path's own float step (avx2::KQuant::step).
template <int TYPE, bool GROUPED = false>  // GROUPED: the weight in row groups (block_at)
struct KQuant {
    using Base = avx2::KQuant<TYPE>;
    static constexpr int BYTES = Base::BYTES, TILE = Base::TILE;

    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int64_t nb = a.K / 256;
        if constexpr (GROUPED) {
            // a group's blocks in the order they lie (block b of its 16 rows, then b + 1): one
            // stream, each row's sums apart and in the same order as below
            for (int64_t g = r0; g < r1; g += LANE_ROWS) {
                float acc[LANE_ROWS][TT] = {};
                for (int64_t b = 0; b < nb; ++b)
                    for (int i = 0; i < LANE_ROWS; ++i)
                        block<TT>(a, block_at<true, BYTES>(w, row_bytes, g + i, b), t0, b, acc[i]);
                for (int i = 0; i < LANE_ROWS; ++i)
                    for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + g + i] = acc[i][t];
            }
        } else {
            for (int64_t r = r0; r < r1; ++r) {
                float acc[TT] = {};
                for (int64_t b = 0; b < nb; ++b) block<TT>(a, block_at<false, BYTES>(w, row_bytes, r, b), t0, b, acc);
                for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = acc[t];
            }
        }
    }

    // Block b of one row (at blk) against tokens t0..t0+TT-1, into their accumulators.
    template <int TT>
    static inline __attribute__((always_inline)) void block(const XQuant& a, const uint8_t* blk, int64_t t0,
                                                            int64_t b, float* acc) {
        const int64_t K = a.K;
        const __m256i zero = _mm256_setzero_si256();
        prefetch(blk, BYTES);
        __m256i q[8], sc[4], sc16;
        __m128i mn;
        float d, dmin;
        Base::unpack(blk, q, sc, sc16, mn, d, dmin);
        __m256i pair_sc[4];  // int16 scales of the packed lanes of vectors 2c, 2c+1
        if constexpr (TYPE == Q6_K) {
            for (int c = 0; c < 4; ++c) pair_sc[c] = sc[c];
        } else {  // [sc_2c x4, sc_2c+1 x4 | the same]
            const __m256i s = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16));
            for (int c = 0; c < 4; ++c) {
                const char lo = char(4 * c), hi = char(4 * c + 2);
                pair_sc[c] = _mm256_shuffle_epi8(s, _mm256_setr_epi8(
                    lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                    lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1));
            }
        }
        for (int t = 0; t < TT; ++t) {
            const int64_t tok = t0 + t;
            const int8_t* xq = a.qk + tok * K + b * 256;
            __m256i isum = zero;
            for (int c = 0; c < 4; ++c) {
                const __m256i p0 = dot4(zero, q[2 * c], load(xq + 64 * c));
                const __m256i p1 = dot4(zero, q[2 * c + 1], load(xq + 64 * c + 32));
                isum = _mm256_dpwssd_epi32(isum, _mm256_packs_epi32(p0, p1), pair_sc[c]);
            }
            acc[t] = Base::step(a, isum, sc16, mn, d, dmin, tok, b, acc[t]);
        }
    }
};

}  // namespace ember_blocks::avx512
