// y = x @ W^T for W stored as GGML Q8_0 blocks, reading each weight row once for all T rows
// of x, with int16 activations: the first LM-head kernel (262k x 640 on the default model),
// which bench/block_matmul_speed.py measures against block_matmul (int8 activations).
//
// Q8_0 block (34 bytes): fp16 scale d, then 32 int8 quants q; w_i = d * q_i.
// Shapes: x (T, K) float32 contiguous; w (N, K/32*34) uint8; y (T, N) float32.
//
// x is first rounded to int16 per 32-element block (scale s = max|x_block| / 32767, to nearest
// even), so a block's dot product is exact integer arithmetic (vpmaddwd), then one convert and
// one fma by d * s. Measured on the 2-core AVX2 machine (1 thread, CPU time, LM head): this is
// ~40% cheaper than widening the weights to float32 and using float FMAs, and the rounding
// (2^-16 of the block's largest |x|) is 256x finer than the weights' own 8-bit grid.
//
// Batch invariance: every output element is computed by the same sequence of operations
// whatever T is or how rows and tokens are tiled (x rows are quantized independently, one
// accumulator per element, blocks in order, one fixed horizontal sum), so a row of x gives
// bit-identical results alone or among T rows. Speculative verification relies on this.
//
// Narrow includes (as in sparse_ffn.cpp): the JIT build is much faster than <torch/extension.h>.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "block_formats.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EMBER_Q8_AVX2 1
#endif

namespace {

constexpr int QK = 32, QUANT_BLOCK_BYTES = 34;  // values and bytes per Q8_0 block

inline float half_to_float(uint16_t h) {
#ifdef EMBER_Q8_AVX2
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

inline float quant_block_scale(const uint8_t* blk) {
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    return half_to_float(dh);
}

// x (T, K) -> xq (T, K) int16 and xs (T, K/32) scales, x ~= xq * xs per block.
// Same arithmetic as q8_matmul.quantize_activations_reference (division, round half to even).
void quantize_x(const float* x, int64_t n_quant_blocks, int16_t* xq, float* xs) {
    for (int64_t b = 0; b < n_quant_blocks; ++b) {
        const float* v = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float s = amax / 32767.f;
        xs[b] = s;
        for (int i = 0; i < QK; ++i)
            xq[b * QK + i] = s == 0.f ? 0 : static_cast<int16_t>(std::nearbyint(v[i] / s));
    }
}

#ifdef EMBER_Q8_AVX2
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One weight row r against TT rows of x. Per block: the 32 quants widened to int16 once,
// then per x row two vpmaddwd (exact int32 pair sums), one add, one convert, one fma.
// (Tiling several weight rows at once measured slower here: register spills.)
// A software prefetch 2 KiB ahead, about once per cache line, took the 262k-row LM head from
// ~19 to ~21 GB/s on the 2-core machine (sum() reads ~25 GB/s).
constexpr int PREFETCH_AHEAD = 2048;

template <int TT>
inline void row_tile(const int16_t* xq, const float* xs, int64_t K, const uint8_t* row,
                     float* y, int64_t N) {
    const int64_t nb = K / QK;
    __m256 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * QUANT_BLOCK_BYTES;
        if ((b & 1) == 0) _mm_prefetch((const char*)(blk + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m256i qa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2)));
        const __m256i qb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18)));
        const __m256 d = _mm256_set1_ps(quant_block_scale(blk));
        for (int t = 0; t < TT; ++t) {
            const int16_t* xb = xq + t * K + b * QK;
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(qa, _mm256_loadu_si256((const __m256i*)xb)),
                _mm256_madd_epi16(qb, _mm256_loadu_si256((const __m256i*)(xb + 16))));
            const __m256 ds = _mm256_mul_ps(d, _mm256_broadcast_ss(xs + t * nb + b));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), ds, acc[t]);
        }
    }
    for (int t = 0; t < TT; ++t) y[t * N] = hsum(acc[t]);
}
#else
// Portable version, the same arithmetic per element: exact int32 block sums, then one
// (rounded) multiply-add per block, the blocks' sum kept in one float per element.
template <int TT>
inline void row_tile(const int16_t* xq, const float* xs, int64_t K, const uint8_t* row,
                     float* y, int64_t N) {
    const int64_t nb = K / QK;
    for (int t = 0; t < TT; ++t) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + b * QUANT_BLOCK_BYTES;
            const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
            const int16_t* xb = xq + t * K + b * QK;
            int32_t p = 0;
            for (int i = 0; i < QK; ++i) p += int32_t(q[i]) * int32_t(xb[i]);
            acc = std::fma(float(p), quant_block_scale(blk) * xs[t * nb + b], acc);
        }
        y[t * N] = acc;
    }
}
#endif

