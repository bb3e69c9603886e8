// The vector policies the input-sparse kernel (input_sparse.cpp) is written over: how a group
// of 64 rows of an input's run (input_major.h) becomes float or int16 lanes, per CPU path.
// Every path performs the same operations in the same order, so all give the same bits.
#pragma once

#include "input_major.h"

namespace ember_im {

// ---- vector policies ---------------------------------------------------------------------
// decode<TYPE>(lo, hi, pass, out): rows [pass * 4L, pass * 4L + 4L) of a group as 4 vectors
// of exact small-integer floats (the stored integer with its offset). The kernel then computes
// acc = fma(x_i, q, acc) per kept input in order, y = fma(a, acc, y), y = fma(b, sx, y): the
// same operations on every path, so every path gives the same bits.

struct Portable {
    static constexpr int L = 8;
    struct F { float v[L]; };
    static F zero() { return F{}; }
    static F set1(float s) { F f; for (float& v : f.v) v = s; return f; }
    static F load(const float* p) { F f; std::memcpy(f.v, p, sizeof f.v); return f; }
    static F fma(F a, F b, F c) {
        for (int i = 0; i < L; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
        return c;
    }
    static void store(float* y, F f) { std::memcpy(y, f.v, sizeof f.v); }
    static F mul(F a, F b) {
        for (int i = 0; i < L; ++i) a.v[i] *= b.v[i];
        return a;
    }
    static F load_i32(const int32_t* p) { F f; for (int i = 0; i < L; ++i) f.v[i] = float(p[i]); return f; }
    template <int TYPE>
    static void decode(const uint8_t* lo, const uint8_t* hi, int pass, F* out) {
        for (int r = 0; r < 4 * L; ++r)
            out[r / L].v[r % L] = tile_q<TYPE>(lo, hi, pass * 4 * L + r);
    }
};

#ifdef EMBER_IM_AVX2
struct Avx2 {
    static constexpr int L = 8;
    using F = __m256;
    template <int TYPE>  // 8 float weights from row r0
    static F floats(const uint8_t* lo, int r0) {
        if constexpr (TYPE == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(lo) + r0);
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + 2 * r0));
        if constexpr (TYPE == F16) return _mm256_cvtph_ps(h);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float s) { return _mm256_set1_ps(s); }
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static void store(float* y, F f) { _mm256_storeu_ps(y, f); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F load_i32(const int32_t* p) {
        return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    template <int TYPE>
    static void decode(const uint8_t* lo, const uint8_t* hi, int pass, F* out) {
        if constexpr (float_type(TYPE)) {
            for (int m = 0; m < 4; ++m) out[m] = floats<TYPE>(lo, pass * 32 + 8 * m);
            return;
        }
        const __m256i off = _mm256_set1_epi32(q_offset(TYPE));
        for (int m = 0; m < 4; ++m) {
            const int r0 = pass * 32 + 8 * m;  // first row of vector m
            __m256i v;
            if constexpr (TYPE == Q8_0) {
                v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo + r0)));
            } else {
                v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo + r0 % 32)));
                v = _mm256_and_si256(_mm256_srli_epi32(v, 4 * (r0 / 32)), _mm256_set1_epi32(15));
            }
            if constexpr (high_bytes(TYPE) == 8) {
                const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(hi[r0 / 8]),
                                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4));
            }
            if constexpr (TYPE == Q6_K) {
                __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi + r0 % 16)));
                h = _mm256_and_si256(_mm256_srli_epi32(h, 2 * (r0 / 16)), _mm256_set1_epi32(3));
                v = _mm256_or_si256(v, _mm256_slli_epi32(h, 4));
            }
            out[m] = _mm256_cvtepi32_ps(_mm256_add_epi32(v, off));
        }
    }
};
#endif

