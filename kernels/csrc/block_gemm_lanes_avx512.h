// Prefill on AVX-512 VNNI for the K-quants, weight rows in lanes: 16 rows of W at a time, row n
// in int32 lane n (LANE_ROWS = 16), against x's tokens one by one in its row layout (XQuant::qk).
//
// Why: KGemm (block_gemm_avx512.h) holds tokens in lanes, so each run of 4 weight values must
// be broadcast to every lane (a vpshufd per run and row) and every sub-block's sums scaled per
// row and tile; those ops outnumbered the vpdpbusds. Here a block of 16 rows is unpacked once
// into runs laid out row by row (64 runs x 16 rows x 4 values, in L1/L2) and serves every
// token of the call, and a token's 4 values are an embedded broadcast of the vpdpbusd itself:
// per vpdpbusd, one load of unpacked weights per TG tokens and no shuffle. What is left beside
// the vpdpbusds on their port (Zen 4: vpmulld, vpdpwssd, float fma and mul share it; shifts,
// shuffles and broadcast loads do not) is a vpmulld per sub-block and the block's float steps.
// Measured (Zen 4, the 1.5B's projections at 512 tokens, 2 threads): 250-290 G multiply-adds a
// second against KGemm's 200-240; one thread 140-150 against 115-125, of a 234 peak.
//
// Exactly the row kernels' arithmetic per output (the block's int32 sum and min sum, then
// acc += isum * (d * d_x) and acc -= msum * (dmin * d_x)): the integer sums are exact in any
// order (Q6_K's offset of 32 comes off as 32 * sum_j scale_j * sum_x_j, the same integer), so
// a token's bits do not depend on which kernel computed it (batch invariance).
#pragma once

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "block_gemm_avx512.h"
#include "prefetch.h"

#define EMBER_GEMM_INLINE inline __attribute__((always_inline))

namespace ember_blocks::avx512 {

template <int TYPE, bool GROUPED = false>  // GROUPED: the weight in row groups (block_at)
struct LaneGemm {
    static constexpr int BYTES = KGemm<TYPE>::BYTES;
    static constexpr int SUBS = TYPE == Q6_K ? 16 : 8;  // sub-blocks per block
    static constexpr int RUNS = 64 / SUBS;              // runs of 4 values per sub-block
    static constexpr int PAIRS = SUBS / 2;
    // Tokens per pass: TG sums, block sums and accumulators in registers (4, 5, 6 and 8 ran
    // alike, 12 spilled).
    static constexpr int TG = 6;
    // Below this many tokens the unpacking is not paid back and KGemm takes the call (the
    // 1.5B's gate projection, 2 threads: KGemm ahead at 16 and 32 tokens, this kernel from
    // 48). quantize_x decides it (XLayouts::k_rows_from is this): it lays out KGemm's tiles
    // of x, or not, and gemm reads whichever it made.
    static constexpr int64_t MIN_TOKENS = 48;
    static_assert(LANE_ROWS == 16);

    // One block of 16 rows, unpacked (5.6-6.1 KiB).
    struct Block {
        __m512i w[64];        // run i: each row's values 4i..4i+3 (uint8)
        __m512i sc[SUBS];     // each row's sub-block scales (int32)
        __m512i pair[PAIRS];  // int16 pairs: Q4_K/Q5_K mins (m_2c, m_2c+1), Q6_K scales
        __m512 d, dmin;
    };

    // Byte `at` of row lane (int32 at a time) for 16 rows `index` apart; lanes past n zero.
    struct Rows {
        const uint8_t* base;
        __m512i index;
        __mmask16 live;
        __m512i word(int64_t at) const {
            return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, index, base + at, 1);
        }
    };

