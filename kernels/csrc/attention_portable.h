// The attention kernels' plain path (attention.cpp runs it where no vector path applies, and
// tests force it): attention_math.h's operations as written, for any head dim. The vector
// paths (attention_simd.h) compute the very same operations, so every path gives the same bits.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "attention_math.h"

namespace ember_attention {

// attention_math.h as written, for any head dim.
struct Portable {
    // (a tile here is one key; before_tile runs ahead of each)
    template <class Hook = NoHook>
    static void scores(const float* const* q, int nq, const float* const* k, int x0, int x1,
                       int64_t hd, float scale, float* s, int lds, const Hook& before_tile = {}) {
        for (int x = x0; x < x1; ++x) {
            before_tile(x, x + 1);
            for (int i = 0; i < nq; ++i) s[i * lds + x] = dot(q[i], k[x], hd) * scale;
        }
    }
    static float max_of(const float* s, int a, int b) { return *std::max_element(s + a, s + b); }
    static float exp_sum(const float* s, float* p, int a, int b, float m, bool bf16) {
        float acc[LANES] = {};
        for (int x = a; x < b; ++x) {
            p[x] = exp_neg(s[x] - m);
            acc[x % LANES] += p[x] = bf16 ? bf16_round(p[x]) : p[x];
        }
        return tree16(acc);
    }
    static void values(const float* const* p, int nh, const float* const* v, int a, int b,
                       int64_t hd, float* const* O, const Fold* f) {
        thread_local std::vector<float> o;
        o.resize(hd);
        for (int h = 0; h < nh; ++h) {
            std::fill(o.begin(), o.end(), 0.f);
            for (int x = a; x < b; ++x)
                for (int64_t d = 0; d < hd; ++d) o[d] = std::fma(p[h][x], v[x][d], o[d]);
            merge_values(O[h], o.data(), hd, f[h]);
        }
    }
    static void from_half(const uint16_t* h, int64_t n, float* out) {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
    }
    static void from_bf16(const Bf16Row* row, int64_t n, bool keys, float* out) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(h[keys ? bf16_key_dim(i) : i]);
    }
    static void from_int8(const int8_t* q, float d, float* out) {
        for (int i = 0; i < Q8_VALUES; ++i) out[i] = static_cast<float>(q[i]) * d;
    }
};

}  // namespace ember_attention
