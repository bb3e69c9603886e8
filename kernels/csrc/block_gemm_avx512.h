// Prefill on AVX-512 VNNI: 16 rows of x at a time, token i in int32 lane i. KGemm for
// Q4_K/Q5_K/Q6_K below 48 tokens (from there weight rows in lanes pay: LaneGemm,
// block_gemm_lanes_avx512.h), SGemm (at the end) for the 32-value types Q4_0/Q4_1/Q5_0/Q5_1/
// Q8_0.
//
// As block_gemm_avx2.h, x is laid out token by token (XQuant::qq: for each run of 4 values, the
// 16 tokens' 4 bytes side by side, one 64-byte vector), and each run of 4 weight values is
// broadcast to every lane (vpshufd of 16 unpacked values held in all four 128-bit lanes), so one
// vpdpbusd does 4 values for 16 tokens: 64 multiply-adds, against 32 for the AVX2 kernel's
// vpshufb + vpmaddubsw + vpaddw. A sub-block's sums stay in int32 (no bound to watch), and its
// scale is one vpmulld.
//
// Exactly the row kernels' arithmetic per output (the block's int32 sum and min sum, then
// acc += isum * (d * d_x) and acc -= msum * (dmin * d_x)), so a token's bits do not depend on
// which kernel computed it (batch invariance) nor on the CPU path.
#pragma once

#include <immintrin.h>

#include "block_dots_avx512.h"
#include "prefetch.h"

namespace ember_blocks::avx512 {

// 16 bytes in all four 128-bit lanes.
inline __m512i bcast16(const uint8_t* p) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Weight values 16u..16u+15 of sub-block j of a block, unpacked and held in each 128-bit lane
// (Q4_K/Q5_K: 32-value sub-blocks, u = 0, 1; Q6_K: 16-value ones, u = 0).
template <int TYPE>
inline __m512i sub_values(const uint8_t* blk, int j, int u) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if constexpr (TYPE == Q6_K) {
        // sub-block j = 8h + 2k + e: low 4 bits from ql[64h + 32(k%2) + 16e + l] (nibble
        // k/2), high 2 from qh[32h + 16e + l] (bits 2k)
        const int h = j / 8, k = (j / 2) % 4, e = j % 2;
        const __m512i ql = bcast16(blk + 64 * h + 32 * (k % 2) + 16 * e);
        const __m512i qh = bcast16(blk + 128 + 32 * h + 16 * e);
        return _mm512_or_si512(
            _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k / 2))), m4),
            _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)),
                                               _mm512_set1_epi8(3)), 4));
    } else {
        const uint8_t* qs = blk + (TYPE == Q4_K ? 16 : 48);
        __m512i v = _mm512_and_si512(
            _mm512_srl_epi16(bcast16(qs + 32 * (j / 2) + 16 * u), _mm_cvtsi32_si128(4 * (j % 2))), m4);
        if constexpr (TYPE == Q5_K) {  // the 5th bit of value l is bit j of qh[l]
            const __m512i qh = bcast16(blk + 16 + 16 * u);
            v = _mm512_or_si512(v, _mm512_and_si512(
                _mm512_slli_epi16(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(j)), 4), _mm512_set1_epi8(0x10)));
        }
        return v;
    }
}

// Run i (0..3) of 4 values of v in every int32 lane.
inline __m512i run_of(__m512i v, int i) {
    switch (i) {
        case 0: return _mm512_shuffle_epi32(v, _MM_PERM_AAAA);
        case 1: return _mm512_shuffle_epi32(v, _MM_PERM_BBBB);
        case 2: return _mm512_shuffle_epi32(v, _MM_PERM_CCCC);
        default: return _mm512_shuffle_epi32(v, _MM_PERM_DDDD);
    }
}

// The prefill drivers' loops, shared by KGemm and SGemm: rows [r0, r1) against tiles g0..g1-1
// of 16 tokens (tile g: tokens 16g..16g+15), Kernel::G tiles and Kernel::R rows per pass where
// they are whole, then one at a time (Kernel::some<rows, tiles>).
template <class Kernel, int NG>
void gemm_tiles(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                int64_t g, float* y, int64_t ldy) {
    constexpr int R = Kernel::R;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        // row groups: R rows at a time read a group R blocks in 16, so the whole group is
        // asked for at once (into L2) rather than met as 16 / R strided passes
        if constexpr (Kernel::IN_GROUPS)
            if (r % LANE_ROWS == 0) ember_prefetch::lines_l2(w + r * row_bytes, LANE_ROWS * row_bytes);
        Kernel::template some<R, NG>(a, w, row_bytes, r, g, y, ldy);
    }
    for (; r < r1; ++r) Kernel::template some<1, NG>(a, w, row_bytes, r, g, y, ldy);
}