// Rows [r0, r1) against all T rows of x, tokens in tiles of 4. The rows (a few KiB) stay in
// L1/L2 while the tiles of x stream past them.
void rows_kernel(const int16_t* xq, const float* xs, int64_t T, int64_t K, const uint8_t* w,
                 int64_t row_bytes, int64_t r0, int64_t r1, float* y, int64_t N) {
    const int64_t nb = K / QK;
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
        const int16_t* xt = xq + t0 * K;
        const float* st = xs + t0 * nb;
        float* yt = y + t0 * N;
        const int64_t tt = std::min<int64_t>(4, T - t0);
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            switch (tt) {
                case 4: row_tile<4>(xt, st, K, row, yt + r, N); break;
                case 3: row_tile<3>(xt, st, K, row, yt + r, N); break;
                case 2: row_tile<2>(xt, st, K, row, yt + r, N); break;
                default: row_tile<1>(xt, st, K, row, yt + r, N); break;
            }
        }
    }
}

// Work split sizes, see q8_0_matmul.
constexpr int64_t RANGE_MIN_BYTES = 64 << 10, RANGE_MAX_BYTES = 4 << 20, TILE_BYTES = 16 << 10;

}  // namespace

// Bound in bindings.cpp (one extension, one PYBIND11_MODULE).
at::Tensor q8_0_matmul(at::Tensor x, at::Tensor w) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "x must be a contiguous float32 (T, K) tensor");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                "w must be a contiguous uint8 (N, row_bytes) tensor");
    const int64_t T = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
    TORCH_CHECK(K % QK == 0 && row_bytes == K / QK * QUANT_BLOCK_BYTES, "Q8_0 row size mismatch");
    auto y = at::empty({T, N}, x.options());
    if (T == 0 || N == 0) return y;
    std::vector<int16_t> xq(T * K);
    std::vector<float> xs(T * K / QK);
    quantize_x(x.data_ptr<float>(), T * K / QK, xq.data(), xs.data());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    // Threads take contiguous ranges of rows (~1/4 of the matrix each, at most 4 MiB) from a
    // shared counter. Contiguous ranges: measured on the 2-core machine, two threads
    // alternating 16 KiB chunks read the 178 MB LM head at ~17 GB/s, 4 MiB ranges at ~27 GB/s
    // (the memory system streams long runs far better), and a run of body-sized matrices went
    // from ~18 to ~25 GB/s. A counter rather than a static split: on a busy machine one thread
    // is often preempted and the other takes the rest instead of waiting at the join. Each
    // output is computed whole by one thread, so the result is deterministic.
    // Within a range, rows go in L2-sized tiles so that prefill's token tiles reuse them.
    const int64_t total_bytes = N * row_bytes;
    const int64_t range_bytes = std::clamp<int64_t>(
        total_bytes / (4 * std::max(1, at::get_num_threads())), RANGE_MIN_BYTES, RANGE_MAX_BYTES);
    const int64_t range = std::max<int64_t>(1, range_bytes / row_bytes);
    const int64_t tile = std::max<int64_t>(4, TILE_BYTES / row_bytes);
    const int64_t n_ranges = (N + range - 1) / range;
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_ranges);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
        for (int64_t c; (c = next.fetch_add(1)) < n_ranges;) {
            const int64_t end = std::min(N, (c + 1) * range);
            for (int64_t r0 = c * range; r0 < end; r0 += tile)
                rows_kernel(xq.data(), xs.data(), T, K, wp, row_bytes, r0,
                            std::min(end, r0 + tile), yp, N);
        }
    });
    return y;
}

// w (N, K) float32 -> (N, K/32*34) Q8_0 rows, rounding as GGML's reference quantizer (and
// models/quantize.py): d = max|w|/127, q = roundf(w / d) via the reciprocal, fp16 d stored.
// Used at load for tensors of a type block_matmul does not read (Python would take far longer).
at::Tensor q8_0_quantize(at::Tensor w) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
                "w must be a contiguous float32 (N, K) tensor");
    const int64_t N = w.size(0), K = w.size(1);
    TORCH_CHECK(K % QK == 0, "Q8_0 rows need a multiple of 32 columns");
    const int64_t row_bytes = K / QK * QUANT_BLOCK_BYTES;
    auto out = at::empty({N, row_bytes}, w.options().dtype(at::kByte));
    const float* wp = w.data_ptr<float>();
    uint8_t* op = out.data_ptr<uint8_t>();
    at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t b = 0; b < K / QK; ++b)
                ember_blocks::quantize_q8_0_block(wp + r * K + b * QK,
                                                  op + r * row_bytes + b * QUANT_BLOCK_BYTES);
    });
    return out;
}
