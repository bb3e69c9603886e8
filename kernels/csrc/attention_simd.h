// The attention kernels (attention.cpp) on 16-value vectors: one AVX-512 register, or two AVX2
// registers side by side. Both compute attention_math.h's operations in its order: a lane of
// a score's accumulator is lane l of attention_math.h's, the tree is the same tree, so every
// path gives the same bits (tests/test_attention.py checks it).
//
// Scores go in tiles of QN query vectors x KN keys, QN * KN accumulators in registers, each
// key (and query) value loaded once per tile; the 16 accumulators are then reduced together by
// a transposing network (each stage adds lanes 8, 4, 2, 1 apart: tree16 for every one of
// them), not one by one. Values go in runs of keys with NH heads' outputs (W vectors of 16
// columns each) held in registers, each value vector loaded once for the NH heads.
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

// The kernels over a vector type V (Avx2 or Avx512); head dims a multiple of 16.
template <class V>
struct SimdKernels {
    using T = typename V::T;
    // Whether a row's scores and values read float16 rows in place (converting as they load):
    // when its query heads per KV head fit one score tile and one block of values (see
    // values), so each key and value still converts once, as in a pass.
    static constexpr bool half_in_place(int64_t heads, int64_t hd) {
        return heads <= V::QN_MAX && (heads <= 3 || six_head_values(hd));
    }

    // Whether values take up to 6 heads in one block (else 3): 6 x 4 vectors on AVX-512 (head
    // dims a multiple of 64), 6 x 1 on AVX2 (12 of its 16 registers).
    static constexpr bool six_head_values(int64_t hd) { return V::MAX_W < 4 || hd / LANES % 4 == 0; }

    static void from_half(const uint16_t* h, int64_t n, float* out) { V::from_half(h, n, out); }
    static void from_int8(const int8_t* q, float d, float* out) { V::from_int8(q, d, out); }

    // Scores of QN query vectors against KN keys, times scale: out[i * KN + j]. Keys here (and
    // values below) are float (E), or float16 converted in registers as they load: a separate
    // conversion pass into scratch cost a quarter of the kernel's time (Zen 4 converts one
    // 16-value register per two cycles; the pass added a store and a reload of each). Each
    // query vector is loaded once into a register for its KN fmas: left to itself the
    // compiler folds the load into every fma, and a 6 x 2 tile's 14 loads (a 512-bit load a
    // cycle on Zen 4) to 12 fmas then bound it (the 1.5B's 6k decode attention 1.15-1.19x).
    template <int QN, int KN, class E>
    static EMBER_INLINE void tile(const float* const* q, const E* const* k, int64_t hd, float scale, float* out) {
        T acc[QN * KN];
        for (int i = 0; i < QN * KN; ++i) acc[i] = V::zero();
        for (int64_t d = 0; d < hd; d += LANES) {
            T kv[KN];
            for (int j = 0; j < KN; ++j) kv[j] = V::load(k[j] + d);
            for (int i = 0; i < QN; ++i) {
                T qv = V::load(q[i] + d);
                if constexpr (KN > 1) V::in_register(qv);
                for (int j = 0; j < KN; ++j) acc[i * KN + j] = V::fma(qv, kv[j], acc[i * KN + j]);
            }
        }
        float s[QN * KN];
        V::sums(acc, QN * KN, s);
        for (int i = 0; i < QN * KN; ++i) out[i] = s[i] * scale;
    }

    // QN query vectors against keys x0..x1-1: s[i * lds + x]. Keys past x1 in the last tile
    // repeat key x1 - 1 (their scores land in s's slack, never read). before_tile(a, b) runs
    // ahead of each tile, keys a..b-1 (attention.cpp prefetches there).
    template <int QN, class E, class Hook>
    static void score_rows(const float* const* q, const E* const* k, int x0, int x1, int64_t hd,
                           float scale, float* s, int lds, const Hook& before_tile) {
        constexpr int KN = V::KN_OF[QN];
        float out[QN * KN];
        for (int x = x0; x < x1; x += KN) {
            before_tile(x, x + KN < x1 ? x + KN : x1);
            const E* kx[KN];
            for (int j = 0; j < KN; ++j) kx[j] = k[x + j < x1 ? x + j : x1 - 1];
            tile<QN, KN>(q, kx, hd, scale, out);
            for (int i = 0; i < QN; ++i)
                for (int j = 0; j < KN; ++j) s[i * lds + x + j] = out[i * KN + j];
        }
    }

    // nq query vectors, in tiles of up to QN of them (5 or 6 in one tile); before_tile runs for
    // the first tiles' keys only, so once for each key.
    template <class E, class Hook = NoHook>
    static void scores(const float* const* q, int nq, const E* const* k, int x0, int x1,
                       int64_t hd, float scale, float* s, int lds, const Hook& before_tile = {}) {
        if constexpr (V::QN_MAX >= 6) {
            if (nq == 5) return score_rows<5>(q, k, x0, x1, hd, scale, s, lds, before_tile);
            if (nq == 6) return score_rows<6>(q, k, x0, x1, hd, scale, s, lds, before_tile);
        }
        for (int i = 0; i < nq;) {
            const int n = nq - i < V::QN ? nq - i : V::QN;
            float* si = s + static_cast<int64_t>(i) * lds;
            if (i == 0) score_group(n, q, k, x0, x1, hd, scale, si, lds, before_tile);
            else score_group(n, q + i, k, x0, x1, hd, scale, si, lds, NoHook{});
            i += n;
        }
    }

    // Keys in one of scores' first tiles for nq query vectors.
    static constexpr int tile_keys(int nq) {
        return V::QN_MAX >= 6 && (nq == 5 || nq == 6) ? V::KN_OF[nq] : V::KN_OF[nq < V::QN ? nq : V::QN];
    }