#ifdef EMBER_IM_AVX512
struct Avx512 {
    static constexpr int L = 16;
    using F = __m512;
    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float s) { return _mm512_set1_ps(s); }
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static void store(float* y, F f) { _mm512_storeu_ps(y, f); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F load_i32(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
    template <int TYPE>
    static void decode(const uint8_t* lo, const uint8_t* hi, int, F* out) {
        if constexpr (float_type(TYPE)) {
            for (int m = 0; m < 4; ++m) {
                if constexpr (TYPE == F32) {
                    out[m] = _mm512_loadu_ps(reinterpret_cast<const float*>(lo) + 16 * m);
                } else {
                    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 32 * m));
                    out[m] = TYPE == F16 ? _mm512_cvtph_ps(h)
                                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                }
            }
            return;
        }
        if constexpr (TYPE == Q8_0) {
            for (int m = 0; m < 4; ++m)
                out[m] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + 16 * m))));
            return;
        }
        // The nibble's value by table lookup (vpermps reads the low 4 index bits, so the high
        // nibble needs a shift and no mask): rows 0-15, 16-31 low, then 32-47, 48-63 high.
        constexpr bool five = high_bytes(TYPE) == 8;
        constexpr float o = q_offset(TYPE);  // exact: (q + o) + 16 * high is an integer
        const __m512 lut = _mm512_setr_ps(o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7,
                                          o + 8, o + 9, o + 10, o + 11, o + 12, o + 13, o + 14, o + 15);
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + 16)));
        out[0] = _mm512_permutexvar_ps(v0, lut);
        out[1] = _mm512_permutexvar_ps(v1, lut);
        out[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), lut);
        out[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), lut);
        if constexpr (five) {  // + 16 where the row's fifth bit is set
            uint64_t h;
            std::memcpy(&h, hi, 8);
            const __m512 sixteen = _mm512_set1_ps(16.f);
            for (int m = 0; m < 4; ++m)
                out[m] = _mm512_mask_add_ps(out[m], __mmask16(h >> (16 * m)), out[m], sixteen);
        }
        if constexpr (TYPE == Q6_K) {  // + 16 * (two high bits): a table on their low 2 bits
            const __m512 hl = _mm512_setr_ps(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48);
            const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
            for (int m = 0; m < 4; ++m)
                out[m] = _mm512_add_ps(out[m], _mm512_permutexvar_ps(_mm512_srli_epi32(h, 2 * m), hl));
        }
    }
};
#endif

// ---- integer policies: 64 rows of a group as int16 lanes (q with its offset) ---------------
// decode16<TYPE>(lo, hi, out): rows 0..63 in order, NV vectors of W lanes; madd: acc += q * x;
// flush: dst[0..64) += the lanes, widened to int32. Integer sums are exact, so every path (and
// every flush schedule) gives the same sums.

struct PortableInt {
    static constexpr int NV = 1;
    struct V { int32_t v[GROUP]; };
    static V zero() { return V{}; }
    template <int TYPE>
    static void decode16(const uint8_t* lo, const uint8_t* hi, V* out) {
        for (int r = 0; r < GROUP; ++r) out[0].v[r] = int(tile_q<TYPE>(lo, hi, r));
    }
    static V madd(V acc, const V& q, int x) {
        for (int r = 0; r < GROUP; ++r) acc.v[r] += q.v[r] * x;
        return acc;
    }
    static void flush(const V* acc, int32_t* dst) {
        for (int r = 0; r < GROUP; ++r) dst[r] += acc[0].v[r];
    }
};

