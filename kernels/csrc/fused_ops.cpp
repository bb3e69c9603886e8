// Small fused ops for the CPU decode step (kernels/fused_ops.py; callers in offload/body/). Each replaces a chain of
// PyTorch ops whose dispatch cost, not arithmetic, dominates at batch 1: the default model's
// norms alone were ~40 dispatches per layer (7 per rms_norm, 6 norms), ~4 ms of a 30 ms token.
//
// Every op works row by row, with the same loop whatever the number of rows, so a row gives
// bit-identical results alone or among T rows (speculative verification relies on that).
// References: kernels/fused_ops.py, the same PyTorch ops as the reference model's functions.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/square.h>
#include <c10/util/Optional.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EMBER_FUSED_AVX2 1
#endif

namespace {

// 1 / sqrt(mean(v^2) + eps) over n values; the sum in float, as torch's mean.
inline float inv_rms(const float* v, int64_t n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
    return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// a . b in a fixed order of operations (the same bits for a row whatever is computed beside
// it): four independent 8-wide partial sums, then one fixed reduction. One running sum makes
// every step wait on the previous add.
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef EMBER_FUSED_AVX2
    if (n % 32 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < n; i += 32) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
        }
        const __m256 v = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int64_t i = 0; i < n; ++i) d += a[i] * b[i];
    return d;
}

// out = v * inv_rms(v) * w (out may alias v).
inline void norm_row(const float* v, const float* w, int64_t n, float eps, float* out) {
    const float r = inv_rms(v, n, eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = v[i] * r * w[i];
}

void check_rows(const at::Tensor& x, const char* what) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                    x.device().is_cpu(),
                what, " must be a contiguous float32 (T, D) CPU tensor");
}

void check_weight(const at::Tensor& w, int64_t n, const char* what) {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat &&
                    w.is_contiguous() && w.device().is_cpu(),
                what, " must be a contiguous float32 (", n, ",) CPU tensor");
}

}  // namespace

// x (T, D), w (D,) -> x / rms(x) * w per row.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
    check_rows(x, "x");
    const int64_t T = x.size(0), D = x.size(1);
    check_weight(w, D, "weight");
    auto out = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) norm_row(xp + t * D, wp, D, (float)eps, op + t * D);
    return out;
}

// The residual step of a transformer block's sub-layer: x' = x + (post ? rms_norm(a, post) : a), and, when `next` is
// given, h = rms_norm(x', next) (the next sub-layer's input). Returns (x', h or x').
std::tuple<at::Tensor, at::Tensor> residual_norm(at::Tensor x, at::Tensor a,
                                                 c10::optional<at::Tensor> post,
                                                 c10::optional<at::Tensor> next, double eps) {
    check_rows(x, "x");
    check_rows(a, "a");
    TORCH_CHECK(a.sizes() == x.sizes(), "a and x must have the same shape");
    const int64_t T = x.size(0), D = x.size(1);
    if (post) check_weight(*post, D, "post-norm weight");
    if (next) check_weight(*next, D, "next-norm weight");
    auto xo = at::empty_like(x);
    auto h = next ? at::empty_like(x) : xo;
    const float *xp = x.data_ptr<float>(), *ap = a.data_ptr<float>();
    float *xop = xo.data_ptr<float>(), *hp = h.data_ptr<float>();
    const float e = (float)eps;
    for (int64_t t = 0; t < T; ++t) {
        const float* ar = ap + t * D;
        float* xr = xop + t * D;
        if (post) {
            norm_row(ar, post->data_ptr<float>(), D, e, xr);  // rms_norm(a) first, then + x
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) xr[i] = xp[t * D + i] + xr[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) xr[i] = xp[t * D + i] + ar[i];
        }
        if (next) norm_row(xr, next->data_ptr<float>(), D, e, hp + t * D);
    }
    return {xo, h};
}

// In place on the fused q/k/v projection's output qkv (T, (n_heads + 2 n_kv) * hd): each q and
// k head is rms-normed with its weight (when given), then rotated by its row's cos/sin
// (T, hd/2): halves (x[:hd/2], x[hd/2:]) or, `interleaved`, pairs (x0, x1), (x2, x3), ...
void qk_norm_rope_(at::Tensor qkv, int64_t n_heads, int64_t n_kv, int64_t hd,
                   c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                   at::Tensor cos, at::Tensor sin, bool interleaved, double eps) {
    check_rows(qkv, "qkv");
    TORCH_CHECK(hd % 2 == 0 && qkv.size(1) == (n_heads + 2 * n_kv) * hd,
                "qkv has ", qkv.size(1), " columns, expected (n_heads + 2 n_kv) * head_dim");
    const int64_t T = qkv.size(0), half = hd / 2;
    check_rows(cos, "cos");
    check_rows(sin, "sin");
    TORCH_CHECK(cos.size(0) == T && cos.size(1) == half && sin.sizes() == cos.sizes(),
                "cos/sin must be (T, head_dim / 2)");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both q and k norms or neither");
    if (q_norm) {
        check_weight(*q_norm, hd, "q norm");
        check_weight(*k_norm, hd, "k norm");
    }
    float* base = qkv.data_ptr<float>();
    const int64_t width = qkv.size(1);
    const float e = (float)eps;
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos.data_ptr<float>() + t * half;
        const float* s = sin.data_ptr<float>() + t * half;
        for (int64_t h = 0; h < n_heads + n_kv; ++h) {
            float* v = base + t * width + h * hd;
            if (q_norm) norm_row(v, (h < n_heads ? *q_norm : *k_norm).data_ptr<float>(), hd, e, v);
            if (interleaved) {
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = v[2 * i], x2 = v[2 * i + 1];
                    v[2 * i] = x1 * c[i] - x2 * s[i];
                    v[2 * i + 1] = x2 * c[i] + x1 * s[i];
                }
            } else {
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * c[i] - x2 * s[i];
                    v[i + half] = x2 * c[i] + x1 * s[i];
                }
            }
        }
    }
}

// The FFN's activation (activation.h) with the ATen ops models/activations.py's table uses,
// so the values are the same bits as the Python chain's.
at::Tensor ffn_activation(Activation act, const at::Tensor& gate, const at::Tensor& up) {
    switch (act) {
        case Activation::RELU: return at::relu(up);
        case Activation::RELU2: return at::square(at::relu(up));
        case Activation::RELU_GLU: return at::mul(at::relu(gate), up);
        case Activation::DRELU: return at::mul(at::relu(gate), at::relu(up));
        case Activation::SILU_GLU: return at::mul(at::silu(gate), up);
        case Activation::GELU_GLU: return at::mul(at::gelu(gate, "tanh"), up);
    }
    TORCH_CHECK(false, "unknown activation code ", static_cast<int64_t>(act));
}