template <class Kernel>
void gemm_rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
               int64_t g0, int64_t g1, float* y, int64_t ldy) {
    constexpr int G = Kernel::G;
    int64_t g = g0;
    for (; g + G <= g1; g += G) gemm_tiles<Kernel, G>(a, w, row_bytes, r0, r1, g, y, ldy);
    for (; g < g1; ++g) gemm_tiles<Kernel, 1>(a, w, row_bytes, r0, r1, g, y, ldy);
}

template <int TYPE, bool GROUPED = false>  // GROUPED: the weight in row groups (block_at)
struct KGemm {
    static constexpr int BYTES = TYPE == Q4_K ? 144 : TYPE == Q5_K ? 176 : 210;
    static constexpr bool IN_GROUPS = GROUPED;
    // Weight rows per pass, and tiles of 16 tokens per pass: each 64-byte vector of x is
    // loaded once for R rows, and each row's unpacked values (and their vpshufd runs) serve
    // G tiles. One tile per pass spent about as many shuffle and unpack ops as vpdpbusds;
    // two halve that (R = 2, G = 2 keeps 2 * 2 accumulators, sums and chains in registers).
    // With one row per pass, x (16 tokens x 256 bytes per block, against the row's 144-210)
    // came from L2 for every row and bounded the kernel.
    static constexpr int R = 2, G = 2;

