// Prefill on AVX2 for Q4_K/Q5_K/Q6_K: 16 rows of x at a time, one token per 16-bit lane.
//
// The row kernels (block_dots_avx2.h) put the values of one token in a vector's lanes, so the
// sums of a block's vpmaddubsw results, each in its own sub-block with its own scale, need
// horizontal folds (vphaddw, ~3 cycles here) before the scales. Here x is laid out token by
// token instead (XQuant::qg: for each pair of values, 16 tokens x 2 bytes), and each pair of
// weight values is broadcast to all lanes (vpshufb), so one vpmaddubsw does that pair for 16
// tokens and a sub-block's partial sums add up vertically (vpaddw, cheap); one vpmaddwd then
// applies the sub-block scale to two partial sums per token. Measured on the 2-core EPYC:
// ~10.7 ns per 256 values and token against ~15 ns in the row kernel (1 thread, Q4_K).
//
// The arithmetic per output is exactly the row kernels' (the block's int32 sum and min sum,
// then acc += isum * (d * d_x) and acc -= msum * (dmin * d_x)), so which kernel computes a
// token never changes its bits (batch invariance).
//
// int16 bounds (|x| <= 127): a vpmaddubsw lane is at most 2*15*127 = 3810 (Q4_K), 2*31*127 =
// 7874 (Q5_K), 2*63*127 = 16002 (Q6_K); partial sums add 8, 4 and 4 of them, Q6_K's wrapping
// and then centred, sum (q - 32) x over 8 values (|.| <= 32512), with 32 times x's sums over
// the same values (XQuant::s8g) taken off.
//
// Token order: vpunpcklwd/vpunpckhwd of two partials give tokens [0-3, 8-11] and [4-7, 12-15]
// in int32 lanes; XQuant::dg and ::m32g are stored in that order (GEMM_ORDER).
#pragma once

#include <immintrin.h>

#include "block_dots_avx2.h"

namespace ember_blocks::avx2 {

// Values 2p and 2p+1 of a 16-value vector (held in both 128-bit lanes) in every 16-bit lane.
inline __m256i pair(__m256i w, int p) {
    return _mm256_shuffle_epi8(w, _mm256_set1_epi16(static_cast<short>((2 * p) | (2 * p + 1) << 8)));
}

// sum over pairs p0..p0+n-1 of w against x's pairs (16 tokens each), wrapping int16.
template <int N>
inline __m256i pairs_dot(__m256i w, int p0, const int8_t* x) {
    __m256i s = _mm256_maddubs_epi16(pair(w, p0), load(x));
    for (int i = 1; i < N; ++i) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(pair(w, p0 + i), load(x + 32 * i)));
    return s;
}

// 16 bytes, in both 128-bit lanes.
inline __m256i bcast16(const uint8_t* p) { return _mm256_broadcastsi128_si256(load128(p)); }

template <int TYPE>
struct KGemm {
    static constexpr int BYTES = TYPE == Q4_K ? 144 : TYPE == Q5_K ? 176 : 210;

