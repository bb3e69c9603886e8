// GGML block formats as block_matmul.cpp reads them: the table of types, x quantized for the
// integer dot products, and plain decoders shared by the portable path and dequantize_row.
// Byte layouts: models/quants.py (top of file).
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ember_blocks {

// GGML type ids (ggml.h numbering, as GGUF files store them).
enum : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12,
             Q5_K = 13, Q6_K = 14, BF16 = 30 };

// What a type's dot product multiplies: x as int8 per 32 values (Q8_0-style), int8 per 256
// values (Q8_K-style), or x itself in float32.
enum class XStyle { Q32, QK, F32 };

struct TypeInfo {
    int id;
    const char* name;
    int values, bytes;  // per block
    XStyle x;
};

// The types the kernel reads natively; the index into this table selects a type's kernel in
// each CPU path's table (block_matmul.cpp). A new type is one row here and one kernel per path.
constexpr TypeInfo TYPES[] = {
    {F32, "F32", 1, 4, XStyle::F32},      {F16, "F16", 1, 2, XStyle::F32},
    {BF16, "BF16", 1, 2, XStyle::F32},    {Q4_0, "Q4_0", 32, 18, XStyle::Q32},
    {Q4_1, "Q4_1", 32, 20, XStyle::Q32},  {Q5_0, "Q5_0", 32, 22, XStyle::Q32},
    {Q5_1, "Q5_1", 32, 24, XStyle::Q32},  {Q8_0, "Q8_0", 32, 34, XStyle::Q32},
    {Q4_K, "Q4_K", 256, 144, XStyle::QK}, {Q5_K, "Q5_K", 256, 176, XStyle::QK},
    {Q6_K, "Q6_K", 256, 210, XStyle::QK},
};
constexpr int N_TYPES = sizeof(TYPES) / sizeof(TYPES[0]);

constexpr int type_index(int64_t id) {
    for (int i = 0; i < N_TYPES; ++i)
        if (TYPES[i].id == id) return i;
    return -1;
}

// x quantized once per call, per row of x (so each row's values never depend on the others).
// Q8_0-style: per 32 values d = max|x| / 127, q = round-half-even(x * 127 / max|x|), the block's sum of q,
// and d * sum (the min term of Q4_1/Q5_1). Q8_K-style: the same per 256 values, with sums of q
// per 16 (Q6_K's offset term) and per 32 (Q4_K/Q5_K's min term). Pointers are to row 0; row t
// starts t * K values (or t * K / block) further on. Null where the call needs no such style.
struct XQuant {
    int64_t T = 0, K = 0;
    const float* xf = nullptr;                               // (T, K)
    const int8_t* q32 = nullptr;                             // (T, K)
    const float* d32 = nullptr;                              // (T, K/32)
    const int32_t* s32 = nullptr;                            // (T, K/32)
    const float* ds32 = nullptr;                             // (T, K/32)
    const int16_t* h32 = nullptr;  // (T, K/16): pair layout only, sums of q over half blocks
    const int8_t* qk = nullptr;                              // (T, K)
    const float* dk = nullptr;                               // (T, K/256)
    const int16_t* sk16 = nullptr;                           // (T, K/16)
    const int16_t* sk32 = nullptr;                           // (T, K/32)
    // The same Q8_K-style x for the prefill kernels (block_gemm_avx2.h), in tiles of 16 rows:
    // for each pair of values the 16 tokens side by side; per-token scalars in GEMM_ORDER.
    int64_t tiles = 0;                                       // T / 16 whole tiles, or 0
    const int8_t* qg = nullptr;                              // (tiles, K/2, 16, 2)
    const float* dg = nullptr;                               // (tiles, K/256, 16)
    const int16_t* m32g = nullptr;  // (tiles, K/64, 16, 2): the two per-32 sums of each 64
    const int16_t* s8g = nullptr;                            // (tiles, K/8, 16): per-8 sums
    // The AVX-512 prefill kernels' layout (block_gemm_avx512.h), where a path asks for it
    // instead: tiles of 16 rows again, token i of a tile in lane i.
    const int8_t* qq = nullptr;     // (tiles, K/4, 16, 4): each run of 4 values, 16 tokens
    const float* dq = nullptr;      // (tiles, K/256, 16)
    const int16_t* m32q = nullptr;  // (tiles, K/64, 16, 2): the two per-32 sums of each 64
    const int32_t* s16q = nullptr;  // (tiles, K/16, 16): per-16 sums
    // The Q8_0-style x (q32 above, natural order) for the AVX-512 prefill kernel of the
    // 32-value types (block_gemm_avx512.h SGemm), token i of a tile in lane i.
    const int8_t* qq32 = nullptr;   // (tiles, K/4, 16, 4)
    const float* d32q = nullptr;    // (tiles, K/32, 16)
    const int32_t* s32q = nullptr;  // (tiles, K/32, 16)
    const float* ds32q = nullptr;   // (tiles, K/32, 16)
};

