// A decoded token's scores and values over a bfloat16 pool (--kv-type bf16) with AVX512_BF16's
// dot products: vdpbf16ps multiplies 16 pairs of bfloat16 and adds both products to a float
// lane, twice the multiply-adds of a float fma and no conversion of the keys or values. It
// computes exactly the arithmetic attention_math.h writes out for a bfloat16 pool (the odd dim
// of a pair, then the even; products exact; round to nearest even), which SimdKernels<Avx512>
// computes with float fmas: the same bits either way (tests/test_attention.py compares them).
// Compiled for AVX512_BF16 here only, and run only where the CPU has it (attention.cpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_simd.h"

#ifdef EMBER_ATTENTION_AVX512
#pragma GCC push_options
#pragma GCC target("avx512bf16")

namespace ember_attention {

struct Avx512Bf16Dots : SimdKernels<Avx512> {
    using Base = SimdKernels<Avx512>;
    // the query pairs a call holds: reads_in_place gives at most 6 heads; head dims to 256
    static constexpr int MAX_HEADS = 6, MAX_GROUPS = 8;
    static constexpr int MAX_PAIRS = 32;  // a chunk's positions in pairs (attention.cpp checks)

    // As Base::scores; a bfloat16 row's keys go to the dot products (larger heads, which no
    // model here has, to the float path: the same bits).
    template <class E, class Hook = NoHook>
    static void scores(const float* const* q, int nq, const E* const* k, int x0, int x1, int64_t hd,
                       float scale, float* s, int lds, const Hook& before_tile = {}) {
        if constexpr (!std::is_same_v<E, Bf16Row>) {
            Base::scores(q, nq, k, x0, x1, hd, scale, s, lds, before_tile);
        } else {
            if (nq > MAX_HEADS || hd > MAX_GROUPS * BF16_PAIRS)
                return Base::scores(q, nq, k, x0, x1, hd, scale, s, lds, before_tile);
            const int groups = static_cast<int>(hd / BF16_PAIRS);
            __m512i qp[MAX_HEADS * MAX_GROUPS];
            for (int i = 0; i < nq; ++i)
                for (int g = 0; g < groups; ++g) qp[i * groups + g] = query_pairs(q[i] + g * BF16_PAIRS);
            switch (nq) {
                case 1: rows<1>(qp, groups, k, x0, x1, scale, s, lds, before_tile); break;
                case 2: rows<2>(qp, groups, k, x0, x1, scale, s, lds, before_tile); break;
                case 3: rows<3>(qp, groups, k, x0, x1, scale, s, lds, before_tile); break;
                case 4: rows<4>(qp, groups, k, x0, x1, scale, s, lds, before_tile); break;
                case 5: rows<5>(qp, groups, k, x0, x1, scale, s, lds, before_tile); break;
                default: rows<6>(qp, groups, k, x0, x1, scale, s, lds, before_tile); break;
            }
        }
    }

    // As Base::values; a bfloat16 row's values go to the dot products, two positions a time.
    template <class E>
    static void values(const float* const* p, int nh, const E* const* v, int a, int b, int64_t hd,
                       float* const* O, const Fold* f) {
        if constexpr (!std::is_same_v<E, Bf16Row>) {
            Base::values(p, nh, v, a, b, hd, O, f);
        } else {
            const int64_t block = hd % 64 == 0 ? 64 : BF16_PAIRS;
            for (int h = 0; h < nh; h += MAX_HEADS) {
                const int n = nh - h < MAX_HEADS ? nh - h : MAX_HEADS;
                alignas(64) uint32_t pairs[MAX_HEADS][MAX_PAIRS];
                for (int i = 0; i < n; ++i)
                    for (int x = a & ~31; x < b; x += 32) weight_pairs(p[h + i] + x, pairs[i] + x / 2);
                for (int64_t col = 0; col < hd; col += block) {
                    if (block == 64) value_heads<2>(pairs, n, v, a, b, col, O + h, f + h);
                    else value_heads<1>(pairs, n, v, a, b, col, O + h, f + h);
                }
            }
        }
    }

  private:
    // 32 dims of a query (bf16_round-ed, in the score lanes' order: 16 odd dims, 16 even) as
    // the 16 bfloat16 pairs they were: an odd dim's bits in a lane's upper half, an even's below.
    static EMBER_INLINE __m512i query_pairs(const float* q) {
        const __m512i odd = _mm512_castps_si512(_mm512_loadu_ps(q));
        const __m512i even = _mm512_castps_si512(_mm512_loadu_ps(q + LANES));
        return _mm512_or_si512(_mm512_and_si512(odd, _mm512_set1_epi32(static_cast<int>(0xffff0000u))),
                               _mm512_srli_epi32(even, 16));
    }

