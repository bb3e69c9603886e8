// Rows of x quantized for block_matmul (block_matmul.cpp): Q8_0-style per 32 values and/or
// Q8_K-style per 256, in the layouts the CPU path's kernels read (XQuant, block_formats.h): the
// row kernels' natural or pair layout, and for whole tiles of 16 rows the prefill kernels'
// token-interleaved layouts (AVX2 pairs of values, AVX-512 runs of 4; block_gemm_*.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "block_formats.h"

namespace ember_blocks {

// What quantize_x needs to know of a CPU path.
struct XLayouts {
    // a row of x in blocks of 32 or 256, with sums per 8 values (same result on every path)
    void (*quantize)(const float* x, int64_t n, int block, int8_t* q, float* d, int16_t* sum8);
    bool pairs;       // the row kernels read the 32-value types' x in pair layout
    bool k_gemm;      // the path has prefill kernels for the K-quants ...
    bool quads;       // ... reading runs of 4 values per token (AVX-512), else pairs (AVX2)
    bool small_gemm;  // the path has prefill kernels for the 32-value types (runs of 4)
    // From this many rows of x on, the path's K-quant prefill kernels read x's rows (qk) as
    // they are, with no tiles laid out (block_gemm_lanes_avx512.h); 0: never.
    int64_t k_rows_from;
};

// x (T, K) quantized for the styles the call needs (q32: Q8_0-style, qk: Q8_K-style) into one
// buffer that `storage` keeps alive. If the path reads pair layout (block_dots_avx2.h), full
// groups of 8 32-value blocks are stored so, the rest in natural order.
inline XQuant quantize_x(const float* x, int64_t T, int64_t K, bool q32, bool qk, const XLayouts& path,
                         at::Tensor& storage) {
    XQuant a;
    a.T = T, a.K = K, a.xf = x;
    if (!q32 && !qk) return a;
    auto aligned = [](int64_t n) { return (n + 63) & ~int64_t(63); };
    const int64_t n32 = q32 ? T * K / 32 : 0, nk = qk ? T * K / 256 : 0;
    // the prefill layout: only where the path has prefill kernels and x has a whole tile
    int64_t tiles = qk && path.k_gemm ? T / GEMM_TOKENS : 0;
    const int64_t ng = tiles * GEMM_TOKENS;  // rows of x in tiles
    const bool quads = path.quads;
    const bool k_rows = tiles && path.k_rows_from > 0 && T >= path.k_rows_from;
    const int64_t ngk = k_rows ? 0 : ng;  // rows of x laid out in the K-quants' tiles
    // and the 32-value types' prefill layout, where the path has their kernels
    const int64_t tiles32 = q32 && path.small_gemm ? T / GEMM_TOKENS : 0;
    const int64_t ng32 = tiles32 * GEMM_TOKENS;
    const int64_t sizes[] = {q32 ? T * K : 0, n32 * 4, n32 * 4, n32 * 4, n32 * 4,
                             qk ? T * K : 0,  nk * 4,  nk * 16 * 2, nk * 8 * 2,
                             tiles && !quads ? T * K / 8 * 2 : 0,  // all rows' per-8 sums, to lay out
                             ngk * K, ngk * K / 256 * 4, ngk * K / 32 * 2,
                             quads ? ngk * K / 16 * 4 : ngk * K / 8 * 2,
                             ng32 * K, ng32 * K / 32 * 4, ng32 * K / 32 * 4, ng32 * K / 32 * 4};
    constexpr int N_PARTS = sizeof(sizes) / sizeof(sizes[0]);
    int64_t total = 0;
    for (int64_t s : sizes) total += aligned(s);
    storage = at::empty({total}, at::TensorOptions().dtype(at::kByte));
    uint8_t* p = storage.data_ptr<uint8_t>();
    uint8_t* part[N_PARTS];
    for (int i = 0; i < N_PARTS; ++i) part[i] = p, p += aligned(sizes[i]);
    int8_t* q32p = reinterpret_cast<int8_t*>(part[0]);
    float* d32 = reinterpret_cast<float*>(part[1]);
    int32_t* s32 = reinterpret_cast<int32_t*>(part[2]);
    float* ds32 = reinterpret_cast<float*>(part[3]);
    int16_t* h32 = reinterpret_cast<int16_t*>(part[4]);
    int8_t* qkp = reinterpret_cast<int8_t*>(part[5]);
    float* dk = reinterpret_cast<float*>(part[6]);
    int16_t* sk16 = reinterpret_cast<int16_t*>(part[7]);
    int16_t* sk32 = reinterpret_cast<int16_t*>(part[8]);
    int16_t* sk8 = reinterpret_cast<int16_t*>(part[9]);
    int8_t* qg = reinterpret_cast<int8_t*>(part[10]);
    float* dg = reinterpret_cast<float*>(part[11]);
    int16_t* m32g = reinterpret_cast<int16_t*>(part[12]);
    int16_t* s8g = reinterpret_cast<int16_t*>(part[13]);  // quads: int32 per-16 sums instead
    int8_t* qq32 = reinterpret_cast<int8_t*>(part[14]);
    float* d32q = reinterpret_cast<float*>(part[15]);
    int32_t* s32q = reinterpret_cast<int32_t*>(part[16]);
    float* ds32q = reinterpret_cast<float*>(part[17]);
    const int64_t nb = K / 32, full = path.pairs ? nb / 8 * 8 : 0;
    // Rows are independent (batch invariance); split them over threads once x is large.
    at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t t0, int64_t t1) {
        std::vector<int8_t> qrow(K);
        std::vector<int16_t> s8(K / 8);
        std::vector<float> drow(nb);
        for (int64_t t = t0; t < t1; ++t) {
            const float* xt = x + t * K;
            if (q32) {
                path.quantize(xt, K, 32, qrow.data(), drow.data(), s8.data());
                for (int64_t b = 0; b < nb; ++b) {
                    const int8_t* qb = qrow.data() + b * 32;
                    const int16_t* sb = s8.data() + b * 4;
                    int64_t slot = t * nb + b;
                    if (b < full) {  // block 8g + 2p + side -> bytes 64p + 16 side (+32), slot 4 side + p
                        const int64_t g = b / 8, pr = (b % 8) / 2, side = b % 2;
                        int8_t* dst = q32p + t * K + g * 256 + pr * 64 + side * 16;
                        std::memcpy(dst, qb, 16);
                        std::memcpy(dst + 32, qb + 16, 16);
                        slot = t * nb + g * 8 + side * 4 + pr;
                        // the two int16 lanes that hold this block after the vphaddw rounds
                        // sum values 0-7 and 16-23, and 8-15 and 24-31
                        int16_t* hp = h32 + t * nb * 2 + g * 16 + side * 8 + pr * 2;
                        hp[0] = int16_t(sb[0] + sb[2]), hp[1] = int16_t(sb[1] + sb[3]);
                    } else {
                        std::memcpy(q32p + t * K + b * 32, qb, 32);
                    }
                    const int32_t s = sb[0] + sb[1] + sb[2] + sb[3];
                    d32[slot] = drow[b], s32[slot] = s, ds32[slot] = drow[b] * float(s);
                    if (t < ng32) {  // token i of tile g in lane i, runs of 4 values
                        const int64_t g = t / GEMM_TOKENS, i = t % GEMM_TOKENS, at = (g * nb + b) * GEMM_TOKENS + i;
                        for (int r = 0; r < 8; ++r)
                            std::memcpy(qq32 + ((g * (K / 4) + b * 8 + r) * GEMM_TOKENS + i) * 4, qb + 4 * r, 4);
                        d32q[at] = drow[b], s32q[at] = s, ds32q[at] = drow[b] * float(s);
                    }
                }
            }
            if (qk) {
                const int64_t b0 = t * (K / 256);
                path.quantize(xt, K, 256, qkp + t * K, dk + b0, s8.data());
                for (int64_t j = 0; j < K / 16; ++j) sk16[b0 * 16 + j] = int16_t(s8[2 * j] + s8[2 * j + 1]);
                for (int64_t j = 0; j < K / 32; ++j)
                    sk32[b0 * 8 + j] = int16_t(sk16[b0 * 16 + 2 * j] + sk16[b0 * 16 + 2 * j + 1]);
                if (tiles && !quads) std::memcpy(sk8 + t * K / 8, s8.data(), K / 8 * sizeof(int16_t));
            }
        }
    });
    if (k_rows) {  // the kernels read qk below
        a.tiles = tiles;
        tiles = 0;
    }
    if (quads && tiles) {  // Prefill tiles, token i in lane i (block_gemm_avx512.h)
        int32_t* s16q = reinterpret_cast<int32_t*>(s8g);
        at::parallel_for(0, tiles, 1, [&](int64_t g0, int64_t g1) {
            for (int64_t g = g0; g < g1; ++g) {
                for (int i = 0; i < GEMM_TOKENS; ++i) {
                    const int64_t t = g * GEMM_TOKENS + i;
                    const int8_t* src = qkp + t * K;
                    int8_t* dst = qg + g * K * GEMM_TOKENS + 4 * i;
                    for (int64_t p = 0; p < K / 4; ++p) std::memcpy(dst + p * 4 * GEMM_TOKENS, src + 4 * p, 4);
                    for (int64_t b = 0; b < K / 256; ++b) dg[(g * K / 256 + b) * GEMM_TOKENS + i] = dk[t * K / 256 + b];
                    for (int64_t c = 0; c < K / 32; ++c)
                        m32g[((g * K / 64 + c / 2) * GEMM_TOKENS + i) * 2 + c % 2] = sk32[t * K / 32 + c];
                    for (int64_t j = 0; j < K / 16; ++j) s16q[(g * K / 16 + j) * GEMM_TOKENS + i] = sk16[t * K / 16 + j];
                }
            }
        });
        a.tiles = tiles, a.qq = qg, a.dq = dg, a.m32q = m32g, a.s16q = s16q;
        tiles = 0;  // nothing in the AVX2 layout
    }
    // Prefill tiles: the rows above, transposed 16 at a time (block_gemm_avx2.h).
    at::parallel_for(0, tiles, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) {
            const int64_t t0 = g * GEMM_TOKENS;
            int16_t* qd = reinterpret_cast<int16_t*>(qg + g * K * GEMM_TOKENS);
            for (int i = 0; i < GEMM_TOKENS; ++i) {
                const int8_t* src = qkp + (t0 + i) * K;
                for (int64_t p = 0; p < K / 2; ++p) std::memcpy(qd + p * GEMM_TOKENS + i, src + 2 * p, 2);
                for (int64_t e = 0; e < K / 8; ++e) s8g[(g * K / 8 + e) * GEMM_TOKENS + i] = sk8[(t0 + i) * K / 8 + e];
            }
            for (int j = 0; j < GEMM_TOKENS; ++j) {  // lane j holds token GEMM_ORDER[j]
                const int64_t t = t0 + GEMM_ORDER[j];
                for (int64_t b = 0; b < K / 256; ++b) dg[(g * K / 256 + b) * GEMM_TOKENS + j] = dk[t * K / 256 + b];
                for (int64_t c = 0; c < K / 64; ++c) {
                    int16_t* m = m32g + ((g * K / 64 + c) * GEMM_TOKENS + j) * 2;
                    m[0] = sk32[t * K / 32 + 2 * c], m[1] = sk32[t * K / 32 + 2 * c + 1];
                }
            }
        }
    });
    if (tiles) a.tiles = tiles, a.qg = qg, a.dg = dg, a.m32g = m32g, a.s8g = s8g;
    if (q32) a.q32 = q32p, a.d32 = d32, a.s32 = s32, a.ds32 = ds32, a.h32 = h32;
    if (tiles32) a.tiles = tiles32, a.qq32 = qq32, a.d32q = d32q, a.s32q = s32q, a.ds32q = ds32q;
    if (qk) a.qk = qkp, a.dk = dk, a.sk16 = sk16, a.sk32 = sk32;
    return a;
}

}  // namespace ember_blocks
