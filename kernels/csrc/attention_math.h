// The arithmetic of attend_slots_into (fused_ops.cpp): query-key scores four keys at a time,
// and exp for the softmax eight values at a time.
//
// Both are hot at long contexts: per decoded token and query head, one score and one exp per
// key (a 1.1B model at 1,024 tokens of context: ~720k of each per token). A plain dot product
// per key spent most of its time in its own horizontal sum, and std::exp is a scalar call.
//
// Every key's score is the same sequence of operations whichever of the four lanes it takes,
// or the one-key tail (an fma chain in 8 lanes, then one fixed tree: pairs, pairs of pairs,
// then the two 128-bit halves), and exp is one formula per value in the vector body and the
// scalar tail alike. So a row's attention depends only on its own keys, in order: the same
// bits alone, in a prompt chunk or in a speculative tree (batch invariance).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EMBER_ATTENTION_AVX2 1
#endif

namespace ember_attention {

// K/V pool elements: float32, or IEEE half (QuantModel's pools: half the bytes a long context
// reads, as llama.cpp's f16 cache). A half row is converted to float once
// (to_float) and then goes through the same float code.
using half_t = c10::Half;

// exp(x) for x <= 0 (softmax shifted by its max): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a
// degree-7 polynomial (the classic single-precision minimax fit, ~1 ulp), times 2^n by
// adding n to the exponent bits. Below -87 (exp < 1.6e-38, past float's normal range) 0.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_C[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float EXP_MIN = -87.0f;

inline float exp_neg(float x) {
    if (!(x >= EXP_MIN)) return 0.f;  // also NaN -> 0: never from finite scores
    const float n = std::nearbyint(x * LOG2E);
    const float r = std::fma(n, -LN2_LO, std::fma(n, -LN2_HI, x));
    float p = EXP_C[0];
    for (int i = 1; i < 6; ++i) p = std::fma(p, r, EXP_C[i]);
    const float y = std::fma(p, r * r, r) + 1.f;
    int32_t bits;
    std::memcpy(&bits, &y, 4);
    bits += static_cast<int32_t>(n) << 23;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

#ifdef EMBER_ATTENTION_AVX2
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
#endif

// v[i] = exp(v[i] - m) for i < n; returns their sum (8 partial sums, a fixed reduction, then
// the tail in order).
inline float exp_shifted(float* v, int64_t n, float m) {
    int64_t i = 0;
    float total = 0.f;
#ifdef EMBER_ATTENTION_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(v + i), mv));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
    for (; i < n; ++i) total += v[i] = exp_neg(v[i] - m);
    return total;
}

// n half values to float (exact).
inline void to_float(const half_t* x, int64_t n, float* out) {
    int64_t i = 0;
#ifdef EMBER_ATTENTION_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
    for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

#ifdef EMBER_ATTENTION_AVX2
// q . k in 8 lanes (hd % 8 == 0): one fma chain.
inline __m256 lanes_dot(const float* q, const float* k, int64_t hd) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int64_t i = 8; i < hd; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), s);
    return s;
}

// The four keys' lane sums, each reduced by the same tree: 4 x [a0+a1, a2+a3 | a4+a5, a6+a7]
// -> [(a0+a1)+(a2+a3) .. per key | (a4+a5)+(a6+a7) .. per key] -> the halves added.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// Scores of keys k[0..3] (each hd values) against q, times scale, into out[0..3]. Each key's
// lanes are lanes_dot's (a product, then an fma chain), with q's values loaded once for all four.
inline void scores4(const float* q, const float* const k[4], int64_t hd, float scale, float* out) {
#ifdef EMBER_ATTENTION_AVX2
    if (hd % 8 == 0) {
        __m256 qv = _mm256_loadu_ps(q);
        __m256 a = _mm256_mul_ps(qv, _mm256_loadu_ps(k[0])), b = _mm256_mul_ps(qv, _mm256_loadu_ps(k[1]));
        __m256 c = _mm256_mul_ps(qv, _mm256_loadu_ps(k[2])), d = _mm256_mul_ps(qv, _mm256_loadu_ps(k[3]));
        for (int64_t i = 8; i < hd; i += 8) {
            qv = _mm256_loadu_ps(q + i);
            a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a);
            b = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), b);
            c = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), c);
            d = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), d);
        }
        _mm_storeu_ps(out, _mm_mul_ps(reduce4(a, b, c, d), _mm_set1_ps(scale)));
        return;
    }
#endif
    for (int j = 0; j < 4; ++j) {
        float d = 0.f;
        for (int64_t i = 0; i < hd; ++i) d = std::fma(q[i], k[j][i], d);
        out[j] = d * scale;
    }
}

// One key's score, the same bits as in any lane of scores4.
inline float score1(const float* q, const float* k, int64_t hd, float scale) {
#ifdef EMBER_ATTENTION_AVX2
    if (hd % 8 == 0) {
        const __m256 a = lanes_dot(q, k, hd);
        return _mm_cvtss_f32(_mm_mul_ps(reduce4(a, a, a, a), _mm_set1_ps(scale)));
    }
#endif
    float d = 0.f;
    for (int64_t i = 0; i < hd; ++i) d = std::fma(q[i], k[i], d);
    return d * scale;
}

// o (hd values) += sum over j of p[j] * v[j] (each hd values), in j order, one fma per value
// and key. The output is held in registers (128, 64, then 8 values at a time, then one) while
// the run of keys passes: the same fma sequence for every value whatever the head dim.
#ifdef EMBER_ATTENTION_AVX2
// Columns c..c+8W of o over the run of keys, in W registers.
template <int W>
inline void accumulate_columns(float* o, const float* p, const float* const* v, int64_t n, int64_t c) {
    __m256 acc[W];
    for (int i = 0; i < W; ++i) acc[i] = _mm256_loadu_ps(o + c + 8 * i);
    for (int64_t j = 0; j < n; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < W; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v[j] + c + 8 * i), acc[i]);
    }
    for (int i = 0; i < W; ++i) _mm256_storeu_ps(o + c + 8 * i, acc[i]);
}
#endif

inline void accumulate(float* o, const float* p, const float* const* v, int64_t n, int64_t hd) {
    int64_t c = 0;
#ifdef EMBER_ATTENTION_AVX2
    // 128 columns at once where they come (one pass over a 7B head's values, not two: two
    // passes over 16 rows 16 KiB apart cost ~2x at long contexts), then 64, then 8.
    for (; c + 128 <= hd; c += 128) accumulate_columns<16>(o, p, v, n, c);
    for (; c + 64 <= hd; c += 64) accumulate_columns<8>(o, p, v, n, c);
    for (; c + 8 <= hd; c += 8) {
        __m256 acc = _mm256_loadu_ps(o + c);
        for (int64_t j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + c), acc);
        _mm256_storeu_ps(o + c, acc);
    }
#endif
    for (; c < hd; ++c) {
        float acc = o[c];
        for (int64_t j = 0; j < n; ++j) acc = std::fma(p[j], v[j][c], acc);
        o[c] = acc;
    }
}

}  // namespace ember_attention
