// Decode (one row of x) on AVX-512 VNNI for the K-quants, on weights held in row groups:
// 16 rows interleaved block by block (block b of rows 0..15 side by side, then block b + 1;
// models/weights.py:QTensor.in_row_groups). Each row's block is unpacked and multiplied in
// 512-bit vectors, its sub-block scales applied by vpdpwssd; then the 16 rows' sums are added
// up together (one transpose-and-add tree gives row i's sum in lane i) and the block's float
// step runs once for the 16 rows in lanes, where the row kernels (block_dots_avx512.h) take a
// horizontal sum and a scalar float step per row and block.
//
// Why the layout: with the weights in cache one core takes ~17 cycles a Q4_K block here
// against the row kernel's ~25, but on the file's layout the 16 rows are 16 streams the
// hardware prefetchers do not follow, and from memory that lost (commit 1c67b8e: 0.93-0.99x
// of whole decodes). Interleaved, the group is one sequential stream again: the weight pass
// reads at about a plain read's speed (~1.04-1.15x the row kernel's, 2 threads, Zen 4).
//
// Exactly the row kernels' arithmetic per output: the block's integer sum and min sum are
// exact in any order (Q6_K's offset of 32 comes off as 32 * sum_j scale_j * sum_x_j), then
// acc += isum * (d * d_x) and acc -= msum * (dmin * d_x) in that order, the same float
// operations per lane as the row kernels' scalars. So a row's bits do not depend on the layout
// or the kernel (batch invariance, speculative verification).
#pragma once

#include <immintrin.h>

#include "block_formats.h"