constexpr int GEMM_TOKENS = 16;
// Weight rows per group of the prefill kernels that hold weight rows in lanes
// (block_gemm_lanes_avx512.h): the driver hands them rows in whole groups where it can.
constexpr int LANE_ROWS = 16;

// Block b of weight row r (rows row_bytes long, blocks BYTES): where the file has it, or in row
// groups, LANE_ROWS rows interleaved block by block (block b of rows 16g..16g+15 side by side,
// then block b + 1; kernels/block_matmul.py says who makes them).
template <bool GROUPED, int BYTES>
inline const uint8_t* block_at(const uint8_t* w, int64_t row_bytes, int64_t r, int64_t b) {
    if constexpr (GROUPED)
        return w + (r / LANE_ROWS) * LANE_ROWS * row_bytes + (b * LANE_ROWS + r % LANE_ROWS) * BYTES;
    else
        return w + r * row_bytes + b * BYTES;
}
// Token of each int32 lane of the prefill kernels' two accumulators (vpunpck order).
constexpr int GEMM_ORDER[GEMM_TOKENS] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// n values -> q, returns d = max|x| / 127, with q = round-half-even(x * (127 / max|x|)): one
// division per block (as llama.cpp), the same in the reference (block_matmul.py). A block
// whose max is 0, or so small that 127 / max overflows, is all zeros with d = 0. The clamp
// only guards against NaN/inf input.
// Also writes the sums of q over each run of 8 values (n / 8 of them) to sum8.
inline float quantize_block(const float* x, int n, int8_t* q, int16_t* sum8) {
    float amax = 0.f;
    for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, id = 127.f / amax;
    if (!(d > 0.f) || !std::isfinite(id)) {
        std::memset(q, 0, n);
        std::memset(sum8, 0, n / 8 * sizeof(int16_t));
        return 0.f;
    }
    for (int i = 0; i < n; ++i) {
        const float r = std::nearbyint(x[i] * id);
        q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
    }
    for (int i = 0; i < n / 8; ++i) {
        int s = 0;
        for (int j = 0; j < 8; ++j) s += q[8 * i + j];
        sum8[i] = static_cast<int16_t>(s);
    }
    return d;
}

// A row of n values in blocks of B (32 or 256): q, d per block, sums per 8 values.
inline void quantize_row(const float* x, int64_t n, int B, int8_t* q, float* d, int16_t* sum8) {
    for (int64_t b = 0; b < n / B; ++b) d[b] = quantize_block(x + b * B, B, q + b * B, sum8 + b * B / 8);
}

inline float fp16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline float bf16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float f32(const uint8_t* p) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
}

// Value k of a row of a float type.
inline float float_value(int type, const uint8_t* row, int64_t k) {
    return type == F32 ? f32(row + 4 * k) : type == F16 ? fp16(row + 2 * k) : bf16(row + 2 * k);
}

// Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales then 8 six-bit mins, as bytes sm[0..15].
// Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same
// for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high).
inline void k_scales(const uint8_t* s, uint8_t* sm) {
    uint32_t a, b, c;
    std::memcpy(&a, s, 4);
    std::memcpy(&b, s + 4, 4);
    std::memcpy(&c, s + 8, 4);
    const uint32_t out[4] = {a & 0x3f3f3f3fu, (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u),
                             b & 0x3f3f3f3fu, ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)};
    std::memcpy(sm, out, 16);
}

