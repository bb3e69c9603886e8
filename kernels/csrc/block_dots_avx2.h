// The AVX2 path of block_matmul: GGML blocks against int8 x (or float32 x for F16/BF16/F32),
// same kernel interface as block_dots_portable.h. Each weight block is unpacked into registers
// once per tile of TT tokens.
//
// The costly instructions on the AVX2 machines here (Zen-class EPYC, 2.5 GHz) are vpmaddubsw
// and vpmaddwd: both go through one execution port, 2 cycles per 256-bit op, while vphaddw
// (3 cycles) issues on other ports alongside them. So the kernels pair-sum with vpmaddubsw
// (u8 weights times s8 x), then fold int16 partial sums with vphaddw as far as int16 holds
// them, and spend as few vpmaddwd as possible (one per 256 values for Q4_K, against eight the
// straightforward way). Bounds, |x| <= 127: a vpmaddubsw lane is at most 2*15*127 = 3810 for
// 4-bit quants, 2*31*127 = 7874 for 5-bit, 2*63*127 = 16002 for 6-bit; vphaddw (wrapping) may
// add 8, 4 and 2 of them. Quants are used unsigned as stored, so no sign trick is needed but
// for Q8_0; the offsets of Q4_0/Q5_0/Q6_K come off through x's sums.
//
// Batch invariance: a token's arithmetic is the same instructions whatever the tile size TT
// (explicit fma intrinsics, no mul feeding an add that -ffp-contract could fuse in one
// instantiation and not another). Per output: the 32-value types keep 8 float lanes (one per
// block of a group of 8) and one fixed horizontal sum, plus a scalar for trailing blocks; the
// K-quants one float accumulator, as the prefill kernel (block_gemm_avx2.h).
#pragma once

#include <immintrin.h>

#include "block_formats.h"

namespace ember_blocks::avx2 {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

inline float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Software prefetch ~2 KiB ahead of the row stream, once per cache line of a block (group):
// the Q8_0 kernel measured ~10% more bandwidth with it on these machines.
constexpr int PREFETCH_AHEAD = 2048;
inline void prefetch(const uint8_t* p, int bytes) {
    for (int o = 0; o < bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_AHEAD + o), _MM_HINT_T0);
}

// ember_blocks::quantize_row with the same result bit for bit (exact max, the same divisions
// and products, round half to even; NaN never wins the max, and clamps to -127, as std::max
// does there). Blocks go 8 at a time: their maxima, then the 16 divisions in two vector ops,
// then the values, so no block waits on a scalar division (~3x faster than block by block).
inline void quantize_row(const float* x, int64_t n, int B, int8_t* q, float* d, int16_t* sum8) {
    const __m256 sign = _mm256_set1_ps(-0.f), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    const __m256 levels = _mm256_set1_ps(127.f), inf = _mm256_set1_ps(INFINITY);
    const int64_t nb = n / B;
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int m = int(std::min<int64_t>(8, nb - b0));
        alignas(32) float amax[8] = {}, id[8];
        for (int i = 0; i < m; ++i) {
            const float* xb = x + (b0 + i) * B;
            __m256 v = _mm256_setzero_ps();
            for (int j = 0; j < B; j += 8) v = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)), v);
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            amax[i] = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        }
        const __m256 a = _mm256_load_ps(amax);
        const __m256 dv = _mm256_div_ps(a, levels), iv = _mm256_div_ps(levels, a);
        const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(dv, _mm256_setzero_ps(), _CMP_GT_OQ),
                                        _mm256_cmp_ps(iv, inf, _CMP_LT_OQ));
        alignas(32) float dd[8];
        _mm256_store_ps(dd, _mm256_and_ps(ok, dv));
        _mm256_store_ps(id, _mm256_and_ps(ok, iv));
        std::memcpy(d + b0, dd, m * sizeof(float));
        for (int i = 0; i < m; ++i) {
            const int64_t o = (b0 + i) * B;
            if (id[i] == 0.f) {
                std::memset(q + o, 0, B);
                std::memset(sum8 + o / 8, 0, B / 8 * sizeof(int16_t));
                continue;
            }
            const __m256 ib = _mm256_set1_ps(id[i]);
            for (int j = 0; j < B; j += 32) {
                __m256i v[4];
                for (int k = 0; k < 4; ++k) {
                    const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + o + j + 8 * k), ib),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
                }
                // packs interleave the 128-bit lanes: [0 1 2 3 | 4 5 6 7] -> permute back
                const __m256i p = _mm256_permutevar8x32_epi32(
                    _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + o + j), p);
                // sums of 8: vpsadbw of q + 128 against 0, less 8 * 128
                const __m256i s = _mm256_sub_epi64(
                    _mm256_sad_epu8(_mm256_xor_si256(p, _mm256_set1_epi8(-128)), _mm256_setzero_si256()),
                    _mm256_set1_epi64x(1024));
                const __m128i s4 = _mm256_castsi256_si128(
                    _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
                _mm_storel_epi64(reinterpret_cast<__m128i*>(sum8 + (o + j) / 8), _mm_packs_epi32(s4, s4));
            }
        }
    }
}