    // Rows r..r+N-1 against tiles g..g+NG-1.
    template <int N, int NG>
    static void some(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r, int64_t g,
                     float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 256;
        const int8_t* xg[NG];   // (K/4, 16 tokens, 4)
        const float* dg[NG];    // (K/256, 16)
        const int16_t* mg[NG];  // (K/64, 16, 2)
        const int32_t* sg[NG];  // (K/16, 16)
        for (int t = 0; t < NG; ++t) {
            xg[t] = a.qq + (g + t) * K * 16, dg[t] = a.dq + (g + t) * nb * 16;
            mg[t] = a.m32q + (g + t) * (K / 64) * 32, sg[t] = a.s16q + (g + t) * (K / 16) * 16;
        }
        constexpr int SUBS = TYPE == Q6_K ? 16 : 8, HALVES = TYPE == Q6_K ? 1 : 2;
        __m512 acc[N][NG];
        for (int n = 0; n < N; ++n)
            for (int t = 0; t < NG; ++t) acc[n][t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk[N];
            float d[N], dmin[N] = {};
            alignas(16) uint8_t sm[N][16];
            __m512i isum[N][NG];
            for (int n = 0; n < N; ++n) {
                blk[n] = block_at<GROUPED, BYTES>(w, row_bytes, r + n, b);
                if constexpr (GROUPED) {  // this row's next block, 16 blocks on (the group is in L2)
                    for (int o = 0; o < BYTES; o += 64)
                        _mm_prefetch(reinterpret_cast<const char*>(blk[n] + LANE_ROWS * BYTES + o), _MM_HINT_T0);
                } else {
                    prefetch(blk[n], BYTES);
                }
                for (int t = 0; t < NG; ++t) isum[n][t] = _mm512_setzero_si512();
                if constexpr (TYPE == Q6_K) {
                    d[n] = half(blk[n] + 208);
                } else {
                    d[n] = half(blk[n]), dmin[n] = half(blk[n] + 2);
                    k_scales(blk[n] + 4, sm[n]);
                }
            }
            for (int j = 0; j < SUBS; ++j) {
                // two chains per row and tile: vpdpbusd's latency, not its throughput, bounds one
                __m512i s0[N][NG], s1[N][NG];
                for (int n = 0; n < N; ++n)
                    for (int t = 0; t < NG; ++t) s0[n][t] = s1[n][t] = _mm512_setzero_si512();
                for (int u = 0; u < HALVES; ++u) {
                    __m512i v[N];
                    for (int n = 0; n < N; ++n) v[n] = sub_values<TYPE>(blk[n], j, u);
                    // 64 runs of 4 values x 64 bytes per block
                    const int64_t xoff = b * 256 * 16 + (HALVES * 4 * j + 4 * u) * 64;
                    for (int i = 0; i < 4; ++i) {
                        __m512i xv[NG];
                        for (int t = 0; t < NG; ++t) xv[t] = _mm512_loadu_si512(xg[t] + xoff + 64 * i);
                        for (int n = 0; n < N; ++n) {
                            const __m512i run = run_of(v[n], i);
                            for (int t = 0; t < NG; ++t) {
                                __m512i& sn = i % 2 ? s1[n][t] : s0[n][t];
                                sn = _mm512_dpbusd_epi32(sn, run, xv[t]);
                            }
                        }
                    }
                }
                for (int t = 0; t < NG; ++t) {
                    __m512i off = _mm512_setzero_si512();
                    if constexpr (TYPE == Q6_K)  // quants 0..63: 32 times x's sums come off
                        off = _mm512_slli_epi32(_mm512_loadu_si512(sg[t] + (b * 16 + j) * 16), 5);
                    for (int n = 0; n < N; ++n) {
                        const int scale = TYPE == Q6_K ? int(reinterpret_cast<const int8_t*>(blk[n] + 192)[j])
                                                       : int(sm[n][j]);
                        const __m512i sj = _mm512_sub_epi32(_mm512_add_epi32(s0[n][t], s1[n][t]), off);
                        isum[n][t] = _mm512_add_epi32(isum[n][t], _mm512_mullo_epi32(sj, _mm512_set1_epi32(scale)));
                    }
                }
            }
            for (int t = 0; t < NG; ++t) {
                const __m512 dx = _mm512_loadu_ps(dg[t] + b * 16);
                for (int n = 0; n < N; ++n) {
                    acc[n][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[n][t]), _mm512_mul_ps(_mm512_set1_ps(d[n]), dx), acc[n][t]);
                    if constexpr (TYPE != Q6_K) {
                        // min: per token m_2c * sum32_2c + m_2c+1 * sum32_2c+1, c = 0..3
                        __m512i ms = _mm512_setzero_si512();
                        for (int c = 0; c < 4; ++c) {
                            const __m512i mp = _mm512_set1_epi32(sm[n][8 + 2 * c] | sm[n][9 + 2 * c] << 16);
                            ms = _mm512_add_epi32(ms, _mm512_madd_epi16(_mm512_loadu_si512(mg[t] + (b * 4 + c) * 32), mp));
                        }
                        acc[n][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(_mm512_set1_ps(dmin[n]), dx), acc[n][t]);
                    }
                }
            }
        }
        for (int t = 0; t < NG; ++t)
            for (int n = 0; n < N; ++n) {
                alignas(64) float out[16];
                _mm512_store_ps(out, acc[n][t]);
                for (int i = 0; i < 16; ++i) y[(16 * (g + t) + i) * ldy + r + n] = out[i];
            }
    }
};

// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 against tiles of 16 tokens, x quantized per 32 values
// (XQuant::qq32, token i in lane i). Each block's 32 quants are unpacked once (unsigned, as the
// row kernels use them: Q8_0's plus 128), and each run of 4 is broadcast to every lane (one
// vpermd per run, shared by the tiles; a broadcast load from a stored copy stalled on store
// forwarding), so one vpdpbusd does 4 values for 16 tokens.
//
// Bits: the row kernel (block_dots_avx512.h Small) keeps, per token, one float accumulator per
// block position j = 0..7 of each group of 8 blocks (acc_j = fma(isum, d * d_x, acc_j), then
// fma(m, d_x * sum_x, acc_j) for the types with a min), folds them as hsum does,
// ((A0 + A1) + (A4 + A5)) + ((A2 + A3) + (A6 + A7)) in block positions, and adds the trailing
// blocks' scalar sum. Here the same eight accumulators hold 16 tokens each and fold the same
// way; a block's integer sum is exact in either order. So a token's bits do not depend on which
// kernel ran it (batch invariance).
template <int TYPE>
struct SGemm {
    static constexpr bool IN_GROUPS = false;
    using Base = avx2::Small<TYPE>;
    static constexpr int BYTES = Base::BYTES, QS = Base::QS;
    static constexpr int OFFSET_SHIFT = TYPE == Q8_0 ? 7 : Base::OFFSET_SHIFT;
    static constexpr bool HAS_MIN = Base::HAS_MIN;
    // Rows and tiles per pass: each load of x serves R rows (x's tiles come from L2), each
    // block's unpack and runs serve G tiles; 8 accumulators per row and tile, so R * G <= 2
    // (4 spilled: half the speed). Measured at 4096 x 4096, T = 128, 2 threads: R = 2 is
    // best for Q4_0/Q8_0 (165 GMAC/s, against 145 with G = 2), G = 2 for the 5-bit types,
    // whose unpack costs more (137 against 130).
    static constexpr bool FIVE_BIT = TYPE == Q5_0 || TYPE == Q5_1;
    static constexpr int R = FIVE_BIT ? 1 : 2, G = FIVE_BIT ? 2 : 1;