    // The weights of 32 positions as 16 pairs: position x in a lane's upper half (vdpbf16ps
    // adds it first), x + 1 below; bfloat16 already (exp_sum rounded them), so the packing is
    // exact. Outside the row's keys they are 0 (exp_sum's zeros) where a pair reads them.
    static EMBER_INLINE void weight_pairs(const float* p, uint32_t* out) {
        const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + LANES), _mm512_loadu_ps(p));
        _mm512_store_si512(out, _mm512_rol_epi32(packed, 16));  // (x + 1, x) -> (x, x + 1)
    }

    template <int QN, class Hook>
    static void rows(const __m512i* qp, int groups, const Bf16Row* const* k, int x0, int x1, float scale,
                     float* s, int lds, const Hook& before_tile) {
        constexpr int KN = QN == 1 ? 8 : Avx512::KN_OF[QN];  // 16 keys and 16 sums: out of registers
        for (int x = x0; x < x1; x += KN) {
            before_tile(x, x + KN < x1 ? x + KN : x1);
            const uint16_t* kx[KN];  // keys past x1 repeat key x1 - 1 (scores into s's slack)
            for (int j = 0; j < KN; ++j) kx[j] = reinterpret_cast<const uint16_t*>(k[x + j < x1 ? x + j : x1 - 1]);
            __m512 acc[QN * KN];
            for (int i = 0; i < QN * KN; ++i) acc[i] = _mm512_setzero_ps();
            for (int g = 0; g < groups; ++g) {
                __m512i kv[KN];
                for (int j = 0; j < KN; ++j) kv[j] = _mm512_loadu_si512(kx[j] + g * BF16_PAIRS);
                for (int i = 0; i < QN; ++i) {
                    __m512i qv = qp[i * groups + g];
                    if constexpr (KN > 1) asm("" : "+v"(qv));  // one load for its KN dot products
                    for (int j = 0; j < KN; ++j)
                        acc[i * KN + j] = _mm512_dpbf16_ps(acc[i * KN + j], (__m512bh)qv, (__m512bh)kv[j]);
                }
            }
            float out[QN * KN];
            Avx512::sums(acc, QN * KN, out);
            for (int i = 0; i < QN; ++i)
                for (int j = 0; j < KN; ++j) s[i * lds + x + j] = out[i * KN + j] * scale;
        }
    }

    template <int G2>
    static void value_heads(const uint32_t (*pairs)[MAX_PAIRS], int nh, const Bf16Row* const* v, int a, int b,
                            int64_t col, float* const* O, const Fold* f) {
        switch (nh) {
            case 1: value_block<G2, 1>(pairs, v, a, b, col, O, f); break;
            case 2: value_block<G2, 2>(pairs, v, a, b, col, O, f); break;
            case 3: value_block<G2, 3>(pairs, v, a, b, col, O, f); break;
            case 4: value_block<G2, 4>(pairs, v, a, b, col, O, f); break;
            case 5: value_block<G2, 5>(pairs, v, a, b, col, O, f); break;
            default: value_block<G2, 6>(pairs, v, a, b, col, O, f); break;
        }
    }

    // NH heads, columns col .. col + 32 G2: positions in pairs (x, x + 1), their values
    // interleaved into bfloat16 pairs (vpunpck*wd: x's value in each lane's upper half). The
    // interleave works within 128-bit lanes, so lane 4j + e of the `lo` accumulator holds
    // column 8j + e and of `hi` 8j + 4 + e; they are put back in order at the end.
    template <int G2, int NH>
    static EMBER_INLINE void value_block(const uint32_t (*pairs)[MAX_PAIRS], const Bf16Row* const* v, int a, int b,
                                         int64_t col, float* const* O, const Fold* f) {
        __m512 acc[NH][2 * G2];
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < 2 * G2; ++w) acc[h][w] = _mm512_setzero_ps();
        for (int x = a & ~1; x < b; x += 2) {
            // a pair's position outside a..b-1 weighs 0: it reads its partner's row (finite)
            const uint16_t* first = reinterpret_cast<const uint16_t*>(v[x >= a ? x : x + 1]);
            const uint16_t* second = x + 1 < b ? reinterpret_cast<const uint16_t*>(v[x + 1]) : first;
            __m512i vv[2 * G2];
            for (int u = 0; u < G2; ++u) {
                const __m512i vf = _mm512_loadu_si512(first + col + u * BF16_PAIRS);
                const __m512i vs = _mm512_loadu_si512(second + col + u * BF16_PAIRS);
                vv[2 * u] = _mm512_unpacklo_epi16(vs, vf);
                vv[2 * u + 1] = _mm512_unpackhi_epi16(vs, vf);
                asm("" : "+v"(vv[2 * u]), "+v"(vv[2 * u + 1]));  // one load for the NH heads
            }
            for (int h = 0; h < NH; ++h) {
                const __m512i w = _mm512_set1_epi32(static_cast<int>(pairs[h][x / 2]));
                for (int i = 0; i < 2 * G2; ++i) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], (__m512bh)w, (__m512bh)vv[i]);
            }
        }
        const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int h = 0; h < NH; ++h)
            for (int u = 0; u < G2; ++u)
                for (int half = 0; half < 2; ++half)
                    merge_into(O[h] + col + u * BF16_PAIRS + half * LANES,
                               _mm512_permutex2var_ps(acc[h][2 * u], half ? last16 : first16, acc[h][2 * u + 1]), f[h]);
    }
};

}  // namespace ember_attention

#pragma GCC pop_options
#endif