// The 32-value types read x in "pair layout" (XQuant::pairs): in each full group of 8 blocks,
// blocks 2p and 2p+1 (A, B) lie as [A 0..15 | B 0..15 | A 16..31 | B 16..31], and the group's
// per-block scalars in the order 0, 2, 4, 6, 1, 3, 5, 7. Then one 256-bit load of A's and B's
// 16 nibble bytes unpacks to two vectors that match x as is, the two vpmaddubsw results of a
// pair add up in int16 (no vphaddw), and two vphaddw rounds plus one vpmaddwd leave the 8 block
// sums in 8 int32 lanes, in the scalars' order: one convert and one fma per 8 blocks and token.
// Trailing blocks (nb % 8) keep the natural layout and go one at a time into a scalar sum.

// Bytes j = 0..15 of each 128-bit lane: 0x10 where bit j (lo) or 16 + j (hi) of that lane's
// qh is set: the 5th bits of a pair of Q5_0/Q5_1 blocks in pair layout.
inline void fifth_bits(uint32_t qa, uint32_t qb, __m256i& lo, __m256i& hi) {
    const __m256i qh = _mm256_set_m128i(_mm_cvtsi32_si128(int(qb)), _mm_cvtsi32_si128(int(qa)));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i b5 = _mm256_set1_epi8(0x10);
    const __m256i l = _mm256_shuffle_epi8(qh, _mm256_set_epi64x(0x0101010101010101, 0, 0x0101010101010101, 0));
    const __m256i h = _mm256_shuffle_epi8(qh, _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                0x0303030303030303, 0x0202020202020202));
    lo = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(l, bit), bit), b5);
    hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), b5);
}

// One block's 32 quants in natural order (trailing blocks).
template <int TYPE, int QS>
inline __m256i unpack_one(const uint8_t* blk) {
    if constexpr (TYPE == Q8_0) return load(blk + 2);
    const __m128i v = load128(blk + QS);
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
    if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
        uint32_t qh;
        std::memcpy(&qh, blk + QS - 4, 4);
        __m256i lo, hi;
        fifth_bits(qh, qh, lo, hi);  // lane 0 of each is this block's
        q = _mm256_or_si256(q, _mm256_permute2x128_si256(lo, hi, 0x20));
    }
    return q;
}

// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0. Quants are used as stored (unsigned, but Q8_0's signed: the sign
// trick); Q4_0/Q5_0's offset comes off as 8 or 16 times x's block sums, Q4_1/Q5_1's min is
// m * (d_x * sum). Two vphaddw rounds leave each block in two int16 lanes of 16 values each:
// at most 16*15*127 = 30480 for 4-bit quants; 5-bit ones (16*31*127 would not fit) are
// centred, sum (q - 16) x, |.| <= 16*16*127 = 32512, by taking 16 times x's sums over the same
// values (XQuant::h32) off in int16: wrapping adds, so the sums may overflow on the way as
// long as the result fits. Q8_0 (2*128*127 per vpmaddubsw lane) goes to int32 at once.
template <int TYPE>
struct Small {
    static constexpr int BYTES = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 :
                                 TYPE == Q5_1 ? 24 : 34;
    static constexpr int QS = TYPE == Q8_0 ? 2 : BYTES - 16;  // the quants close every block
    static constexpr int OFFSET_SHIFT = TYPE == Q4_0 ? 3 : TYPE == Q5_0 ? 4 : 0;  // 8 or 16
    static constexpr bool HAS_MIN = TYPE == Q4_1 || TYPE == Q5_1;
    static constexpr bool FIVE = TYPE == Q5_0 || TYPE == Q5_1;
    static constexpr int TILE = 8;  // tokens per tile (block_matmul.cpp)