    // acc = fma(isum, d * d_x, acc), then for a min fma(m, d_x * sum_x, acc), per token.
    static __m512 step(const XQuant& a, const uint8_t* blk, int64_t gt, int64_t b, __m512i isum, __m512 acc) {
        const int64_t at = (gt * (a.K / 32) + b) * 16;
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                              _mm512_mul_ps(_mm512_set1_ps(half(blk)), _mm512_loadu_ps(a.d32q + at)), acc);
        if constexpr (HAS_MIN)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(half(blk + 2)), _mm512_loadu_ps(a.ds32q + at), acc);
        return acc;
    }

    // Rows r..r+N-1 against tiles g..g+NG-1.
    template <int N, int NG>
    static void some(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r, int64_t g,
                     float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 32, ng = nb / 8;
        __m512 acc[N][8][NG], tail[N][NG];
        for (int n = 0; n < N; ++n)
            for (int t = 0; t < NG; ++t) {
                tail[n][t] = _mm512_setzero_ps();
                for (int j = 0; j < 8; ++j) acc[n][j][t] = _mm512_setzero_ps();
            }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk[N];
            __m512i qz[N], s0[N][NG], s1[N][NG];
            for (int n = 0; n < N; ++n) {
                blk[n] = w + (r + n) * row_bytes + b * BYTES;
                if (b % 8 == 0) prefetch(blk[n], 8 * BYTES);
                __m256i q = avx2::unpack_one<TYPE, QS>(blk[n]);
                if constexpr (TYPE == Q8_0) q = _mm256_xor_si256(q, _mm256_set1_epi8(-128));
                qz[n] = _mm512_castsi256_si512(q);
                for (int t = 0; t < NG; ++t) s0[n][t] = s1[n][t] = _mm512_setzero_si512();
            }
            for (int i = 0; i < 8; ++i) {
                __m512i xv[NG];
                for (int t = 0; t < NG; ++t) xv[t] = _mm512_loadu_si512(a.qq32 + ((g + t) * (K / 4) + b * 8 + i) * 64);
                for (int n = 0; n < N; ++n) {
                    const __m512i run = _mm512_permutexvar_epi32(_mm512_set1_epi32(i), qz[n]);
                    for (int t = 0; t < NG; ++t) {
                        __m512i& sn = i % 2 ? s1[n][t] : s0[n][t];
                        sn = _mm512_dpbusd_epi32(sn, run, xv[t]);
                    }
                }
            }
            for (int t = 0; t < NG; ++t) {
                __m512i off = _mm512_setzero_si512();
                if constexpr (OFFSET_SHIFT > 0)
                    off = _mm512_slli_epi32(_mm512_loadu_si512(a.s32q + ((g + t) * nb + b) * 16), OFFSET_SHIFT);
                for (int n = 0; n < N; ++n) {
                    const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0[n][t], s1[n][t]), off);
                    __m512& into = b < ng * 8 ? acc[n][b % 8][t] : tail[n][t];
                    into = step(a, blk[n], g + t, b, isum, into);
                }
            }
        }
        for (int n = 0; n < N; ++n)
            for (int t = 0; t < NG; ++t) {
                const __m512(&A)[8][NG] = acc[n];
                const __m512 sum = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(A[0][t], A[1][t]), _mm512_add_ps(A[4][t], A[5][t])),
                    _mm512_add_ps(_mm512_add_ps(A[2][t], A[3][t]), _mm512_add_ps(A[6][t], A[7][t])));
                alignas(64) float out[16];
                _mm512_store_ps(out, _mm512_add_ps(sum, tail[n][t]));
                for (int i = 0; i < 16; ++i) y[(16 * (g + t) + i) * ldy + r + n] = out[i];
            }
    }
};

}  // namespace ember_blocks::avx512
