// The 16-value vector types the attention kernels (attention_simd.h) run on: Avx512, one
// register, and Avx2, two registers side by side. Each gives the kernels the same operations
// lane for lane (loads that convert float16 as they load, fmas, attention_math.h's exp, lane
// masks, the sums of up to 16 accumulators by one transposing network), so every path gives
// the same bits.
#pragma once

#include <cstdint>

#include "attention_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EMBER_ATTENTION_AVX2 1
#endif
#if defined(EMBER_ATTENTION_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define EMBER_ATTENTION_AVX512 1
#endif

// The tile kernels keep their accumulators in registers only when every helper is inlined
// (a helper taking them by pointer put them on the stack, zeroed, each tile).
#define EMBER_INLINE inline __attribute__((always_inline))

namespace ember_attention {

#ifdef EMBER_ATTENTION_AVX2
// exp_neg on 8 lanes (the same formula).
inline __m256 exp_neg8(__m256 x) {
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO),
                                     _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x));
    __m256 p = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_and_ps(ok, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e)));
}

// Lanes 0..7 and 8..15 of a 16-lane vector in two AVX2 registers.
struct Avx2 {
    struct T {
        __m256 lo, hi;
    };
    // score tiles: 8 accumulators (16 registers) at most, but 5 or 6 heads (a row's grouped
    // heads) take one key a tile: 12 registers, the query vectors read by the fmas from L1,
    // each key converted once (heads in pairs, 2 keys a tile, took float copies of the keys and
    // values: the 1.5B's 6k decode attention ~2x AVX-512's on Zen 4). KN_OF[3], [4] go unused
    // (groups of QN = 2 heads otherwise).
    static constexpr int QN = 2, QN_MAX = 6, KN_OF[7] = {0, 4, 2, 1, 1, 1, 1};
    static constexpr int MAX_W = 2;                     // value columns per head: 2 x 16
    static T zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static T load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static T load(const uint16_t* h) {  // 16 float16 values, converted as they load
        return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))),
                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)))};
    }
    static T load(const Q8Row* r, int64_t i) {  // values i..i+15 of a Q8_0 row, converted
        const uint8_t* b = q8_block(r, i);
        const int8_t* q = q8_values(b, i);
        const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(q8_scale_bits(b)));
        auto eight = [&](const int8_t* p) {
            const __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
            return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w)), d);
        };
        return {eight(q), eight(q + 8)};
    }
    // values i..i+15 of a bfloat16 row: the upper halves of floats
    static T load(const Bf16Row* r, int64_t i) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(r) + i;
        auto eight = [](const uint16_t* p) {
            const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
        };
        return {eight(h), eight(h + 8)};
    }
    // a bfloat16 key's values i..i+15 as the score lanes take them (bf16_key_dim): its 32 dims
    // from i & ~31 as 16 pairs, the odd of each pair (the upper half of the pair's 32 bits)
    // where i % 32 == 0, else the even (the lower half, shifted up)
    static T load_key(const Bf16Row* r, int64_t i) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(r) + (i & ~int64_t(BF16_PAIRS - 1));
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16));
        if (i & LANES) return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
        const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        return {_mm256_castsi256_ps(_mm256_and_si256(lo, odd)), _mm256_castsi256_ps(_mm256_and_si256(hi, odd))};
    }
    // bf16_round of normal floats (attention weights: exp_neg gives 0 or normals)
    static T round_bf16(T x) {
        auto r = [](__m256 v) {
            const __m256i u = _mm256_castps_si256(v);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
            return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
        };
        return {r(x.lo), r(x.hi)};
    }
    static void store(float* p, T v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
    static T bcast(float x) { const __m256 b = _mm256_set1_ps(x); return {b, b}; }
    // Keeps x in registers (see SimdKernels::tile).
    static EMBER_INLINE void in_register(T& x) { asm("" : "+x"(x.lo), "+x"(x.hi)); }
    static T fma(T a, T b, T c) {
        return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    }
    static T add(T a, T b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
    static T exp_shifted(T x, float m) {
        const __m256 mv = _mm256_set1_ps(m);
        return {exp_neg8(_mm256_sub_ps(x.lo, mv)), exp_neg8(_mm256_sub_ps(x.hi, mv))};
    }
    // lanes i of each half with a <= g + i < b
    static T lanes_in(int g, int a, int b) {
        const __m256i i = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(g));
        const __m256i i8 = _mm256_add_epi32(i, _mm256_set1_epi32(8));
        const __m256i av = _mm256_set1_epi32(a), bv = _mm256_set1_epi32(b);
        auto in = [&](__m256i j) {
            return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(av, j), _mm256_cmpgt_epi32(bv, j)));
        };
        return {in(i), in(i8)};
    }
    static T keep(T x, int g, int a, int b) {
        const T m = lanes_in(g, a, b);
        return {_mm256_and_ps(x.lo, m.lo), _mm256_and_ps(x.hi, m.hi)};
    }
    static T keep_or(T x, int g, int a, int b, float other) {
        const T m = lanes_in(g, a, b);
        const __m256 o = _mm256_set1_ps(other);
        return {_mm256_blendv_ps(o, x.lo, m.lo), _mm256_blendv_ps(o, x.hi, m.hi)};
    }
    // The sums (tree16) of n <= 8 accumulators, in order, into out[0..n).
    static EMBER_INLINE void sums(const T* acc, int n, float* out) {
        __m256 s[8];
        for (int i = 0; i < 8; ++i) s[i] = i < n ? _mm256_add_ps(acc[i].lo, acc[i].hi) : _mm256_setzero_ps();
        __m256 z[4], w[2];
        for (int i = 0; i < 4; ++i)  // 4 apart: 128-bit halves; z[i] = [acc 2i | acc 2i+1]
            z[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
        for (int i = 0; i < 2; ++i)  // 2 apart
            w[i] = _mm256_add_ps(_mm256_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
        // lane 4L + e holds accumulator L + 2e
        const __m256 ordered = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, ordered);
        for (int i = 0; i < n; ++i) out[i] = tmp[i];
    }
    static T max(T a, T b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
    static float lane_max(T x) {
        alignas(32) float a[16];
        _mm256_store_ps(a, x.lo), _mm256_store_ps(a + 8, x.hi);
        float m = a[0];
        for (int i = 1; i < 16; ++i) m = a[i] > m ? a[i] : m;
        return m;
    }
    static float lane_tree(T x) {
        alignas(32) float a[16];
        _mm256_store_ps(a, x.lo), _mm256_store_ps(a + 8, x.hi);
        return tree16(a);
    }
    static void from_half(const uint16_t* h, int64_t n, float* out) {  // n % 16 == 0
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    }
    static void from_int8(const int8_t* q, float d, float* out) {  // 32 values
        const __m256 dv = _mm256_set1_ps(d);
        for (int i = 0; i < 32; i += 8) {
            const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), dv));
        }
    }
};
#endif

