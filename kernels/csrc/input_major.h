// The input-major ("column-major") block layout of a weight W (N outputs, K inputs) that the
// input-sparse matmul reads (input_sparse.cpp; Python side and reference:
// kernels/input_sparse.py), and the three vector policies its kernels are written over.
//
// Layout: outputs in chunks of CHUNK = 256 (the last chunk may be shorter, a whole number of
// 32-value blocks). Chunk c stores, for each input column i in order, the GGML row of
// W[c*256 : c*256 + n_c, i] in 32-value blocks of Q4_0, Q5_0 or Q8_0 (the file's own block
// bytes, so models/quants.py decodes them). A thread that owns a chunk streams it front to back
// when every input survives (dense: no worse than the row-major file) and skips whole
// column rows when inputs are dropped.
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
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define EMBER_IM_AVX512 1
#endif

namespace ember_im {

using namespace ember_blocks;

constexpr int BLOCK = 32, CHUNK = 256, CHUNK_BLOCKS = CHUNK / BLOCK;

constexpr int block_bytes(int type) { return type == Q4_0 ? 18 : type == Q5_0 ? 22 : 34; }
constexpr bool im_type(int64_t type) { return type == Q4_0 || type == Q5_0 || type == Q8_0; }

// Where chunk c and column i of a weight start, and how many blocks chunk c holds.
struct Layout {
    int type = Q8_0;
    int64_t N = 0, K = 0;
    int64_t chunks() const { return (N + CHUNK - 1) / CHUNK; }
    int64_t blocks_in(int64_t c) const {
        const int64_t left = N / BLOCK - c * CHUNK_BLOCKS;
        return left < CHUNK_BLOCKS ? left : CHUNK_BLOCKS;
    }
    int64_t row_bytes(int64_t c) const { return blocks_in(c) * block_bytes(type); }
    int64_t chunk_offset(int64_t c) const { return c * K * CHUNK_BLOCKS * block_bytes(type); }
    int64_t bytes() const { return N / BLOCK * K * block_bytes(type); }
};

// ---- quantizers (the rules of models/quantize.py, bit for bit) ------------------------------

inline uint16_t to_fp16(float v) { return c10::detail::fp16_ieee_from_fp32_value(v); }

// The value of largest magnitude with its sign, the first on ties.
inline float signed_absmax(const float* x) {
    float m = x[0];
    for (int i = 1; i < BLOCK; ++i)
        if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
    return m;
}

inline float inverse(float d) { return d == 0.f ? 0.f : 1.f / d; }

// 32 values -> one block of `type` at out.
inline void quantize_block32(int type, const float* x, uint8_t* out) {
    if (type == Q8_0) {
        float amax = 0.f;
        for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float d = amax / 127.f, id = inverse(d);
        const uint16_t h = to_fp16(d);
        std::memcpy(out, &h, 2);
        for (int i = 0; i < BLOCK; ++i) {
            const float r = std::round(x[i] * id);  // half away from zero, as roundf
            out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::min(127.f, std::max(-128.f, r))));
        }
        return;
    }
    const float levels = type == Q4_0 ? 8.f : 16.f, top = 2 * levels - 1;
    const float d = signed_absmax(x) / -levels, id = inverse(d);
    const uint16_t h = to_fp16(d);
    std::memcpy(out, &h, 2);
    int q[BLOCK];
    for (int i = 0; i < BLOCK; ++i) {
        const float v = std::trunc(rounded(x[i] * id) + (levels + 0.5f));
        q[i] = static_cast<int>(std::min(top, std::max(0.f, v)));
    }
    uint8_t* qs = out + 2;
    if (type == Q5_0) {
        uint32_t qh = 0;
        for (int i = 0; i < BLOCK; ++i) qh |= uint32_t(q[i] >> 4) << i;
        std::memcpy(out + 2, &qh, 4);
        qs = out + 6;
    }
    for (int i = 0; i < 16; ++i) qs[i] = uint8_t((q[i] & 15) | ((q[i + 16] & 15) << 4));
}

// ---- vector policies: 32 weights of a block as floats (q - offset), times s, added up ---------
// Every policy computes each output as acc = fma(x_j * d_j, q_j - offset, acc) over the inputs
// in order, so all paths give the same bits (and one output's bits never depend on which other
// outputs or rows share the call).

