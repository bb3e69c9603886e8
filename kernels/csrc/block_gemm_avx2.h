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

// s[t] = sum over pairs p0..p0+N-1 of w against tile t's pairs (16 tokens each, at x[t] +
// off), wrapping int16; each pair's broadcast serves every tile.
template <int N, int NG>
inline void pairs_dot(__m256i w, int p0, const int8_t* const* x, int64_t off, __m256i* s) {
    for (int i = 0; i < N; ++i) {
        const __m256i wp = pair(w, p0 + i);
        for (int t = 0; t < NG; ++t) {
            const __m256i m = _mm256_maddubs_epi16(wp, load(x[t] + off + 32 * i));
            s[t] = i ? _mm256_add_epi16(s[t], m) : m;
        }
    }
}

// 16 bytes, in both 128-bit lanes.
inline __m256i bcast16(const uint8_t* p) { return _mm256_broadcastsi128_si256(load128(p)); }

template <int TYPE>
struct KGemm {
    static constexpr int BYTES = TYPE == Q4_K ? 144 : TYPE == Q5_K ? 176 : 210;
    // Tiles of 16 tokens per pass: each pair's vpshufb broadcast and each sub-block's unpack
    // serve both, where one tile per pass spent a shuffle per vpmaddubsw.
    static constexpr int G = 2;

    // Rows [r0, r1) against tiles g0..g1-1 of 16 tokens (tile g: tokens 16g..16g+15).
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t g0, int64_t g1, float* y, int64_t ldy) {
        int64_t g = g0;
        for (; g + G <= g1; g += G) tiles<G>(a, w, row_bytes, r0, r1, g, y, ldy);
        for (; g < g1; ++g) tiles<1>(a, w, row_bytes, r0, r1, g, y, ldy);
    }

    // Rows [r0, r1) against tiles g..g+NG-1.
    template <int NG>
    static void tiles(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                      int64_t g, float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 256;
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const int8_t* xg[NG];   // (K/2, 16 tokens, 2)
        const float* dg[NG];    // (K/256, 16) in GEMM_ORDER
        const int16_t* mg[NG];  // (K/64, 16, 2) in GEMM_ORDER
        const int16_t* sg[NG];  // (K/8, 16)
        for (int t = 0; t < NG; ++t) {
            xg[t] = a.qg + (g + t) * K * 16, dg[t] = a.dg + (g + t) * nb * 16;
            mg[t] = a.m32g + (g + t) * (K / 64) * 32, sg[t] = a.s8g + (g + t) * (K / 8) * 16;
        }
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            __m256 acc0[NG], acc1[NG];
            for (int t = 0; t < NG; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = row + b * BYTES;
                prefetch(blk, BYTES);
                const int64_t xb = b * 256 * 16;  // 128 pairs x 32 bytes per block
                __m256i is0[NG], is1[NG];
                for (int t = 0; t < NG; ++t) is0[t] = is1[t] = _mm256_setzero_si256();
                // isum += sc * (p + q) for two int16 partials p, q of each token of tile t
                auto scaled = [&](int t, __m256i p, __m256i q, __m256i sc) {
                    is0[t] = _mm256_add_epi32(is0[t], _mm256_madd_epi16(_mm256_unpacklo_epi16(p, q), sc));
                    is1[t] = _mm256_add_epi32(is1[t], _mm256_madd_epi16(_mm256_unpackhi_epi16(p, q), sc));
                };
                __m256i p[NG], q[NG];
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
                        const int64_t xj = xb + j * 8 * 32;
                        pairs_dot<4, NG>(v, 0, xg, xj, p);
                        pairs_dot<4, NG>(v, 4, xg, xj + 4 * 32, q);
                        for (int t = 0; t < NG; ++t) {
                            const __m256i s0 = _mm256_slli_epi16(load(sg[t] + (b * 32 + 2 * j) * 16), 5);
                            const __m256i s1 = _mm256_slli_epi16(load(sg[t] + (b * 32 + 2 * j + 1) * 16), 5);
                            scaled(t, _mm256_sub_epi16(p[t], s0), _mm256_sub_epi16(q[t], s1),
                                   _mm256_set1_epi16(sc8[j]));
                        }
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
                        const int64_t xj = xb + j * 16 * 32;
                        const __m256i scv = _mm256_set1_epi16(sm[j]);
                        if constexpr (TYPE == Q4_K) {
                            pairs_dot<8, NG>(v0, 0, xg, xj, p);
                            pairs_dot<8, NG>(v1, 0, xg, xj + 8 * 32, q);
                            for (int t = 0; t < NG; ++t) scaled(t, p[t], q[t], scv);
                        } else {  // the 5th bit of value l is bit j of qh[l]
                            const __m128i hs = _mm_cvtsi32_si128(j);
                            const __m256i b5 = _mm256_set1_epi8(0x10);
                            v0 = _mm256_or_si256(v0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(bcast16(blk + 16), hs), 4), b5));
                            v1 = _mm256_or_si256(v1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(bcast16(blk + 32), hs), 4), b5));
                            pairs_dot<4, NG>(v0, 0, xg, xj, p);
                            pairs_dot<4, NG>(v0, 4, xg, xj + 4 * 32, q);
                            for (int t = 0; t < NG; ++t) scaled(t, p[t], q[t], scv);
                            pairs_dot<4, NG>(v1, 0, xg, xj + 8 * 32, p);
                            pairs_dot<4, NG>(v1, 4, xg, xj + 12 * 32, q);
                            for (int t = 0; t < NG; ++t) scaled(t, p[t], q[t], scv);
                        }
                    }
                }
                const __m256 dv = _mm256_set1_ps(d), dmv = _mm256_set1_ps(dmin);
                for (int t = 0; t < NG; ++t) {
                    const __m256 dx0 = _mm256_loadu_ps(dg[t] + b * 16), dx1 = _mm256_loadu_ps(dg[t] + b * 16 + 8);
                    acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0[t]), _mm256_mul_ps(dv, dx0), acc0[t]);
                    acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1[t]), _mm256_mul_ps(dv, dx1), acc1[t]);
                    if constexpr (TYPE != Q6_K) {
                        // min: per token m_2c * sum32_2c + m_2c+1 * sum32_2c+1, c = 0..3
                        __m256i ms0 = _mm256_setzero_si256(), ms1 = _mm256_setzero_si256();
                        for (int c = 0; c < 4; ++c) {
                            const __m256i mp = _mm256_set1_epi32(sm[8 + 2 * c] | sm[9 + 2 * c] << 16);
                            const int16_t* m = mg[t] + (b * 4 + c) * 32;
                            ms0 = _mm256_add_epi32(ms0, _mm256_madd_epi16(load(m), mp));
                            ms1 = _mm256_add_epi32(ms1, _mm256_madd_epi16(load(m + 16), mp));
                        }
                        acc0[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms0), _mm256_mul_ps(dmv, dx0), acc0[t]);
                        acc1[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms1), _mm256_mul_ps(dmv, dx1), acc1[t]);
                    }
                }
            }
            for (int t = 0; t < NG; ++t) {
                alignas(32) float out[16];
                _mm256_store_ps(out, acc0[t]);
                _mm256_store_ps(out + 8, acc1[t]);
                for (int i = 0; i < 16; ++i) y[(16 * (g + t) + GEMM_ORDER[i]) * ldy + r] = out[i];
            }
        }
    }
};

}  // namespace ember_blocks::avx2