    // A group of 8 blocks: the quants of pair p (blocks 2p, 2p+1 = A, B) in lo[p] (values
    // 0..15 of A | of B) and hi[p] (16..31), Q8_0's as absolute values with the signed ones in
    // slo/shi; the scales (and mins) in the lanes' block order 0, 2, 4, 6, 1, 3, 5, 7.
    static inline void unpack(const uint8_t* blk, __m256& dw, __m256& mw, __m256i lo[4],
                              __m256i hi[4], __m256i slo[4], __m256i shi[4]) {
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        // The 8 scales (and mins) in lane order, gathered in scalar registers: the
        // vector units are the bottleneck, and 2-byte stores then a 16-byte load would
        // stall on store forwarding.
        auto h4 = [&](int i, int o) {  // fp16 fields at offset o of blocks i, i+2, i+4, i+6
            uint64_t v = 0;
            for (int j = 3; j >= 0; --j) {
                uint16_t h;
                std::memcpy(&h, blk + (i + 2 * j) * BYTES + o, 2);
                v = v << 16 | h;
            }
            return static_cast<long long>(v);
        };
        dw = _mm256_cvtph_ps(_mm_set_epi64x(h4(1, 0), h4(0, 0)));
        mw = _mm256_setzero_ps();
        if (HAS_MIN) mw = _mm256_cvtph_ps(_mm_set_epi64x(h4(1, 2), h4(0, 2)));
        for (int p = 0; p < 4; ++p) {
            const uint8_t *A = blk + 2 * p * BYTES, *B = A + BYTES;
            if constexpr (TYPE == Q8_0) {
                slo[p] = _mm256_loadu2_m128i((const __m128i*)(B + 2), (const __m128i*)(A + 2));
                shi[p] = _mm256_loadu2_m128i((const __m128i*)(B + 18), (const __m128i*)(A + 18));
                lo[p] = _mm256_abs_epi8(slo[p]), hi[p] = _mm256_abs_epi8(shi[p]);
            } else {
                const __m256i v = _mm256_loadu2_m128i((const __m128i*)(B + QS), (const __m128i*)(A + QS));
                lo[p] = _mm256_and_si256(v, m4);
                hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if constexpr (FIVE) {
                    uint32_t qa, qb;
                    std::memcpy(&qa, A + QS - 4, 4), std::memcpy(&qb, B + QS - 4, 4);
                    __m256i fl, fh;
                    fifth_bits(qa, qb, fl, fh);
                    lo[p] = _mm256_or_si256(lo[p], fl), hi[p] = _mm256_or_si256(hi[p], fh);
                }
            }
        }
    }

    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 32, ng = nb / 8;
        const __m256i ones = _mm256_set1_epi16(1);
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            __m256 acc[TT];
            float tail[TT];
            for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps(), tail[t] = 0.f;
            for (int64_t g = 0; g < ng; ++g) {
                const uint8_t* blk = row + g * 8 * BYTES;
                prefetch(blk, 8 * BYTES);
                __m256i lo[4], hi[4], slo[4], shi[4];  // pair p: values 0..15 / 16..31 of A | B
                __m256 dw, mw;
                unpack(blk, dw, mw, lo, hi, slo, shi);
                for (int t = 0; t < TT; ++t) {
                    const int64_t xb = (t0 + t) * nb + g * 8;  // x's first block of the group
                    const int8_t* xq = a.q32 + xb * 32;
                    __m256i i8;
                    if constexpr (TYPE == Q8_0) {
                        __m256i u[4];
                        for (int p = 0; p < 4; ++p) {
                            const __m256i s0 = _mm256_maddubs_epi16(lo[p], _mm256_sign_epi8(load(xq + 64 * p), slo[p]));
                            const __m256i s1 = _mm256_maddubs_epi16(hi[p], _mm256_sign_epi8(load(xq + 64 * p + 32), shi[p]));
                            u[p] = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
                        }
                        i8 = _mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3]));
                    } else {
                        __m256i u[4];
                        for (int p = 0; p < 4; ++p)
                            u[p] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], load(xq + 64 * p)),
                                                    _mm256_maddubs_epi16(hi[p], load(xq + 64 * p + 32)));
                        __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(u[0], u[1]),
                                                      _mm256_hadd_epi16(u[2], u[3]));
                        if constexpr (FIVE)  // centre on 16: sum (q - 16) x (may wrap before)
                            h = _mm256_sub_epi16(h, _mm256_slli_epi16(load(a.h32 + xb * 2), 4));
                        i8 = _mm256_madd_epi16(h, ones);
                    }
                    if constexpr (TYPE == Q4_0)
                        i8 = _mm256_sub_epi32(i8, _mm256_slli_epi32(load(a.s32 + xb), 3));
                    else if constexpr (TYPE == Q5_1)  // undo the centring
                        i8 = _mm256_add_epi32(i8, _mm256_slli_epi32(load(a.s32 + xb), 4));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i8),
                                             _mm256_mul_ps(dw, _mm256_loadu_ps(a.d32 + xb)), acc[t]);
                    if (HAS_MIN) acc[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a.ds32 + xb), acc[t]);
                }
            }
            for (int64_t b = ng * 8; b < nb; ++b) {
                const uint8_t* blk = row + b * BYTES;
                const __m256i q = unpack_one<TYPE, QS>(blk);
                const float d = half(blk), m = HAS_MIN ? half(blk + 2) : 0.f;
                for (int t = 0; t < TT; ++t) {
                    const int64_t xb = (t0 + t) * nb + b;
                    const __m256i xv = load(a.q32 + xb * 32);
                    const __m256i s = TYPE == Q8_0
                        ? _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q))
                        : _mm256_maddubs_epi16(q, xv);
                    int32_t p = hsum_i32(_mm256_madd_epi16(s, ones));
                    if constexpr (OFFSET_SHIFT > 0) p -= (1 << OFFSET_SHIFT) * a.s32[xb];
                    tail[t] = std::fma(float(p), d * a.d32[xb], tail[t]);
                    if (HAS_MIN) tail[t] = std::fma(m, a.ds32[xb], tail[t]);
                }
            }
            for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = hsum(acc[t]) + tail[t];
        }
    }
};