    // Rows [r0, r1) against tiles g0..g1-1 of 16 tokens (tile g: tokens 16g..16g+15).
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t g0, int64_t g1, float* y, int64_t ldy) {
        for (int64_t g = g0; g < g1; ++g) tile(a, w, row_bytes, r0, r1, g, y, ldy);
    }

    static void tile(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t g, float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 256;
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const int8_t* xg = a.qg + g * K * 16;            // (K/2, 16 tokens, 2)
        const float* dg = a.dg + g * nb * 16;             // (K/256, 16) in GEMM_ORDER
        const int16_t* mg = a.m32g + g * (K / 64) * 32;   // (K/64, 16, 2) in GEMM_ORDER
        const int16_t* sg = a.s8g + g * (K / 8) * 16;     // (K/8, 16)
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = row + b * BYTES;
                prefetch(blk, BYTES);
                const int8_t* xb = xg + b * 256 * 16;  // 128 pairs x 32 bytes
                __m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
                // isum += sc * (p + q) for two int16 partials p, q of each token
                auto scaled = [&](__m256i p, __m256i q, __m256i sc) {
                    is0 = _mm256_add_epi32(is0, _mm256_madd_epi16(_mm256_unpacklo_epi16(p, q), sc));
                    is1 = _mm256_add_epi32(is1, _mm256_madd_epi16(_mm256_unpackhi_epi16(p, q), sc));
                };
                float d, dmin = 0.f;
                alignas(16) uint8_t sm[16];
                if constexpr (TYPE == Q6_K) {
                    // sub-block j = 8h + 2k + u: values l = 16u..16u+15 of chunk 4h + k; low 4
                    // bits from ql[64h + 32(k%2) + l] (nibble k/2), high 2 from qh[32h + l] (bits 2k)
                    d = half(blk + 208);
                    const int8_t* sc8 = reinterpret_cast<const int8_t*>(blk + 192);
                    for (int j = 0; j < 16; ++j) {
                        const int h = j / 8, k = (j / 2) % 4, u = j % 2;
                        const __m256i ql = bcast16(blk + 64 * h + 32 * (k % 2) + 16 * u);
                        const __m256i qh = bcast16(blk + 128 + 32 * h + 16 * u);
                        const __m128i lsh = _mm_cvtsi32_si128(4 * (k / 2)), hsh = _mm_cvtsi32_si128(2 * k);
                        const __m256i v = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srl_epi16(ql, lsh), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, hsh), _mm256_set1_epi8(3)), 4));
                        const int8_t* xj = xb + j * 8 * 32;
                        const __m256i s0 = _mm256_slli_epi16(load(sg + (b * 32 + 2 * j) * 16), 5);
                        const __m256i s1 = _mm256_slli_epi16(load(sg + (b * 32 + 2 * j + 1) * 16), 5);
                        scaled(_mm256_sub_epi16(pairs_dot<4>(v, 0, xj), s0),
                               _mm256_sub_epi16(pairs_dot<4>(v, 4, xj + 4 * 32), s1),
                               _mm256_set1_epi16(sc8[j]));
                    }
                } else {
                    d = half(blk), dmin = half(blk + 2);
                    k_scales(blk + 4, sm);
                    const uint8_t* qs = blk + (TYPE == Q4_K ? 16 : 48);
                    for (int j = 0; j < 8; ++j) {  // sub-block j: values 0-15 in v0, 16-31 in v1
                        const int c = j / 2, sh = 4 * (j % 2);
                        const __m128i s = _mm_cvtsi32_si128(sh);
                        __m256i v0 = _mm256_and_si256(_mm256_srl_epi16(bcast16(qs + 32 * c), s), m4);
                        __m256i v1 = _mm256_and_si256(_mm256_srl_epi16(bcast16(qs + 32 * c + 16), s), m4);
                        const int8_t* xj = xb + j * 16 * 32;
                        const __m256i scv = _mm256_set1_epi16(sm[j]);
                        if constexpr (TYPE == Q4_K) {
                            scaled(pairs_dot<8>(v0, 0, xj), pairs_dot<8>(v1, 0, xj + 8 * 32), scv);
                        } else {  // the 5th bit of value l is bit j of qh[l]
                            const __m128i hs = _mm_cvtsi32_si128(j);
                            const __m256i b5 = _mm256_set1_epi8(0x10);
                            v0 = _mm256_or_si256(v0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(bcast16(blk + 16), hs), 4), b5));
                            v1 = _mm256_or_si256(v1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(bcast16(blk + 32), hs), 4), b5));
                            scaled(pairs_dot<4>(v0, 0, xj), pairs_dot<4>(v0, 4, xj + 4 * 32), scv);
                            scaled(pairs_dot<4>(v1, 0, xj + 8 * 32), pairs_dot<4>(v1, 4, xj + 12 * 32), scv);
                        }
                    }
                }
                const __m256 dx0 = _mm256_loadu_ps(dg + b * 16), dx1 = _mm256_loadu_ps(dg + b * 16 + 8);
                const __m256 dv = _mm256_set1_ps(d);
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0), _mm256_mul_ps(dv, dx0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1), _mm256_mul_ps(dv, dx1), acc1);
                if constexpr (TYPE != Q6_K) {
                    // min: per token m_2c * sum32_2c + m_2c+1 * sum32_2c+1, c = 0..3
                    __m256i ms0 = _mm256_setzero_si256(), ms1 = _mm256_setzero_si256();
                    for (int c = 0; c < 4; ++c) {
                        const __m256i mp = _mm256_set1_epi32(sm[8 + 2 * c] | sm[9 + 2 * c] << 16);
                        const int16_t* m = mg + (b * 4 + c) * 32;
                        ms0 = _mm256_add_epi32(ms0, _mm256_madd_epi16(load(m), mp));
                        ms1 = _mm256_add_epi32(ms1, _mm256_madd_epi16(load(m + 16), mp));
                    }
                    const __m256 dmv = _mm256_set1_ps(dmin);
                    acc0 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms0), _mm256_mul_ps(dmv, dx0), acc0);
                    acc1 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms1), _mm256_mul_ps(dmv, dx1), acc1);
                }
            }
            alignas(32) float out[16];
            _mm256_store_ps(out, acc0);
            _mm256_store_ps(out + 8, acc1);
            for (int i = 0; i < 16; ++i) y[(16 * g + GEMM_ORDER[i]) * ldy + r] = out[i];
        }
    }
};

}  // namespace ember_blocks::avx2
