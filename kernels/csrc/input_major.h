// The input-major tile layout of a weight W (N outputs, K inputs) that the input-sparse matmul
// reads (input_sparse.cpp; Python side, byte reference and plain matmul reference:
// kernels/input_sparse.py, kernels/tile_layout.py), and the vector policies its kernel is
// written over.
//
// The layout keeps the file's own bytes, re-ordered: nothing is rounded again. In every GGML
// type it reads, a weight is a * q + b with q the stored integer and (a, b) per output row and
// sub-block of inputs (Q4_K: a = d * sc, b = -dmin * m per 32 inputs; Q6_K: a = d * sc per 16,
// q - 32; Q8_0: a = d per 32, ...). So the products of a sub-block's kept inputs can be summed
// first, acc[o] = sum x_i * q[i, o] and sx = sum x_i, then y[o] += a * acc[o] + b * sx.
//
// Per super-block of QK inputs (the file's block: 256 for K-quants, 32 for the others), for
// all Np = N rounded up to 64 outputs (the padding rows are zero bytes):
//   header: each row's header fields side by side across rows ("SoA"): d[Np] (fp16),
//           then dmin/m[Np] (fp16) where the type has one, then each of the K-quants' scale
//           bytes j as bytes[Np] (12 packed 6-bit scale/min bytes of Q4_K/Q5_K, 16 int8 of
//           Q6_K): the file's bytes, verbatim.
//   then for each of the QK inputs, one run of the whole column: its low bits (4 bits per
//           row, or Q8_0's int8) for every group of 64 rows, then its high bits (Q5: 1 bit,
//           Q6_K: 2 bits per row) for every group.
// In a group of 64 rows (r = 0..63): 4-bit byte j holds row j (low nibble) and row 32 + j
// (high nibble); Q8_0 byte j is row j; the Q5 high bits are one little-endian 64-bit word,
// bit r for row r; Q6_K high byte j holds rows j, 16 + j, 32 + j, 48 + j at bits 0-1, 2-3,
// 4-5, 6-7.
//
// Why whole columns: a dropped input saves its run only if the memory system does not fetch
// it anyway. Measured on this project's EPYC (2 threads, 512 MiB buffer, half the runs read
// at random): runs of 64-1024 bytes read no faster than all of them (0.6-0.8x the time
// saved), 16 KiB runs gave 1.15x. A thread owns a range of 64-row groups and reads each
// kept input's run over its rows (N/2 bytes per thread in a 4-bit column), prefetched a
// super-block ahead into L2 as whole runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_formats.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EMBER_IM_AVX2 1
#endif
#if defined(EMBER_IM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define EMBER_IM_AVX512 1
#endif