    // Byte k (0..3) of each int32 lane.
    static __m512i byte_of(__m512i v, int k) {
        return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF));
    }

    // Rows r..r+n-1 (n <= 16; the rest of the lanes zero) into blocks[0..K/256): each run
    // of 4 values gathered straight from the 16 rows' blocks (a gather per 4 or 8 bytes of
    // quants), scales and mins decoded 16 rows at a time as k_scales does for one.
    static void unpack(const uint8_t* w, int64_t row_bytes, int64_t r, int n, int64_t nb, Block* blocks) {
        // a group's rows: row_bytes apart, or (row groups, r a multiple of 16) BYTES apart
        const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(int32_t(GROUPED ? BYTES : row_bytes)));
        const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
        const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
        for (int64_t b = 0; b < nb; ++b) {
            Block& B = blocks[b];
            const Rows R{block_at<GROUPED, BYTES>(w, row_bytes, r, b), index, live};
            if constexpr (TYPE == Q6_K) {
                // value 128h + 32k + l: low 4 bits from ql[64h + 32(k%2) + l] (nibble k/2),
                // high 2 from qh[32h + l] (bits 2k); sub-block j = (128h + 32k + l) / 16
                for (int h = 0; h < 2; ++h)
                    for (int l = 0; l < 32; l += 4) {
                        const __m512i qh = R.word(128 + 32 * h + l);
                        for (int k2 = 0; k2 < 2; ++k2) {
                            const __m512i ql = R.word(64 * h + 32 * k2 + l);
                            for (int half = 0; half < 2; ++half) {
                                const int k = k2 + 2 * half;
                                const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(ql, 4 * half), nib);
                                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(qh, 2 * k), _mm512_set1_epi32(0x03030303));
                                B.w[(128 * h + 32 * k + l) / 4] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
                            }
                        }
                    }
                for (int q = 0; q < 4; ++q) {  // 16 signed scales, sign-extended
                    const __m512i v = R.word(192 + 4 * q);
                    for (int e = 0; e < 4; ++e) B.sc[4 * q + e] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * e), 24);
                }
                for (int c = 0; c < PAIRS; ++c)
                    B.pair[c] = _mm512_or_si512(_mm512_and_si512(B.sc[2 * c], _mm512_set1_epi32(0xFFFF)),
                                                _mm512_slli_epi32(B.sc[2 * c + 1], 16));
                // d is bytes 208-209, the block's last: the word at 206 (a word at 208 would
                // read past the last row's end)
                B.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(R.word(206), 16)));
                B.dmin = _mm512_setzero_ps();
            } else {
                // sub-block j = 2c + e: nibble e of qs[32c + l], run i = l / 4; Q5_K's fifth bit
                // of value l is bit j of qh[l]
                const int QS = TYPE == Q4_K ? 16 : 48;
                __m512i qh[8];
                if constexpr (TYPE == Q5_K)
                    for (int i = 0; i < 8; ++i) qh[i] = R.word(16 + 4 * i);
                for (int c = 0; c < 4; ++c)
                    for (int i = 0; i < 8; ++i) {
                        const __m512i q = R.word(QS + 32 * c + 4 * i);
                        for (int e = 0; e < 2; ++e) {
                            __m512i v = _mm512_and_si512(_mm512_srli_epi32(q, 4 * e), nib);
                            if constexpr (TYPE == Q5_K)
                                v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(
                                    _mm512_srli_epi32(qh[i], 2 * c + e), _mm512_set1_epi32(0x01010101)), 4));
                            B.w[(2 * c + e) * 8 + i] = v;
                        }
                    }
                // k_scales on 16 rows: words a, b, c -> scales 0-3, 4-7, mins 0-3, 4-7
                const __m512i a = R.word(4), bw = R.word(8), cw = R.word(12);
                const __m512i m6 = _mm512_set1_epi32(0x3F3F3F3F), m4 = _mm512_set1_epi32(0x0F0F0F0F),
                              top = _mm512_set1_epi32(0x30303030);
                const __m512i out[4] = {
                    _mm512_and_si512(a, m6),
                    _mm512_or_si512(_mm512_and_si512(cw, m4), _mm512_and_si512(_mm512_srli_epi32(a, 2), top)),
                    _mm512_and_si512(bw, m6),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(cw, 4), m4),
                                    _mm512_and_si512(_mm512_srli_epi32(bw, 2), top))};
                for (int j = 0; j < 8; ++j) B.sc[j] = byte_of(out[j / 4], j % 4);
                for (int c = 0; c < PAIRS; ++c)  // mins 2c, 2c+1: bytes of out[2 + c / 2]
                    B.pair[c] = _mm512_or_si512(byte_of(out[2 + c / 2], 2 * (c % 2)),
                                                _mm512_slli_epi32(byte_of(out[2 + c / 2], 2 * (c % 2) + 1), 16));
                const __m512i dd = R.word(0);  // d, then dmin
                B.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(dd, _mm512_set1_epi32(0xFFFF))));
                B.dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
            }
        }
    }

    static int32_t load32(const void* p) {
        int32_t v;
        std::memcpy(&v, p, 4);
        return v;
    }

    // Block b of 16 rows against tokens t..t+NT-1: acc[k] += token k's 16 outputs' share.
    template <int NT>
    static EMBER_GEMM_INLINE void block_pass(const XQuant& a, const Block& B, int64_t b, int64_t t, __m512* acc) {
        const int64_t K = a.K, nb = K / 256;
        __m512i isum[NT];
        for (int k = 0; k < NT; ++k) isum[k] = _mm512_setzero_si512();
        for (int j = 0; j < SUBS; ++j) {
            __m512i s[NT];
            for (int k = 0; k < NT; ++k) s[k] = _mm512_setzero_si512();
            for (int i = 0; i < RUNS; ++i) {
                const __m512i wv = B.w[j * RUNS + i];
                const int64_t at = b * 256 + 4 * (j * RUNS + i);
                for (int k = 0; k < NT; ++k)
                    s[k] = _mm512_dpbusd_epi32(s[k], wv, _mm512_set1_epi32(load32(a.qk + (t + k) * K + at)));
            }
            for (int k = 0; k < NT; ++k) isum[k] = _mm512_add_epi32(isum[k], _mm512_mullo_epi32(s[k], B.sc[j]));
        }
        for (int k = 0; k < NT; ++k) {
            const __m512 dx = _mm512_set1_ps(a.dk[(t + k) * nb + b]);
            if constexpr (TYPE == Q6_K) {  // quants 0..63: 32 * sum_j scale_j * sum_x_j comes off
                __m512i ps = _mm512_setzero_si512();
                for (int c = 0; c < PAIRS; ++c)
                    ps = _mm512_dpwssd_epi32(ps, B.pair[c], _mm512_set1_epi32(load32(a.sk16 + (t + k) * (K / 16) + b * 16 + 2 * c)));
                isum[k] = _mm512_sub_epi32(isum[k], _mm512_slli_epi32(ps, 5));
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[k]), _mm512_mul_ps(B.d, dx), acc[k]);
            } else {
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[k]), _mm512_mul_ps(B.d, dx), acc[k]);
                __m512i ms = _mm512_setzero_si512();
                for (int c = 0; c < PAIRS; ++c)
                    ms = _mm512_dpwssd_epi32(ms, B.pair[c], _mm512_set1_epi32(load32(a.sk32 + (t + k) * (K / 32) + b * 8 + 2 * c)));
                acc[k] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(B.dmin, dx), acc[k]);
            }
        }
    }

    // Tokens t0..t1-1 against the unpacked blocks, NT at a time through every block (their
    // accumulators stay in registers). Meanwhile the next rows' bytes (`next`, `ahead` bytes)
    // come into L2 a slice per pass, so that unpacking them does not wait on memory (the
    // gathers touch 16 rows at once: they stalled on every line otherwise).
    template <int NT>
    static void tokens(const XQuant& a, const Block* blocks, int64_t t0, int64_t t1, int64_t r, int n,
                       float* y, int64_t ldy, const uint8_t* next, int64_t ahead) {
        const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
        const int64_t nb = a.K / 256, passes = (t1 - t0) / NT;
        const int64_t slice = passes ? ((ahead / passes) + 63) & ~int64_t(63) : 0;
        int64_t done = 0;
        for (int64_t t = t0; t + NT <= t1; t += NT, done += slice) {
            if (done < ahead) ember_prefetch::lines_l2(next + done, std::min(slice, ahead - done));
            __m512 acc[NT];
            for (int k = 0; k < NT; ++k) acc[k] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) block_pass<NT>(a, blocks[b], b, t, acc);
            for (int k = 0; k < NT; ++k) _mm512_mask_storeu_ps(y + (t + k) * ldy + r, m, acc[k]);
        }
        if constexpr (NT > 1) {
            const int64_t rest = t0 + passes * NT;
            if (rest < t1) tokens<1>(a, blocks, rest, t1, r, n, y, ldy, next, 0);
        }
    }

    // The GemmFn: rows [r0, r1) against tokens 16 g0 .. 16 g1 - 1.
    static void gemm(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t g0, int64_t g1, float* y, int64_t ldy) {
        if (a.qq) return gemm_rows<KGemm<TYPE, GROUPED>>(a, w, row_bytes, r0, r1, g0, g1, y, ldy);  // a short call
        const int64_t t0 = g0 * GEMM_TOKENS, t1 = g1 * GEMM_TOKENS;
        const int64_t nb = a.K / 256;
        // per thread, kept: about 6 KiB per 256 columns (200 KiB at the 1.5B's K of 8960)
        thread_local std::vector<Block> blocks;
        if (int64_t(blocks.size()) < nb) blocks.resize(nb);
        for (int64_t r = r0; r < r1; r += 16) {
            const int n = int(std::min<int64_t>(16, r1 - r));
            unpack(w, row_bytes, r, n, nb, blocks.data());
            // the next group, here or (past r1) most likely this thread's next call: the
            // driver's tiles are contiguous within a range (a prefetch does not fault past
            // the weight's end)
            tokens<TG>(a, blocks.data(), t0, t1, r, n, y, ldy, w + (r + 16) * row_bytes, 16 * row_bytes);
        }
    }
};

}  // namespace ember_blocks::avx512