#ifdef EMBER_IM_AVX2
struct Avx2Int {
    static constexpr int NV = 4;  // 16 rows each: 0-15, 16-31, 32-47, 48-63
    using V = __m256i;
    static V zero() { return _mm256_setzero_si256(); }
    template <int TYPE>
    static void decode16(const uint8_t* lo, const uint8_t* hi, V* out) {
        const __m256i m15 = _mm256_set1_epi16(15);
        for (int h = 0; h < 2; ++h) {  // bytes 16h.. hold rows 16h.. (low) and 32 + 16h.. (high)
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + 16 * h)));
            out[h] = _mm256_and_si256(w, m15);
            out[2 + h] = _mm256_srli_epi16(w, 4);
        }
        if constexpr (high_bytes(TYPE) == 8) {  // bit r of 8 bytes: row r's fifth bit
            const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024,
                                                  2048, 4096, 8192, 16384, -32768);
            for (int v = 0; v < 4; ++v) {
                uint16_t h16;
                std::memcpy(&h16, hi + 2 * v, 2);
                const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(short(h16)), bit), bit);
                out[v] = _mm256_or_si256(out[v], _mm256_and_si256(set, _mm256_set1_epi16(16)));
            }
        }
        if constexpr (TYPE == Q6_K) {  // byte j: rows j, 16 + j, 32 + j, 48 + j at bits 0, 2, 4, 6
            const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
            const __m256i three = _mm256_set1_epi16(3);
            for (int v = 0; v < 4; ++v)
                out[v] = _mm256_or_si256(out[v], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * v), three), 4));
        }
        if constexpr (q_offset(TYPE) != 0)
            for (int v = 0; v < 4; ++v) out[v] = _mm256_add_epi16(out[v], _mm256_set1_epi16(q_offset(TYPE)));
    }
    static V madd(V acc, V q, int x) {
        return _mm256_add_epi16(acc, _mm256_mullo_epi16(q, _mm256_set1_epi16(short(x))));
    }
    static void flush(const V* acc, int32_t* dst) {
        for (int v = 0; v < 4; ++v)
            for (int h = 0; h < 2; ++h) {
                __m256i* d = reinterpret_cast<__m256i*>(dst + 16 * v + 8 * h);
                const __m128i part = h ? _mm256_extracti128_si256(acc[v], 1) : _mm256_castsi256_si128(acc[v]);
                _mm256_storeu_si256(d, _mm256_add_epi32(_mm256_loadu_si256(d), _mm256_cvtepi16_epi32(part)));
            }
    }
};
#endif

#ifdef EMBER_IM_AVX512
struct Avx512Int {
    static constexpr int NV = 2;  // rows 0-31 (low nibbles), 32-63 (high nibbles)
    using V = __m512i;
    static V zero() { return _mm512_setzero_si512(); }
    template <int TYPE>
    static void decode16(const uint8_t* lo, const uint8_t* hi, V* out) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
        out[0] = _mm512_and_si512(w, _mm512_set1_epi16(15));
        out[1] = _mm512_srli_epi16(w, 4);
        if constexpr (high_bytes(TYPE) == 8) {  // + 16 where bit r is set
            uint64_t h;
            std::memcpy(&h, hi, 8);
            const __m512i sixteen = _mm512_set1_epi16(16);
            out[0] = _mm512_mask_add_epi16(out[0], __mmask32(h), out[0], sixteen);
            out[1] = _mm512_mask_add_epi16(out[1], __mmask32(h >> 32), out[1], sixteen);
        }
        if constexpr (TYPE == Q6_K) {  // lanes 0-15 and 16-31 of each take bits 4v, 4v + 2
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
            const __m512i h = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(b));
            const __m512i three = _mm512_set1_epi16(3);
            for (int v = 0; v < 2; ++v) {
                const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16(short(4 * v)),
                                                      _mm256_set1_epi16(short(4 * v + 2)), 1);
                out[v] = _mm512_or_si512(out[v], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, sh), three), 4));
            }
        }
        if constexpr (q_offset(TYPE) != 0)
            for (int v = 0; v < 2; ++v) out[v] = _mm512_add_epi16(out[v], _mm512_set1_epi16(q_offset(TYPE)));
    }
    static V madd(V acc, V q, int x) {
        return _mm512_add_epi16(acc, _mm512_mullo_epi16(q, _mm512_set1_epi16(short(x))));
    }
    static void flush(const V* acc, int32_t* dst) {
        for (int v = 0; v < 2; ++v)
            for (int h = 0; h < 2; ++h) {
                int32_t* d = dst + 32 * v + 16 * h;
                const __m256i part = h ? _mm512_extracti64x4_epi64(acc[v], 1) : _mm512_castsi512_si256(acc[v]);
                _mm512_storeu_si512(d, _mm512_add_epi32(_mm512_loadu_si512(d), _mm512_cvtepi16_epi32(part)));
            }
    }
};
#endif

}  // namespace ember_im