struct Portable {
    static constexpr int L = 8;
    struct F { float v[L]; };
    static F zero() { return F{}; }
    static F set1(float s) { F f; for (float& v : f.v) v = s; return f; }
    static F fma(F a, F b, F c) {
        for (int i = 0; i < L; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
        return c;
    }
    static void store(float* y, F f) { std::memcpy(y, f.v, sizeof f.v); }
    static void prefetch(const void* p) { __builtin_prefetch(p); }
    static float half(const uint8_t* p) { return fp16(p); }
    template <int TYPE>
    static void decode(const uint8_t* blk, F* out) {  // 32 / L vectors
        int32_t q[BLOCK];
        float d, m;
        decode32(TYPE, blk, q, d, m);
        const int off = TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : 0;
        for (int i = 0; i < BLOCK; ++i) out[i / L].v[i % L] = float(q[i] - off);
    }
};

#ifdef EMBER_IM_AVX2
// What both x86 policies share.
struct X86 {
    static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
    static float half(const uint8_t* p) {  // F16C: the same value as fp16(), in one instruction
        uint16_t h;
        std::memcpy(&h, p, 2);
        return _cvtsh_ss(h);
    }
};

struct Avx2 : X86 {
    static constexpr int L = 8;
    using F = __m256;
    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float s) { return _mm256_set1_ps(s); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static void store(float* y, F f) { _mm256_storeu_ps(y, f); }
    template <int TYPE>
    static void decode(const uint8_t* blk, F* out) {
        if constexpr (TYPE == Q8_0) {
            for (int k = 0; k < 4; ++k)
                out[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k))));
            return;
        }
        const uint8_t* qs = blk + (TYPE == Q5_0 ? 6 : 2);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        const __m128i m4 = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        uint32_t qh = 0;
        if constexpr (TYPE == Q5_0) std::memcpy(&qh, blk + 2, 4);
        const __m256i off = _mm256_set1_epi32(TYPE == Q4_0 ? 8 : 16);
        for (int k = 0; k < 4; ++k) {
            __m256i v = _mm256_cvtepu8_epi32(parts[k]);
            if constexpr (TYPE == Q5_0) {  // bit 8k + l of qh is value 8k + l's fifth bit
                const __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                const __m256i bits = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_set1_epi32(int(qh >> (8 * k))), sh), _mm256_set1_epi32(1));
                v = _mm256_or_si256(v, _mm256_slli_epi32(bits, 4));
            }
            out[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(v, off));
        }
    }
};
#endif

#ifdef EMBER_IM_AVX512
struct Avx512 : X86 {
    static constexpr int L = 16;
    using F = __m512;
    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float s) { return _mm512_set1_ps(s); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static void store(float* y, F f) { _mm512_storeu_ps(y, f); }
    template <int TYPE>
    static void decode(const uint8_t* blk, F* out) {
        if constexpr (TYPE == Q8_0) {
            for (int k = 0; k < 2; ++k)
                out[k] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * k))));
            return;
        }
        // q - offset as floats by table lookup (vpermps reads the low 4 or 5 index bits):
        // no int-to-float conversion and no masking of the low nibble.
        const uint8_t* qs = blk + (TYPE == Q5_0 ? 6 : 2);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        const __m512i hi = _mm512_srli_epi32(v, 4);
        if constexpr (TYPE == Q4_0) {
            const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
            out[0] = _mm512_permutexvar_ps(v, lut);
            out[1] = _mm512_permutexvar_ps(hi, lut);
        } else {  // Q5_0: the nibble's value - 16, plus 16 where qh has value i's fifth bit
            const __m512 lut = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
            uint32_t qh;
            std::memcpy(&qh, blk + 2, 4);
            const __m512 sixteen = _mm512_set1_ps(16.f);
            const __m512 lo = _mm512_permutexvar_ps(v, lut), hf = _mm512_permutexvar_ps(hi, lut);
            out[0] = _mm512_mask_add_ps(lo, __mmask16(qh & 0xffff), lo, sixteen);
            out[1] = _mm512_mask_add_ps(hf, __mmask16(qh >> 16), hf, sixteen);
        }
    }
};
#endif

}  // namespace ember_im