    // score_rows for a group of n <= QN query vectors
    template <class E, class Hook>
    static void score_group(int n, const float* const* q, const E* const* k, int x0, int x1, int64_t hd,
                            float scale, float* s, int lds, const Hook& before_tile) {
        switch (n) {
            case 1: score_rows<1>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
            case 2: score_rows<2>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
            case 3: if constexpr (V::QN >= 3) score_rows<3>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
            default: if constexpr (V::QN >= 4) score_rows<4>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
        }
    }

    // max of s[a..b) (exact in any order)
    static float max_of(const float* s, int a, int b) {
        T best = V::bcast(-INFINITY);
        for (int g = a & ~(LANES - 1); g < b; g += LANES) best = V::max(best, V::keep_or(V::load(s + g), g, a, b, -INFINITY));
        return V::lane_max(best);
    }

    // p[x] = exp(s[x] - m) for a <= x < b (zeros around it, within its 16-aligned groups);
    // returns their sum (lane per position mod 16, then tree16).
    static float exp_sum(const float* s, float* p, int a, int b, float m) {
        T acc = V::zero();
        for (int g = a & ~(LANES - 1); g < b; g += LANES) {
            const T e = V::keep(V::exp_shifted(V::load(s + g), m), g, a, b);
            V::store(p + g, e);
            acc = V::add(acc, e);
        }
        return V::lane_tree(acc);
    }

    // NH heads of one row, columns col..col + 16 W: o = sum over a <= x < b of p[h][x] v[x],
    // joined into O[h] as f[h] says.
    template <int W, int NH, class E>
    static EMBER_INLINE void value_block(const float* const* p, const E* const* v, int a, int b, int64_t col,
                            float* const* O, const Fold* f) {
        T acc[NH][W];
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < W; ++w) acc[h][w] = V::zero();
        for (int x = a; x < b; ++x) {
            const E* vx = v[x] + col;
            T vv[W];
            for (int w = 0; w < W; ++w) {
                vv[w] = V::load(vx + LANES * w);
                if constexpr (NH > 1) V::in_register(vv[w]);  // one load for the NH fmas (see tile)
            }
            // each head's weight broadcast just before its fmas: NH of them computed first
            // and held (AVX2's 6 x 1 block: 12 accumulators, 2 value and 6 weight registers)
            // left the compiler 20 registers to place in 16, and it spilled accumulators
            for (int h = 0; h < NH; ++h) {
                const T b = V::bcast(p[h][x]);
                for (int w = 0; w < W; ++w) acc[h][w] = V::fma(b, vv[w], acc[h][w]);
            }
        }
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < W; ++w) {
                float* o = O[h] + col + LANES * w;
                const T c = V::bcast(f[h].coef);
                switch (f[h].how) {
                    case Merge::FIRST: V::store(o, acc[h][w]); break;
                    case Merge::SCALE_CHUNK: V::store(o, V::fma(acc[h][w], c, V::load(o))); break;
                    case Merge::SCALE_RUNNING: V::store(o, V::fma(V::load(o), c, acc[h][w])); break;
                }
            }
    }

    // Heads in blocks of up to NH_MAX: each value vector loaded once per block (a load per
    // NH_MAX fmas, not per head: 8 x 16 columns and 3 heads took ~27 loads per 24 fmas).
    template <int W, int NH_MAX, class E>
    static void value_heads(const float* const* p, int nh, const E* const* v, int a, int b,
                            int64_t hd, float* const* O, const Fold* f) {
        for (int64_t col = 0; col < hd; col += LANES * W)
            for (int h = 0; h < nh; h += NH_MAX) {
                const int n = nh - h < NH_MAX ? nh - h : NH_MAX;
                switch (n) {
                    case 1: value_block<W, 1>(p + h, v, a, b, col, O + h, f + h); break;
                    case 2: value_block<W, 2>(p + h, v, a, b, col, O + h, f + h); break;
                    case 3: value_block<W, 3>(p + h, v, a, b, col, O + h, f + h); break;
                    case 4: if constexpr (NH_MAX >= 4) value_block<W, 4>(p + h, v, a, b, col, O + h, f + h); break;
                    case 5: if constexpr (NH_MAX >= 5) value_block<W, 5>(p + h, v, a, b, col, O + h, f + h); break;
                    default: if constexpr (NH_MAX >= 6) value_block<W, 6>(p + h, v, a, b, col, O + h, f + h); break;
                }
            }
    }

    template <class E>
    static void values(const float* const* p, int nh, const E* const* v, int a, int b,
                       int64_t hd, float* const* O, const Fold* f) {
        // 24 accumulator registers on AVX-512: 6 heads x 4 vectors, or 3 x 8 for 3 heads or
        // fewer; AVX2's 16 registers hold 6 heads x 1 or 3 x 2 (two registers each)
        const int64_t n16 = hd / LANES;
        if (nh > 3 && six_head_values(hd)) return value_heads<V::MAX_W >= 4 ? 4 : 1, 6>(p, nh, v, a, b, hd, O, f);
        if (V::MAX_W >= 8 && n16 % 8 == 0) return value_heads<V::MAX_W >= 8 ? 8 : 1, 3>(p, nh, v, a, b, hd, O, f);
        if (V::MAX_W >= 4 && n16 % 4 == 0) return value_heads<V::MAX_W >= 4 ? 4 : 1, 3>(p, nh, v, a, b, hd, O, f);
        if (n16 % 2 == 0) return value_heads<2, 3>(p, nh, v, a, b, hd, O, f);
        value_heads<1, 3>(p, nh, v, a, b, hd, O, f);
    }
};

}  // namespace ember_attention
