// The input-major tile layout of a weight W (N outputs, K inputs) that the input-sparse matmul
// reads (input_sparse.cpp over the vector policies of input_major_vectors.h; built by
// tile_relayout.cpp; Python side, byte reference and plain matmul reference:
// kernels/input_sparse.py, kernels/tile_layout.py).
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

// The tiles of a (type, N, K) weight, or a ValueError naming `what` and the fault
// (tile_relayout.cpp).
Tiles checked_tiles(int64_t type, int64_t N, int64_t K, const char* what);

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

}  // namespace ember_im