// Bit j of every byte of v moved to bit 4 (0x10 or 0): Q5_K's 5th bit of sub-block j.
template <int J>
inline __m256i bit_to_4(__m256i v) {
    const __m256i b = _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(1 << J)));
    if constexpr (J < 4) return _mm256_slli_epi16(b, 4 - J);
    else if constexpr (J == 4) return b;
    else return _mm256_srli_epi16(b, J - 4);
}

// Q4_K/Q5_K/Q6_K, one 256-value block at a time: 8 vpmaddubsw (32 values each), the vphaddw
// folds, vpmaddwd against the sub-block scales (Q4_K: 1, Q5_K: 2, Q6_K: 4) give the block's
// integer sum in 8 int32 lanes; the min (Q4_K/Q5_K: one 128-bit vpmaddwd of x's per-32 sums by
// the mins) or the offset (Q6_K: 32 * sum_j sc_j * x's per-16 sums) likewise. Then, exactly as
// the prefill kernel (block_gemm_avx2.h) and the portable path: the block's int32 sums, and per
// token one float step: acc += isum * (d * d_x), acc -= msum * (dmin * d_x).
template <int TYPE>
struct KQuant {
    static constexpr int BYTES = TYPE == Q4_K ? 144 : TYPE == Q5_K ? 176 : 210;
    static constexpr int TILE = 8;

