// y = x @ W^T for W stored as GGML Q8_0 blocks, reading each weight row once for all T rows
// of x. Used for the LM head (262k x 640 on the default model): the Q8_0 bytes are a quarter
// of the float32 matrix's, and decode is memory-bound.
//
// Q8_0 block (34 bytes): fp16 scale d, then 32 int8 quants q; value_i = d * q_i.
// Shapes: x (T, K) float32 contiguous; w (N, K/32*34) uint8; y (T, N) float32.
// Narrow includes (as in sparse_ffn.cpp): the JIT build is much faster than <torch/extension.h>.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <algorithm>

namespace {

constexpr int QK = 32;
constexpr int BLOCK_BYTES = 34;

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    // Portable IEEE half -> float (normals, subnormals, inf/nan).
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; --exp; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000u | (mant << 13); }
    else { bits = sign | ((exp - 15 + 127) << 23) | (mant << 13); }
    float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

#ifdef __AVX2__
// Rows [r0, r1) against up to 4 rows of x at once. Each Q8_0 block is widened to four vectors
// of 8 floats and scaled by d (the same products d * q_i the float32 reference holds), then
// multiplied into two independent accumulators per x row, so the FMA chains overlap instead
// of waiting on each other's latency.
template <int TT>
void rows_tile(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
               int64_t r, float* y, int64_t N) {
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[TT][2];
    for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK; ++b) {
        const uint8_t* blk = row + b * BLOCK_BYTES;
        uint16_t dh; std::memcpy(&dh, blk, 2);
        const __m256 d = _mm256_set1_ps(half_to_float(dh));
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
        __m256 wv[4];
        wv[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
        wv[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
        wv[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
        wv[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
        for (int t = 0; t < TT; ++t) {
            const float* xb = x + t * K + b * QK;
            acc[t][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xb), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xb + 8), acc[t][1]);
            acc[t][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xb + 16), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xb + 24), acc[t][1]);
        }
    }
    for (int t = 0; t < TT; ++t) {
        const __m256 v = _mm256_add_ps(acc[t][0], acc[t][1]);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        y[t * N + r] = _mm_cvtss_f32(s);
    }
}

void rows_kernel(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t row_bytes,
                 int64_t r0, int64_t r1, float* y, int64_t N) {
    for (int64_t r = r0; r < r1; ++r) {
        // The row (K/32 * 34 bytes) stays in L1 across the x tiles after the first.
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const float* xt = x + t0 * K;
            float* yt = y + t0 * N;
            switch (std::min<int64_t>(4, T - t0)) {
                case 4: rows_tile<4>(xt, K, w, row_bytes, r, yt, N); break;
                case 3: rows_tile<3>(xt, K, w, row_bytes, r, yt, N); break;
                case 2: rows_tile<2>(xt, K, w, row_bytes, r, yt, N); break;
                default: rows_tile<1>(xt, K, w, row_bytes, r, yt, N); break;
            }
        }
    }
}
#else
// Portable version: dequantize one row into a float buffer that stays in L1, then take its
// dot product with every row of x.
void rows_kernel(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t row_bytes,
                 int64_t r0, int64_t r1, float* y, int64_t N) {
    std::vector<float> wrow(K);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w + r * row_bytes;
        for (int64_t b = 0; b < K / QK; ++b) {
            const uint8_t* blk = row + b * BLOCK_BYTES;
            uint16_t dh; std::memcpy(&dh, blk, 2);
            const float d = half_to_float(dh);
            const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
            for (int i = 0; i < QK; ++i) wrow[b * QK + i] = d * static_cast<float>(q[i]);
        }
        for (int64_t t = 0; t < T; ++t) {
            float s = 0.f;
            for (int64_t i = 0; i < K; ++i) s += wrow[i] * x[t * K + i];
            y[t * N + r] = s;
        }
    }
}
#endif

}  // namespace

// Bound in sparse_ffn.cpp's module (one extension, one PYBIND11_MODULE).
at::Tensor q8_0_matmul(at::Tensor x, at::Tensor w) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "x must be a contiguous float32 (T, K) tensor");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                "w must be a contiguous uint8 (N, row_bytes) tensor");
    const int64_t T = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
    TORCH_CHECK(K % QK == 0 && row_bytes == K / QK * BLOCK_BYTES, "Q8_0 row size mismatch");
    auto y = at::empty({T, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    // Rows of W are independent: split them across threads in large contiguous ranges so each
    // thread streams its share of the matrix once.
    at::parallel_for(0, N, 2048, [&](int64_t r0, int64_t r1) {
        rows_kernel(xp, T, K, wp, row_bytes, r0, r1, yp, N);
    });
    return y;
}
