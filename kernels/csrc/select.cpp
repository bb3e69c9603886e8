// Picking tokens from a logits vector (offload/decode/sampler.py): greedy argmax and the top-k
// candidates sampling starts from. Over the default model's 262k logits torch.argmax took
// ~0.5 ms and torch.topk(k=40) ~0.8 ms a token; these take a single pass each.
// References: torch.argmax, and top_k_reference in kernels/fused_ops.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EMBER_SELECT_AVX2 1
#endif

namespace {
void check_vector(const at::Tensor& v, const char* what) {
    TORCH_CHECK(v.dim() == 1 && v.scalar_type() == at::kFloat && v.is_contiguous() &&
                    v.numel() > 0 && v.device().is_cpu(),
                what, " takes a non-empty contiguous float32 CPU vector");
}

// The k largest of p[0..n) as (value, index), largest first, ties to the lower index.
// One pass: a value enters the sorted list only if it beats the k-th kept so far, which
// after the first few thousand values is rare, so the pass is a vector compare per 8 values.
// Returns false if p holds a NaN (the result is then not the top k).
bool top_k_scan(const float* p, int64_t n, int64_t k, float* vals, int64_t* ids) {
    int64_t count = 0;
    auto insert = [&](float x, int64_t i) {
        // Equal values keep their order: the new one has the larger index, so it goes after.
        int64_t j = std::min(count, k - 1);
        while (j > 0 && vals[j - 1] < x) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            --j;
        }
        vals[j] = x;
        ids[j] = i;
        count = std::min(count + 1, k);
    };
    bool nan = false;
    int64_t i = 0;
    for (; i < n && count < k; ++i) {
        nan |= std::isnan(p[i]);
        insert(p[i], i);
    }
#ifdef EMBER_SELECT_AVX2
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(p + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
        while (mask) {
            const int b = __builtin_ctz(mask);
            mask &= mask - 1;
            if (p[i + b] > vals[k - 1]) insert(p[i + b], i + b);  // the bar may have risen
        }
    }
    nan |= _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < n; ++i) {
        nan |= std::isnan(p[i]);
        if (p[i] > vals[k - 1]) insert(p[i], i);
    }
    return !nan;
}
}  // namespace

// Index of the largest value of a float32 vector, the first one on ties, a NaN counting as
// the largest (torch.argmax's rules). Greedy decoding takes this over the 262k logits of the
// default model every token: torch.argmax took ~0.5 ms there, this ~0.05.
int64_t argmax(at::Tensor v) {
    check_vector(v, "argmax");
    const float* p = v.data_ptr<float>();
    const int64_t n = v.numel();
    int64_t i = 0, best_i = 0;
    float best = p[0];
#ifdef EMBER_SELECT_AVX2
    if (n >= 16) {
        // Eight lanes, each keeping the first maximum it sees (strictly greater replaces).
        __m256 lane_best = _mm256_loadu_ps(p);
        __m256i lane_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = lane_idx;
        __m256 unordered = _mm256_cmp_ps(lane_best, lane_best, _CMP_UNORD_Q);
        const __m256i step = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= n && i + 8 <= INT32_MAX; i += 8) {
            idx = _mm256_add_epi32(idx, step);
            const __m256 x = _mm256_loadu_ps(p + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(x, lane_best, _CMP_GT_OQ);
            lane_best = _mm256_blendv_ps(lane_best, x, gt);
            lane_idx = _mm256_blendv_epi8(lane_idx, idx, _mm256_castps_si256(gt));
        }
        if (_mm256_movemask_ps(unordered)) {
            i = 0;  // a NaN somewhere: the scalar loop below finds the first one
        } else {
            alignas(32) float vals[8];
            alignas(32) int32_t ids[8];
            _mm256_store_ps(vals, lane_best);
            _mm256_store_si256((__m256i*)ids, lane_idx);
            best = vals[0];
            best_i = ids[0];
            for (int l = 1; l < 8; ++l)
                if (vals[l] > best || (vals[l] == best && ids[l] < best_i)) {
                    best = vals[l];
                    best_i = ids[l];
                }
        }
    }
#endif
    for (; i < n; ++i) {
        if (std::isnan(p[i])) return i;
        if (p[i] > best) {
            best = p[i];
            best_i = i;
        }
    }
    return best_i;
}

// The k largest values of a float32 vector and their indices, largest first, ties to the
// lower index, a NaN counting as larger than any number (torch.sort's order, descending and
// stable). k must be small next to the vector: the kept list is sorted by insertion.
std::tuple<at::Tensor, at::Tensor> top_k(at::Tensor v, int64_t k) {
    check_vector(v, "top_k");
    const int64_t n = v.numel();
    TORCH_CHECK(k >= 1 && k <= n, "top_k needs 1 <= k <= ", n, ", got ", k);
    auto vals = at::empty({k}, v.options());
    auto ids = at::empty({k}, v.options().dtype(at::kLong));
    const float* p = v.data_ptr<float>();
    float* vp = vals.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    if (top_k_scan(p, n, k, vp, ip)) return {vals, ids};
    // NaN somewhere (broken logits): the plain way, in the same order.
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [p](int64_t a, int64_t b) {
        const bool na = std::isnan(p[a]), nb = std::isnan(p[b]);
        if (na != nb) return na;
        if (!na && p[a] != p[b]) return p[a] > p[b];
        return a < b;
    });
    for (int64_t j = 0; j < k; ++j) {
        vp[j] = p[order[j]];
        ip[j] = order[j];
    }
    return {vals, ids};
}