namespace ember_blocks::avx512 {

// Lane r of the result: the sum of v[r]'s 16 int32 lanes, for r = 0..15.
inline __m512i sum_each16(const __m512i v[16]) {
    __m512i t1[8], t2[4], t3[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        t1[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: rows 4i..4i+3, that lane's part of each
        t2[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t1[2 * i], t1[2 * i + 1]),
                                 _mm512_unpackhi_epi64(t1[2 * i], t1[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // 128-bit lanes 0+1 and 2+3 of rows 8i..8i+3, then 8i+4..8i+7
        t3[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(t2[2 * i], t2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(t2[2 * i], t2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(t3[0], t3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(t3[0], t3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane r of the result: the sum of v[r]'s 4 int32 lanes, for r = 0..15.
inline __m512i sum_each4(const __m128i v[16]) {
    __m128i t[4];
    for (int i = 0; i < 4; ++i)
        t[i] = _mm_hadd_epi32(_mm_hadd_epi32(v[4 * i], v[4 * i + 1]), _mm_hadd_epi32(v[4 * i + 2], v[4 * i + 3]));
    const __m512i lo = _mm512_inserti32x4(_mm512_castsi128_si512(t[0]), t[1], 1);
    return _mm512_inserti32x4(_mm512_inserti32x4(lo, t[2], 2), t[3], 3);
}

template <int TYPE>
struct GroupGemv {
    static_assert(TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K);
    static constexpr int BYTES = TYPE == Q4_K ? 144 : TYPE == Q5_K ? 176 : 210;
    static constexpr int ROWS = LANE_ROWS;  // sum_each16 adds up 16 rows
    static_assert(ROWS == 16);
    // Where the block's fp16 d (and dmin) sit, read as one int32: Q4_K/Q5_K d | dmin << 16 at
    // byte 0; Q6_K's d at 208 as the high half of the word at 206 (a word at 208 would read
    // past the tensor's last block).
    static constexpr int D_AT = TYPE == Q6_K ? 206 : 0;

    // y[tok * ldy + r] for rows r0..r1 (whole groups of 16, r0 a multiple of 16) of weights
    // in row groups: group g's block b of row i at w + g * 16 * row_bytes + (b * 16 + i) * BYTES.
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t tok, float* y, int64_t ldy) {
        const int64_t nb = a.K / 256;
        const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(BYTES));
        for (int64_t r = r0; r < r1; r += ROWS) {
            const uint8_t* group = w + r * row_bytes;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = group + b * ROWS * BYTES;
                __m512i isum[ROWS];
                __m128i msum[ROWS];
                block_sums(a, blk, tok, b, isum, msum);
                const __m512i dw = _mm512_i32gather_epi32(row_at, blk + D_AT, 1);
                const __m512 dx = _mm512_set1_ps(a.dk[tok * nb + b]);
                const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(TYPE == Q6_K ? _mm512_srli_epi32(dw, 16) : dw));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_each16(isum)), _mm512_mul_ps(d, dx), acc);
                if constexpr (TYPE != Q6_K) {
                    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16)));
                    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(sum_each4(msum)), _mm512_mul_ps(dmin, dx), acc);
                }
            }
            _mm512_storeu_ps(y + tok * ldy + r, acc);
        }
    }

    // Block b of a group's 16 rows (row i's at blk + i * BYTES) against x's row tok: isum[i]'s
    // lanes add up to row i's integer block sum (Q6_K: with its offset taken off), msum[i]'s
    // to its min sum (Q4_K/Q5_K).
    static inline __attribute__((always_inline)) void block_sums(const XQuant& a, const uint8_t* blk, int64_t tok,
                                                                 int64_t b, __m512i isum[ROWS], __m128i msum[ROWS]) {
        const int8_t* xq = a.qk + tok * a.K + b * 256;
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        const __m512i zero = _mm512_setzero_si512();
        if constexpr (TYPE == Q6_K) {
            // value 128h + 32k + l: low 4 bits from ql[64h + 32(k%2) + l] (nibble k/2), high 2
            // bits from qh[32h + l] (bits 2k, 2k+1); so the 64 bytes ql[64h..] hold values
            // 128h..128h+63 in their low nibbles and the next 64 in their high ones, in order.
            const __m512i x[4] = {_mm512_loadu_si512(xq), _mm512_loadu_si512(xq + 64),
                                  _mm512_loadu_si512(xq + 128), _mm512_loadu_si512(xq + 192)};
            const __m256i xs16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sk16 + tok * (a.K / 16) + b * 16));
            const __m512i m30 = _mm512_set1_epi8(0x30);
            // qh bits 2k, 2k+1 to bits 4, 5: k = 0 | 1 (shift left 4 | 2), k = 2 | 3 (right 0 | 2)
            const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
            const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
            // int16 scales for packs(p0, p1) (128-bit lane k: sub-blocks k and 4 + k) and
            // packs(p2, p3) (8 + k and 12 + k)
            const __m512i sc_lo = _mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2,
                                                   5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0, 0, 0);
            const __m512i sc_hi = _mm512_add_epi16(sc_lo, _mm512_set1_epi16(8));
            for (int i = 0; i < ROWS; ++i) {
                const uint8_t* q = blk + i * BYTES;
                __m512i v[4];
                for (int h = 0; h < 2; ++h) {
                    const __m512i ql = _mm512_loadu_si512(q + 64 * h);
                    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128 + 32 * h)));
                    v[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, m4), _mm512_sllv_epi16(qh, shl), m30, 0xF8);
                    v[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                                             _mm512_srlv_epi16(qh, shr), m30, 0xF8);
                }
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 192)));
                const __m512i sc512 = _mm512_castsi256_si512(sc);
                __m512i p[4];
                for (int c = 0; c < 4; ++c) p[c] = _mm512_dpbusd_epi32(zero, v[c], x[c]);
                __m512i s = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(p[0], p[1]), _mm512_permutexvar_epi16(sc_lo, sc512));
                s = _mm512_dpwssd_epi32(s, _mm512_packs_epi32(p[2], p[3]), _mm512_permutexvar_epi16(sc_hi, sc512));
                const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(xs16, sc), 5);
                isum[i] = _mm512_sub_epi32(s, _mm512_zextsi256_si512(off));
                msum[i] = _mm_setzero_si128();
            }
        } else {
            // 64 bytes of qs: low nibbles values 0..31 | 64..95 of the 128 they cover, high
            // nibbles 32..63 | 96..127; x is read in the same order.
            auto two = [&](int lo, int hi) {
                return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + lo))),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + hi)), 1);
            };
            const __m512i x[4] = {two(0, 64), two(32, 96), two(128, 192), two(160, 224)};
            const __m128i xs32 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sk32 + tok * (a.K / 32) + b * 8));
            // int16 scale per lane for packs(p[0], p[1]): 128-bit lanes 0, 1 sub-blocks 0 | 1,
            // lanes 2, 3 sub-blocks 2 | 3 (4 | 5 and 6 | 7 for packs(p[2], p[3])); bytes of
            // the decoded scales, zero-extended (index 0x80: a zero byte)
            const char Z = char(0x80);
            const __m512i pick_lo = _mm512_set_epi8(
                Z, 3, Z, 3, Z, 3, Z, 3, Z, 2, Z, 2, Z, 2, Z, 2, Z, 3, Z, 3, Z, 3, Z, 3, Z, 2, Z, 2, Z, 2, Z, 2,
                Z, 1, Z, 1, Z, 1, Z, 1, Z, 0, Z, 0, Z, 0, Z, 0, Z, 1, Z, 1, Z, 1, Z, 1, Z, 0, Z, 0, Z, 0, Z, 0);
            const __m512i pick_hi = _mm512_add_epi8(pick_lo, _mm512_set1_epi16(4));
            // k_scales (block_formats.h) on the words a, b, c of the 12 scale bytes:
            // [a & 3f.., (c & 0f..) | ((a >> 2) & 30..), b & 3f.., ((c >> 4) & 0f..) | ((b >> 2) & 30..)]
            const __m128i keep = _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
            const __m128i high = _mm_setr_epi32(0, 0x30303030, 0, 0x30303030);
            const __m128i shift_c = _mm_setr_epi32(0, 0, 0, 4);
            const __m512i sixteen = _mm512_set1_epi8(16);
            for (int i = 0; i < ROWS; ++i) {
                const uint8_t* q = blk + i * BYTES;
                const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4));
                const __m128i abcc = _mm_srlv_epi32(_mm_shuffle_epi32(s, _MM_SHUFFLE(2, 1, 2, 0)), shift_c);
                const __m128i ab = _mm_srli_epi32(_mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 0, 0)), 2);
                const __m128i scm = _mm_ternarylogic_epi32(_mm_and_si128(abcc, keep), ab, high, 0xF8);
                const __m512i sc = _mm512_broadcast_i32x4(scm);
                msum[i] = _mm_madd_epi16(_mm_unpackhi_epi8(scm, _mm_setzero_si128()), xs32);
                const uint8_t* qs = q + (TYPE == Q4_K ? 16 : 48);
                __m512i v[4];
                for (int h = 0; h < 2; ++h) {
                    const __m512i raw = _mm512_loadu_si512(qs + 64 * h);
                    v[2 * h] = _mm512_and_si512(raw, m4);
                    v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                }
                if constexpr (TYPE == Q5_K) {  // bit 4 of value 32j + l: bit j of qh[l]
                    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)));
                    for (int c = 0; c < 4; ++c) {  // v[c] holds sub-blocks j = (c/2)*4 + c%2 | j + 2
                        const int j = (c / 2) * 4 + c % 2;
                        const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << j)), _mm256_set1_epi8(char(1 << (j + 2))), 1);
                        v[c] = _mm512_mask_add_epi8(v[c], _mm512_test_epi8_mask(qh, bits), v[c], sixteen);
                    }
                }
                __m512i p[4];
                for (int c = 0; c < 4; ++c) p[c] = _mm512_dpbusd_epi32(zero, v[c], x[c]);
                __m512i t = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(p[0], p[1]), _mm512_shuffle_epi8(sc, pick_lo));
                isum[i] = _mm512_dpwssd_epi32(t, _mm512_packs_epi32(p[2], p[3]), _mm512_shuffle_epi8(sc, pick_hi));
            }
        }
    }
};

}  // namespace ember_blocks::avx512