#ifdef EMBER_ATTENTION_AVX512
struct Avx512 {
    using T = __m512;
    // score tiles: up to 16 accumulators (QN = 5 or 6 only for a row's 5 or 6 grouped heads:
    // each key loaded once for all of them). 6 heads x 4 keys (24 accumulators) measured
    // 0.92-0.97x of 6 x 2 at 1k-6k keys (2026-12-03, the 1.5B's shapes): out of registers.
    static constexpr int QN = 4, QN_MAX = 6, KN_OF[7] = {0, 16, 8, 5, 4, 3, 2};
    static constexpr int MAX_W = 8;                           // value columns per head: 8 x 16
    static T zero() { return _mm512_setzero_ps(); }
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static T load(const uint16_t* h) {  // 16 float16 values, converted as they load
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    }
    static T load(const Q8Row* r, int64_t i) {  // values i..i+15 of a Q8_0 row, converted
        const uint8_t* b = q8_block(r, i);
        const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(q8_scale_bits(b)));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q8_values(b, i)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
    // values i..i+15 of a bfloat16 row: the upper halves of floats
    static T load(const Bf16Row* r, int64_t i) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(r) + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    }
    // a bfloat16 key's values i..i+15 as the score lanes take them (see Avx2::load_key)
    static T load_key(const Bf16Row* r, int64_t i) {
        const __m512i x = _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(r) + (i & ~int64_t(BF16_PAIRS - 1)));
        if (i & LANES) return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    // bf16_round of normal floats (attention weights: exp_neg gives 0 or normals)
    static T round_bf16(T x) {
        const __m512i u = _mm512_castps_si512(x);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
    static T bcast(float x) { return _mm512_set1_ps(x); }
    // Keeps x in a register: an empty asm that takes and gives it there (see SimdKernels::tile).
    static EMBER_INLINE void in_register(T& x) { asm("" : "+v"(x)); }
    static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T exp_shifted(T v, float m) {
        const __m512 x = _mm512_sub_ps(v, _mm512_set1_ps(m));
        const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_GE_OQ);
        const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO),
                                         _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x));
        __m512 p = _mm512_set1_ps(EXP_C[0]);
        for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[i]));
        const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
        const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
        return _mm512_maskz_mov_ps(ok, _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), e)));
    }
    static __mmask16 lanes_in(int g, int a, int b) {
        const int lo = a > g ? a - g : 0, hi = b - g < 16 ? b - g : 16;
        return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    }
    static T keep(T x, int g, int a, int b) { return _mm512_maskz_mov_ps(lanes_in(g, a, b), x); }
    static T keep_or(T x, int g, int a, int b, float other) {
        return _mm512_mask_mov_ps(_mm512_set1_ps(other), lanes_in(g, a, b), x);
    }
    static T max(T a, T b) { return _mm512_max_ps(a, b); }
    static float lane_max(T x) { return _mm512_reduce_max_ps(x); }
    // The sums (tree16) of n <= 16 accumulators, in order, into out[0..n).
    static EMBER_INLINE void sums(const T* acc, int n, float* out) {
        __m512 x[16], y[8], z[4], w[2];
        for (int i = 0; i < 16; ++i) x[i] = i < n ? acc[i] : _mm512_setzero_ps();
        for (int i = 0; i < 8; ++i)  // 8 apart: 256-bit halves
            y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
        for (int i = 0; i < 4; ++i)  // 4 apart: z[i]'s 128-bit lane L is accumulator 4i + L
            z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
        for (int i = 0; i < 2; ++i)  // 2 apart
            w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
        // lane 4L + e holds accumulator L + 4e
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, _mm512_permutexvar_ps(order, r));
        for (int i = 0; i < n; ++i) out[i] = tmp[i];
    }
    static float lane_tree(T x) {
        alignas(64) float a[16];
        _mm512_store_ps(a, x);
        return tree16(a);
    }
    static void from_half(const uint16_t* h, int64_t n, float* out) {  // n % 16 == 0
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
    }
    static void from_int8(const int8_t* q, float d, float* out) {  // 32 values
        const __m512 dv = _mm512_set1_ps(d);
        for (int i = 0; i < 32; i += 16) {
            const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), dv));
        }
    }
};
#endif

}  // namespace ember_attention