    // One block: its 256 quants as 8 vectors of 32 values in order (Q6_K's unsigned, 0..63),
    // the sub-block scales laid out for the vphaddw folds below (sc), all sub-block scales as
    // int16 in order (sc16: Q6_K's 16; Q4_K/Q5_K's 8, in the low half), Q4_K/Q5_K's 8 mins
    // (mn), and the block's d and dmin (0 for Q6_K).
    static inline void unpack(const uint8_t* blk, __m256i q[8], __m256i sc[4], __m256i& sc16,
                              __m128i& mn, float& d, float& dmin) {
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        sc16 = _mm256_setzero_si256(), mn = _mm_setzero_si128(), dmin = 0.f;
        if constexpr (TYPE == Q6_K) {
            // value 128h + 32k + l: low 4 bits from ql[64h + 32(k%2) + l] (nibble k/2),
            // high 2 bits from qh[32h + l] (bits 2k, 2k+1).
            for (int h = 0; h < 2; ++h) {
                const __m256i l0 = load(blk + 64 * h), l1 = load(blk + 64 * h + 32);
                const __m256i hb = load(blk + 128 + 32 * h);
                const __m256i m2 = _mm256_set1_epi8(0x30);
                q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
                q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
                q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                               _mm256_and_si256(hb, m2));
                q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
            }
            // After one vphaddw of chunks 2m, 2m+1: lanes [sub 4m x4, sub 4m+2 x4 |
            // sub 4m+1 x4, sub 4m+3 x4] (16-value sub-blocks), so sc[m] is laid out so.
            const __m128i s8 = load128(blk + 192);
            for (int m = 0; m < 4; ++m) {
                const int j = 4 * m;
                const __m128i idx = _mm_setr_epi8(j, j, j, j, j + 2, j + 2, j + 2, j + 2, j + 1,
                                                  j + 1, j + 1, j + 1, j + 3, j + 3, j + 3, j + 3);
                sc[m] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, idx));
            }
            sc16 = _mm256_cvtepi8_epi16(s8);  // all 16 scales, for the offset term
            d = half(blk + 208);
        } else {
            alignas(16) uint8_t sm[16];
            k_scales(blk + 4, sm);
            const __m128i s16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm)));
            sc16 = _mm256_zextsi128_si256(s16);
            mn = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)));
            if constexpr (TYPE == Q4_K) {
                sc[0] = _mm256_broadcastsi128_si256(s16);  // [sc0..sc7 | sc0..sc7]
            } else {
                sc[0] = _mm256_broadcastsi128_si256(_mm_unpacklo_epi16(s16, s16));
                sc[1] = _mm256_broadcastsi128_si256(_mm_unpackhi_epi16(s16, s16));
            }
            const uint8_t* qs = blk + (TYPE == Q4_K ? 16 : 48);
            for (int c = 0; c < 4; ++c) {
                const __m256i v = load(qs + 32 * c);
                q[2 * c] = _mm256_and_si256(v, m4);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            if constexpr (TYPE == Q5_K) {
                const __m256i qh = load(blk + 16);
                q[0] = _mm256_or_si256(q[0], bit_to_4<0>(qh));
                q[1] = _mm256_or_si256(q[1], bit_to_4<1>(qh));
                q[2] = _mm256_or_si256(q[2], bit_to_4<2>(qh));
                q[3] = _mm256_or_si256(q[3], bit_to_4<3>(qh));
                q[4] = _mm256_or_si256(q[4], bit_to_4<4>(qh));
                q[5] = _mm256_or_si256(q[5], bit_to_4<5>(qh));
                q[6] = _mm256_or_si256(q[6], bit_to_4<6>(qh));
                q[7] = _mm256_or_si256(q[7], bit_to_4<7>(qh));
            }
            d = half(blk), dmin = half(blk + 2);
        }
    }

    // Token tok's float step for block b, given the block's integer sum in 8 lanes (isum):
    // Q6_K's offset (32 * sum_j sc_j * x's per-16 sums, one vpmaddwd) comes off, then
    // acc += isum * (d * d_x), and for Q4_K/Q5_K acc -= msum * (dmin * d_x), both sums folded
    // and converted together. The same instructions on every path (avx512.h calls it too).
    static inline float step(const XQuant& a, __m256i isum, __m256i sc16, __m128i mn, float d,
                             float dmin, int64_t tok, int64_t b, float acc) {
        const int64_t K = a.K;
        if constexpr (TYPE == Q6_K) {
            const __m256i off = _mm256_madd_epi16(load(a.sk16 + tok * (K / 16) + b * 16), sc16);
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));
        }
        const float dx = a.dk[tok * (K / 256) + b];
        const __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
        if constexpr (TYPE == Q6_K) {
            const __m128i i2 = _mm_add_epi32(i4, _mm_unpackhi_epi64(i4, i4));
            const __m128 f = _mm_cvtepi32_ps(_mm_add_epi32(i2, _mm_shuffle_epi32(i2, 1)));
            return std::fma(_mm_cvtss_f32(f), d * dx, acc);
        } else {
            const __m128i m4 = _mm_madd_epi16(load128(a.sk32 + tok * (K / 32) + b * 8), mn);
            const __m128i h = _mm_hadd_epi32(i4, _mm_sub_epi32(_mm_setzero_si128(), m4));
            const __m128 f = _mm_cvtepi32_ps(_mm_hadd_epi32(h, h));
            acc = std::fma(_mm_cvtss_f32(f), d * dx, acc);
            return std::fma(_mm_cvtss_f32(_mm_movehdup_ps(f)), dmin * dx, acc);
        }
    }

    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int64_t K = a.K, nb = K / 256;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            float acc[TT] = {};
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = row + b * BYTES;
                prefetch(blk, BYTES);
                __m256i q[8], sc[4], sc16;
                __m128i mn;
                float d, dmin;
                unpack(blk, q, sc, sc16, mn, d, dmin);
                for (int t = 0; t < TT; ++t) {
                    const int64_t tok = t0 + t;
                    const int8_t* xq = a.qk + tok * K + b * 256;
                    __m256i s[8];
                    for (int j = 0; j < 8; ++j) s[j] = _mm256_maddubs_epi16(q[j], load(xq + 32 * j));
                    __m256i isum;
                    if constexpr (TYPE == Q4_K) {
                        const __m256i h = _mm256_hadd_epi16(
                            _mm256_hadd_epi16(_mm256_hadd_epi16(s[0], s[1]), _mm256_hadd_epi16(s[2], s[3])),
                            _mm256_hadd_epi16(_mm256_hadd_epi16(s[4], s[5]), _mm256_hadd_epi16(s[6], s[7])));
                        isum = _mm256_madd_epi16(h, sc[0]);
                    } else if constexpr (TYPE == Q5_K) {
                        const __m256i h0 = _mm256_hadd_epi16(_mm256_hadd_epi16(s[0], s[1]),
                                                             _mm256_hadd_epi16(s[2], s[3]));
                        const __m256i h1 = _mm256_hadd_epi16(_mm256_hadd_epi16(s[4], s[5]),
                                                             _mm256_hadd_epi16(s[6], s[7]));
                        isum = _mm256_add_epi32(_mm256_madd_epi16(h0, sc[0]), _mm256_madd_epi16(h1, sc[1]));
                    } else {
                        const __m256i p0 = _mm256_madd_epi16(_mm256_hadd_epi16(s[0], s[1]), sc[0]);
                        const __m256i p1 = _mm256_madd_epi16(_mm256_hadd_epi16(s[2], s[3]), sc[1]);
                        const __m256i p2 = _mm256_madd_epi16(_mm256_hadd_epi16(s[4], s[5]), sc[2]);
                        const __m256i p3 = _mm256_madd_epi16(_mm256_hadd_epi16(s[6], s[7]), sc[3]);
                        isum = _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3));
                    }
                    acc[t] = step(a, isum, sc16, mn, d, dmin, tok, b, acc[t]);
                }
            }
            for (int t = 0; t < TT; ++t) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
};