namespace ember_im {

using namespace ember_blocks;

constexpr int GROUP = 64;  // rows per group: a thread's unit, and one pass of the AVX-512 kernel

constexpr bool tiled_type(int64_t t) {
    return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K ||
           t == Q5_K || t == Q6_K || t == F32 || t == F16 || t == BF16;
}
constexpr bool k_quant(int t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
// Float weights: no header; the run holds the values themselves (a = 1, super-blocks of 32).
constexpr bool float_type(int t) { return t == F32 || t == F16 || t == BF16; }
constexpr int super_inputs(int t) { return k_quant(t) ? 256 : 32; }  // QK
constexpr int sub_inputs(int t) { return t == Q6_K ? 16 : 32; }       // inputs per (a, b)
constexpr bool has_min(int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }
constexpr int header_bytes(int t) {  // per row and super-block
    return float_type(t) ? 0 : t == Q4_K || t == Q5_K ? 16 : t == Q6_K ? 18 : has_min(t) ? 4 : 2;
}
constexpr int low_bytes(int t) {  // per input and group
    return t == F32 ? 256 : float_type(t) ? 128 : t == Q8_0 ? 64 : 32;
}
constexpr int high_bytes(int t) {
    return t == Q5_0 || t == Q5_1 || t == Q5_K ? 8 : t == Q6_K ? 16 : 0;
}
constexpr int q_offset(int t) { return t == Q4_0 ? -8 : t == Q5_0 ? -16 : t == Q6_K ? -32 : 0; }
// The 4-, 5- and 6-bit types run on integers: x rounded to int8 per block of the file's block
// inputs, as the dense kernel rounds it (block_matmul), and sums of q * x in int16 lanes,
// moved to int32 every `flush_every` inputs, before any could overflow (|q| * 127 * n < 2^15).
// Q8_0 and the float types run in float (an int8 q times an int8 x overflows int16 at 3 inputs).
constexpr bool int_type(int t) { return t != Q8_0 && !float_type(t); }
constexpr int max_abs_q(int t) {
    return t == Q4_0 ? 8 : t == Q5_0 ? 16 : t == Q6_K ? 32 : high_bytes(t) ? 31 : 15;
}
constexpr int flush_every(int t) { return 32767 / (127 * max_abs_q(t)); }

// Where a weight's super-blocks, headers and input runs lie.
struct Tiles {
    int type = Q4_K;
    int64_t N = 0, K = 0;
    int64_t padded() const { return (N + GROUP - 1) / GROUP * GROUP; }  // Np
    int64_t groups() const { return padded() / GROUP; }
    int64_t supers() const { return K / super_inputs(type); }
    int64_t header() const { return padded() * header_bytes(type); }
    int64_t run() const { return groups() * (low_bytes(type) + high_bytes(type)); }
    int64_t super_bytes() const { return header() + super_inputs(type) * run(); }
    int64_t bytes() const { return supers() * super_bytes(); }
    // input i (0..QK) of super-block kb: its low run; the high run follows groups()*low
    int64_t input_at(int64_t kb, int64_t i) const { return kb * super_bytes() + header() + i * run(); }
    int64_t high_at() const { return groups() * low_bytes(type); }
};

// The stored value of row r (0..63) of a group, with the type's offset: w = a * (this) + b.
template <int TYPE>
inline float tile_q(const uint8_t* lo, const uint8_t* hi, int r) {
    if constexpr (TYPE == F32) return f32(lo + 4 * r);
    if constexpr (TYPE == F16) return fp16(lo + 2 * r);
    if constexpr (TYPE == BF16) return bf16(lo + 2 * r);
    if constexpr (TYPE == Q8_0) return int8_t(lo[r]);
    int q = (lo[r % 32] >> (4 * (r / 32))) & 15;
    if constexpr (high_bytes(TYPE) == 8) q |= ((hi[r / 8] >> (r % 8)) & 1) << 4;
    if constexpr (TYPE == Q6_K) q |= ((hi[r % 16] >> (2 * (r / 16))) & 3) << 4;
    return float(q + q_offset(TYPE));
}

// A K-quant's 6-bit scale (and min) of sub-block s for rows r: from the 12 packed bytes (Q4_K,
// Q5_K: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scale) and 4-7 (min); 4-7 in the
// nibbles of bytes 8-11 and the top two bits of bytes 0-3 / 4-7), or Q6_K's int8.
inline void k_scale_min(const uint8_t* scales, int64_t Np, int s, int r, int& sc, int& m) {
    if (s < 4) {
        sc = scales[s * Np + r] & 63;
        m = scales[(s + 4) * Np + r] & 63;
    } else {
        const int lo = scales[(s + 4) * Np + r];
        sc = (lo & 15) | ((scales[(s - 4) * Np + r] >> 6) << 4);
        m = (lo >> 4) | ((scales[s * Np + r] >> 6) << 4);
    }
}

#ifdef EMBER_IM_AVX512
// 16 rows' a = d * sc and b = -(dmin * m) from 16 bytes of scale/min: the products of the
// scalar version (one float rounding each), 16 at a time.
inline void scales16(__m128i sc, __m128i m, const float* d, const float* dmin, float* a, float* b) {
    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc))));
    const __m512 mm = _mm512_mul_ps(_mm512_loadu_ps(dmin), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
    const __m512i sign = _mm512_set1_epi32(int(0x80000000u));  // -x, as the scalar version
    _mm512_storeu_ps(b, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mm), sign)));
}
#endif

// Each row's (a, b) of sub-block s for the 64 rows of a group: d (and dmin) already as floats.
// Every path calls this one, so a and b are the same bits everywhere.
template <int TYPE>
inline void group_scales(const uint8_t* scales, int64_t Np, int s, const float* d,
                         const float* dmin, float* a, float* b) {
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
#ifdef EMBER_IM_AVX512
        const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15);
        for (int r = 0; r < GROUP; r += 16) {
            auto at = [&](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + j * Np + r)); };
            __m128i sc, m;
            if (s < 4) {
                sc = _mm_and_si128(at(s), m63);
                m = _mm_and_si128(at(s + 4), m63);
            } else {  // byte shifts as 16-bit shifts, masked
                const __m128i lo = at(s + 4), top_s = at(s - 4), top_m = at(s);
                const __m128i three = _mm_set1_epi8(3);
                sc = _mm_or_si128(_mm_and_si128(lo, m15),
                                  _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(top_s, 6), three), 4));
                m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), m15),
                                 _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(top_m, 6), three), 4));
            }
            scales16(sc, m, d + r, dmin + r, a + r, b + r);
        }
#else
        for (int r = 0; r < GROUP; ++r) {
            int sc, m;
            k_scale_min(scales, Np, s, r, sc, m);
            a[r] = d[r] * float(sc);
            b[r] = -(dmin[r] * float(m));
        }
#endif
    } else if constexpr (float_type(TYPE)) {
        for (int r = 0; r < GROUP; ++r) a[r] = 1.f;
    } else if constexpr (TYPE == Q6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(scales + s * Np);
        for (int r = 0; r < GROUP; ++r) a[r] = d[r] * float(sc[r]);
    } else {
        for (int r = 0; r < GROUP; ++r) a[r] = d[r];
        if constexpr (has_min(TYPE))
            for (int r = 0; r < GROUP; ++r) b[r] = dmin[r];
    }
}

// n fp16 values -> float (F16C where built for it: the same values).
inline void halves(const uint8_t* p, int n, float* out) {
    int i = 0;
#ifdef EMBER_IM_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(p + 2 * i))));
#endif
    for (; i < n; ++i) out[i] = fp16(p + 2 * i);
}

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