// One 32-value block of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 -> its quants as stored (unsigned 0..15 or
// 0..31; Q8_0 signed), the scale d and the min m (0 for types without one).
inline void decode32(int type, const uint8_t* blk, int32_t* q, float& d, float& m) {
    d = fp16(blk);
    m = (type == Q4_1 || type == Q5_1) ? fp16(blk + 2) : 0.f;
    if (type == Q8_0) {
        for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(blk[2 + i]);
        return;
    }
    const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) std::memcpy(&qh, blk + qs - 4, 4);
    for (int i = 0; i < 16; ++i) {
        q[i] = (blk[qs + i] & 15) | (((qh >> i) & 1) << 4);
        q[i + 16] = (blk[qs + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
}

// One 256-value K-quant block -> unsigned quants (0..15, 0..31 or 0..63), and the sub-block
// scales (Q4_K/Q5_K: 8 scales and 8 mins of 32 values; Q6_K: 16 signed scales of 16 values).
inline void decode_k(int type, const uint8_t* blk, int32_t* q, int32_t* sc, int32_t* mn) {
    if (type == Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int h = 0; h < 2; ++h)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < 32; ++l) {
                    const int lo = (ql[h * 64 + (k % 2) * 32 + l] >> (4 * (k / 2))) & 15;
                    const int hi = (qh[h * 32 + l] >> (2 * k)) & 3;
                    q[h * 128 + k * 32 + l] = lo | (hi << 4);
                }
        for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(blk[192 + j]);
        return;
    }
    uint8_t sm[16];
    k_scales(blk + 4, sm);
    for (int j = 0; j < 8; ++j) sc[j] = sm[j], mn[j] = sm[8 + j];
    const uint8_t* qs = blk + (type == Q4_K ? 16 : 48);
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            q[64 * c + l] = qs[32 * c + l] & 15;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    if (type == Q5_K)
        for (int j = 0; j < 8; ++j)
            for (int l = 0; l < 32; ++l) q[32 * j + l] |= ((blk[16 + l] >> j) & 1) << 4;
}

// A float32 product that a following add may not absorb into an fma (-ffp-contract=fast would;
// the reference rounds the product first).
inline float rounded(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    asm("" : "+x"(v));
#else
    volatile float t = v;
    v = t;
#endif
    return v;
}

// One row -> K floats, bit-identical to models/quants.py's dequantize (same products in the
// same order, each rounded to float32).
inline void dequantize_one(int type, const uint8_t* row, int64_t K, float* out) {
    const TypeInfo& ti = TYPES[type_index(type)];
    if (ti.x == XStyle::F32) {
        for (int64_t k = 0; k < K; ++k) out[k] = float_value(type, row, k);
        return;
    }
    int32_t q[256], sc[16], mn[8];
    for (int64_t b = 0; b < K / ti.values; ++b) {
        const uint8_t* blk = row + b * ti.bytes;
        float* o = out + b * ti.values;
        if (ti.x == XStyle::Q32) {
            float d, m;
            decode32(type, blk, q, d, m);
            const int off = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
            for (int i = 0; i < 32; ++i)
                o[i] = (type == Q4_1 || type == Q5_1) ? rounded(float(q[i]) * d) + m
                                                      : float(q[i] - off) * d;
        } else if (type == Q6_K) {
            decode_k(type, blk, q, sc, mn);
            const float d = fp16(blk + 208);
            for (int j = 0; j < 16; ++j) {
                const float dl = d * float(sc[j]);
                for (int l = 0; l < 16; ++l) o[16 * j + l] = float(q[16 * j + l] - 32) * dl;
            }
        } else {
            decode_k(type, blk, q, sc, mn);
            const float d = fp16(blk), dmin = fp16(blk + 2);
            for (int j = 0; j < 8; ++j) {
                const float dl = d * float(sc[j]), ml = dmin * float(mn[j]);
                for (int l = 0; l < 32; ++l) o[32 * j + l] = rounded(float(q[32 * j + l]) * dl) - ml;
            }
        }
    }
}

// 32 floats -> one Q8_0 block (fp16 d, 32 int8), rounding as GGML's reference quantizer (and
// models/quantize.py): d = max|v| / 127, q = round(v / d) through the reciprocal, d stored as
// fp16. q8_0_quantize (weights at load) and the q8_0 KV cache (attention.cpp) write these.
inline void quantize_q8_0_block(const float* v, uint8_t* blk) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t dh = c10::Half(d).x;
    std::memcpy(blk, &dh, 2);
    for (int i = 0; i < 32; ++i) {
        const float q = std::min(127.f, std::max(-128.f, std::round(v[i] * id)));
        blk[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    }
}

}  // namespace ember_blocks