// F32/F16/BF16 weights against float32 x: 16 values per step into two accumulators (so the
// fma latency is not the limit at one token), then 8, then one at a time into a scalar.
template <int TYPE>
inline __m256 load8(const uint8_t* p) {
    if constexpr (TYPE == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    else if constexpr (TYPE == F16) return _mm256_cvtph_ps(load128(p));
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p)), 16));
}

template <int TYPE>
struct Float {
    static constexpr int ES = TYPE == F32 ? 4 : 2;  // bytes per value
    static constexpr int TILE = 4;

    template <int TT>
    static void rows(const XQuant& a, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t t0, float* y, int64_t ldy) {
        const int64_t K = a.K;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            __m256 acc0[TT], acc1[TT];
            float tail[TT];
            for (int t = 0; t < TT; ++t)
                acc0[t] = _mm256_setzero_ps(), acc1[t] = _mm256_setzero_ps(), tail[t] = 0.f;
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                prefetch(row + k * ES, 16 * ES);
                const __m256 w0 = load8<TYPE>(row + k * ES), w1 = load8<TYPE>(row + (k + 8) * ES);
                for (int t = 0; t < TT; ++t) {
                    const float* x = a.xf + (t0 + t) * K + k;
                    acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc0[t]);
                    acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc1[t]);
                }
            }
            if (k + 8 <= K) {
                const __m256 w0 = load8<TYPE>(row + k * ES);
                for (int t = 0; t < TT; ++t)
                    acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a.xf + (t0 + t) * K + k), acc0[t]);
                k += 8;
            }
            for (; k < K; ++k) {
                const float v = float_value(TYPE, row, k);
                for (int t = 0; t < TT; ++t) tail[t] = std::fma(v, a.xf[(t0 + t) * K + k], tail[t]);
            }
            for (int t = 0; t < TT; ++t)
                y[(t0 + t) * ldy + r] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + tail[t];
        }
    }
};

}  // namespace ember_blocks::avx2
