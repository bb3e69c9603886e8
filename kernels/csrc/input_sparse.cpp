// y = x @ W^T reading only the weight columns of the inputs that survive a threshold
// (|x_i| > threshold), over W's input-major tiles (input_major.h): the file's own blocks
// re-ordered once by tile_relayout, so nothing is rounded a second time. Python side and
// references: kernels/input_sparse.py.
//
// The inputs read are listed once per call: for one row (decode) those it keeps; for T rows
// those some row keeps, the others' values zeroed. Each thread owns a range of 64-row groups
// (across the call's weights, side by side) and walks the super-blocks in order: per group and
// sub-block, 4 vectors of accumulators per row of x take one fma per listed input (its 64
// values decoded once for all rows of the token tile), then y += a * acc + b * sum(x). While it
// works on one super-block it prefetches the next one's kept runs into L2.
//
// Arithmetic: the same operations in the same order on every CPU path, so the paths agree bit
// for bit; a row's outputs do not depend on the other rows (batch invariance: a zeroed input
// adds +-0), and a thresholded row gives its masked dense product's value.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "input_major.h"
#include "input_major_vectors.h"
#include "ops.h"
#include "prefetch.h"

namespace {

using namespace ember_im;

struct Weight {
    const uint8_t* p;
    Tiles lay;
    int64_t col0;  // first output column in the (padded) y
};

// x rounded to int8 per block of B inputs (the integer types' x; B = the file's block).
struct XInt {
    std::vector<int16_t> xq;  // per tile of TT rows: per listed input, TT values (0 past T)
    std::vector<float> d;     // (T, K/B): each block's scale
    std::vector<int32_t> s16; // (T, K/16): sums of the rounded values over each 16 inputs
};

// What every weight of a call reads: the listed inputs and their values.
struct Listed {
    int64_t T, K;
    const int32_t* cols;     // listed inputs, ascending
    const int32_t* start16;  // (K/16 + 1): how many listed inputs lie below input 16c
    const float* xs;         // per tile of TT rows: per listed input, TT values (0 past T)
    const float* sx16;       // (T, K/16): per row, the sum of its kept x over each 16 inputs
    const XInt* x32;         // x as int8 per 32 and per 256 inputs, where a weight needs it
    const XInt* x256;
};

using ember_prefetch::lines_l2;

// The kept runs (and header rows) of super-block kb over groups [ga, gb), into L2.
template <int TYPE>
void prefetch_super(const Weight& w, int64_t kb, int64_t ga, int64_t gb, const Listed& li) {
    constexpr int QK = super_inputs(TYPE), LB = low_bytes(TYPE), HB = high_bytes(TYPE);
    const Tiles& t = w.lay;
    const int64_t Np = t.padded(), rows = (gb - ga) * GROUP;
    const uint8_t* sb = w.p + kb * t.super_bytes();
    const int halves_n = float_type(TYPE) ? 0 : has_min(TYPE) ? 2 : 1;  // d, dmin/m: fp16
    for (int f = 0; f < halves_n; ++f) lines_l2(sb + 2 * f * Np + ga * GROUP * 2, rows * 2);
    for (int f = 0; f < header_bytes(TYPE) - 2 * halves_n; ++f)  // scale bytes: 1 per row
        lines_l2(sb + (2 * halves_n + f) * Np + ga * GROUP, rows);
    for (int64_t j = li.start16[kb * QK / 16]; j < li.start16[(kb + 1) * QK / 16]; ++j) {
        const uint8_t* in = w.p + t.input_at(kb, li.cols[j] - kb * QK);
        lines_l2(in + ga * LB, (gb - ga) * LB);
        if constexpr (HB > 0) lines_l2(in + t.high_at() + ga * HB, (gb - ga) * HB);
    }
}

// Row group g's w = a * q + b for each sub-block of super-block tile `sb` that has a listed
// input (st: the listed inputs' starts per 16), from the tile's header (d, dmin halves and
// scale bytes, see input_major.h); sub-blocks with nothing listed are skipped.
template <int TYPE>
inline void listed_scales(const uint8_t* sb, int64_t Np, int64_t g, const int32_t* st, float* d,
                          float* dmin, float (*a)[GROUP], float (*b)[GROUP]) {
    constexpr int SUB = sub_inputs(TYPE), SUBS = super_inputs(TYPE) / SUB;
    if constexpr (!float_type(TYPE)) halves(sb + g * GROUP * 2, GROUP, d);
    if constexpr (has_min(TYPE)) halves(sb + 2 * Np + g * GROUP * 2, GROUP, dmin);
    const uint8_t* scales = sb + (has_min(TYPE) ? 4 : 2) * Np + g * GROUP;
    for (int s = 0; s < SUBS; ++s)
        if (st[s * SUB / 16] < st[(s + 1) * SUB / 16])
            group_scales<TYPE>(scales, Np, s, d, dmin, a[s], b[s]);
}

// Groups [ga, gb) of one weight for rows of x in tiles of TT.
template <class P, int TYPE, int TT>
void run_groups(const Weight& w, int64_t ga, int64_t gb, const Listed& li, float* y,
                int64_t ldy) {
    constexpr int QK = super_inputs(TYPE), SUB = sub_inputs(TYPE), SUBS = QK / SUB;
    constexpr int LB = low_bytes(TYPE), HB = high_bytes(TYPE), L = P::L;
    constexpr int PASSES = GROUP / (4 * L);
    using F = typename P::F;
    const Tiles& t = w.lay;
    const int64_t Np = t.padded(), K16 = li.K / 16, run = t.run(), high = t.high_at();
    const int64_t n_listed = li.start16[K16];
    const int32_t* cols = li.cols;
    alignas(64) float d[GROUP], dmin[GROUP], a[SUBS][GROUP], b[SUBS][GROUP];
    if (t.supers() > 0) prefetch_super<TYPE>(w, 0, ga, gb, li);
    for (int64_t kb = 0; kb < t.supers(); ++kb) {
        if (kb + 1 < t.supers()) prefetch_super<TYPE>(w, kb + 1, ga, gb, li);
        const uint8_t* sb = w.p + kb * t.super_bytes();
        const uint8_t* in0 = sb + t.header();
        const int32_t* st = li.start16 + kb * QK / 16;
        if (st[0] == st[QK / 16]) continue;  // no input of this super-block listed
        for (int64_t g = ga; g < gb; ++g) {
            listed_scales<TYPE>(sb, Np, g, st, d, dmin, a, b);
            for (int64_t t0 = 0; t0 < li.T; t0 += TT) {
                const float* xs = li.xs + t0 / TT * n_listed * TT;
                const int tt = int(std::min<int64_t>(TT, li.T - t0));
                for (int pass = 0; pass < PASSES; ++pass) {
                    const int64_t c = w.col0 + g * GROUP + pass * 4 * L;
                    F Y[TT][4];
#pragma GCC unroll 16
                    for (int r = 0; r < TT; ++r)
                        for (int v = 0; v < 4; ++v)
                            Y[r][v] = r < tt ? P::load(y + (t0 + r) * ldy + c + v * L) : P::zero();
                    for (int s = 0; s < SUBS; ++s) {
                        const int64_t j0 = st[s * SUB / 16], j1 = st[(s + 1) * SUB / 16];
                        if (j0 == j1) continue;
                        F acc[TT][4];
#pragma GCC unroll 16
                        for (int r = 0; r < TT; ++r)
                            for (int v = 0; v < 4; ++v) acc[r][v] = P::zero();
                        const uint8_t* base = in0 - kb * QK * run;  // + cols[j] * run: input j's run
                        for (int64_t j = j0; j < j1; ++j) {
                            const uint8_t* in = base + cols[j] * run;
                            F q[4];
                            P::template decode<TYPE>(in + g * LB, in + high + g * HB, pass, q);
#pragma GCC unroll 16
                            for (int r = 0; r < TT; ++r) {
                                const F xv = P::set1(xs[j * TT + r]);
                                for (int v = 0; v < 4; ++v) acc[r][v] = P::fma(xv, q[v], acc[r][v]);
                            }
                        }
                        const int64_t c16 = (kb * QK + s * SUB) / 16;
#pragma GCC unroll 16
                        for (int r = 0; r < TT; ++r) {
                            const float* sx = li.sx16 + std::min<int64_t>(t0 + r, li.T - 1) * K16 + c16;
                            const F sum = P::set1(SUB == 16 ? sx[0] : sx[0] + sx[1]);
                            for (int v = 0; v < 4; ++v) {
                                const int o = pass * 4 * L + v * L;
                                Y[r][v] = P::fma(P::load(a[s] + o), acc[r][v], Y[r][v]);
                                if constexpr (has_min(TYPE)) Y[r][v] = P::fma(P::load(b[s] + o), sum, Y[r][v]);
                            }
                        }
                    }
                    for (int r = 0; r < tt; ++r)
                        for (int v = 0; v < 4; ++v) P::store(y + (t0 + r) * ldy + c + v * L, Y[r][v]);
                }
            }
        }
    }
}

// The same walk for the 4-, 5- and 6-bit types, on integers: per sub-block, each row of x's
// int16 sums of xq_i * q_i (moved to int32 every flush_every inputs), then
// y += dx * (a * sum + b * sum(xq)).
template <class P, class PI, int TYPE, int TT>
void run_groups_int(const Weight& w, int64_t ga, int64_t gb, const Listed& li, float* y,
                    int64_t ldy) {
    constexpr int QK = super_inputs(TYPE), SUB = sub_inputs(TYPE), SUBS = QK / SUB;
    constexpr int LB = low_bytes(TYPE), HB = high_bytes(TYPE), L = P::L, NV = PI::NV;
    constexpr int FLUSH = flush_every(TYPE);
    using F = typename P::F;
    using V = typename PI::V;
    const Tiles& t = w.lay;
    const int64_t Np = t.padded(), K16 = li.K / 16, run = t.run(), high = t.high_at();
    const int64_t n_listed = li.start16[K16], blocks = li.K / QK;
    const int32_t* cols = li.cols;
    const XInt& xi = QK == 256 ? *li.x256 : *li.x32;
    alignas(64) float d[GROUP], dmin[GROUP], a[SUBS][GROUP], b[SUBS][GROUP];
    alignas(64) int32_t acc32[TT][GROUP];
    if (t.supers() > 0) prefetch_super<TYPE>(w, 0, ga, gb, li);
    for (int64_t kb = 0; kb < t.supers(); ++kb) {
        if (kb + 1 < t.supers()) prefetch_super<TYPE>(w, kb + 1, ga, gb, li);
        const uint8_t* sb = w.p + kb * t.super_bytes();
        const int32_t* st = li.start16 + kb * QK / 16;
        if (st[0] == st[QK / 16]) continue;  // no input of this super-block listed
        const uint8_t* base = sb + t.header() - kb * QK * run;  // + cols[j] * run: input j's run
        for (int64_t g = ga; g < gb; ++g) {
            listed_scales<TYPE>(sb, Np, g, st, d, dmin, a, b);
            for (int64_t t0 = 0; t0 < li.T; t0 += TT) {
                const int16_t* xq = xi.xq.data() + t0 / TT * n_listed * TT;
                const int tt = int(std::min<int64_t>(TT, li.T - t0));
                for (int s = 0; s < SUBS; ++s) {
                    const int64_t j0 = st[s * SUB / 16], j1 = st[(s + 1) * SUB / 16];
                    if (j0 == j1) continue;
                    std::memset(acc32, 0, sizeof acc32);
                    V acc[TT][NV];
#pragma GCC unroll 16
                    for (int r = 0; r < TT; ++r)
                        for (int v = 0; v < NV; ++v) acc[r][v] = PI::zero();
                    int count = 0;
                    for (int64_t j = j0; j < j1; ++j) {
                        const uint8_t* in = base + cols[j] * run;
                        V q[NV];
                        PI::template decode16<TYPE>(in + g * LB, in + high + g * HB, q);
#pragma GCC unroll 16
                        for (int r = 0; r < TT; ++r) {
                            const int x = xq[j * TT + r];
                            for (int v = 0; v < NV; ++v) acc[r][v] = PI::madd(acc[r][v], q[v], x);
                        }
                        if (++count == FLUSH) {
                            for (int r = 0; r < TT; ++r) {
                                PI::flush(acc[r], acc32[r]);
                                for (int v = 0; v < NV; ++v) acc[r][v] = PI::zero();
                            }
                            count = 0;
                        }
                    }
                    if (count)
                        for (int r = 0; r < TT; ++r) PI::flush(acc[r], acc32[r]);
                    const int64_t c16 = (kb * QK + s * SUB) / 16;
                    for (int r = 0; r < tt; ++r) {
                        const int64_t row = t0 + r;
                        const int32_t* s16 = xi.s16.data() + row * K16 + c16;
                        const F sum = P::set1(float(SUB == 16 ? s16[0] : s16[0] + s16[1]));
                        const F dx = P::set1(xi.d[row * blocks + kb]);
                        float* yr = y + row * ldy + w.col0 + g * GROUP;
                        for (int o = 0; o < GROUP; o += L) {
                            F v = P::mul(P::load(a[s] + o), P::load_i32(acc32[r] + o));
                            if constexpr (has_min(TYPE)) v = P::fma(P::load(b[s] + o), sum, v);
                            P::store(yr + o, P::fma(dx, v, P::load(yr + o)));
                        }
                    }
                }
            }
        }
    }
}

using RunFn = void (*)(const Weight&, int64_t, int64_t, const Listed&, float*, int64_t);

struct PathKernels {
    RunFn one, many;  // one row of x; tiles of `tokens` rows
    int tokens;
};

template <class P, class PI, int TYPE, int TT>
PathKernels kernels_of() {
    if constexpr (int_type(TYPE))
        return {run_groups_int<P, PI, TYPE, 1>, run_groups_int<P, PI, TYPE, TT>, TT};
    else
        return {run_groups<P, TYPE, 1>, run_groups<P, TYPE, TT>, TT};
}

template <class P, class PI, int TT>
PathKernels path_kernels(int type) {
    switch (type) {
        case Q4_0: return kernels_of<P, PI, Q4_0, TT>();
        case Q4_1: return kernels_of<P, PI, Q4_1, TT>();
        case Q5_0: return kernels_of<P, PI, Q5_0, TT>();
        case Q5_1: return kernels_of<P, PI, Q5_1, TT>();
        case Q8_0: return kernels_of<P, PI, Q8_0, TT>();
        case Q4_K: return kernels_of<P, PI, Q4_K, TT>();
        case Q5_K: return kernels_of<P, PI, Q5_K, TT>();
        case Q6_K: return kernels_of<P, PI, Q6_K, TT>();
        case F32: return kernels_of<P, PI, F32, TT>();
        case F16: return kernels_of<P, PI, F16, TT>();
        default: return kernels_of<P, PI, BF16, TT>();
    }
}

// Registers: AVX-512 holds 4 rows of x x 4 vectors of accumulators; AVX2 and portable 2 x 4.
PathKernels kernels(int type) {
    const std::string path = cpu_path();  // block_matmul's choice (EMBER_CPU_PATH, set_cpu_path)
#ifdef EMBER_IM_AVX512
    if (path == "avx512") return path_kernels<Avx512, Avx512Int, 4>(type);
#endif
#ifdef EMBER_IM_AVX2
    if (path == "avx2") return path_kernels<Avx2, Avx2Int, 2>(type);
#endif
    return path_kernels<Portable, PortableInt, 2>(type);
}

// x as the integer kernels read it: per row, its kept values (the others 0) rounded to int8 per
// block of B as the dense kernel rounds them (quantize_block), listed per tile of TT rows.
template <class Kept>
void round_x(const float* xp, int64_t T, int64_t K, int B, const Kept& kept,
             const std::vector<int32_t>& cols, int TT, XInt& out) {
    const int64_t n = int64_t(cols.size()), tiles = (T + TT - 1) / TT;
    out.xq.assign(tiles * n * TT, 0);
    out.d.assign(T * (K / B), 0.f);
    out.s16.assign(T * (K / 16), 0);
    std::vector<float> v(K);
    std::vector<int8_t> q(K);
    std::vector<int16_t> sum8(K / 8);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < K; ++i) v[i] = kept(t, i) ? xp[t * K + i] : 0.f;
        quantize_row(v.data(), K, B, q.data(), out.d.data() + t * (K / B), sum8.data());
        for (int64_t c = 0; c < K / 16; ++c) out.s16[t * (K / 16) + c] = sum8[2 * c] + sum8[2 * c + 1];
        for (int64_t j = 0; j < n; ++j) out.xq[(t / TT * n + j) * TT + t % TT] = q[cols[j]];
    }
}

}  // namespace

at::Tensor input_sparse_matmul(at::Tensor x, const std::vector<at::Tensor>& packed,
                               const std::vector<int64_t>& types, const std::vector<int64_t>& n_out,
                               double threshold, c10::optional<at::Tensor> stats) {
    TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                      "x must be a contiguous float32 (T, K) tensor");
    TORCH_CHECK_VALUE(packed.size() == types.size() && packed.size() == n_out.size(),
                      "one type and one N per tiled weight");
    const int64_t T = x.size(0), K = x.size(1);
    TORCH_CHECK_VALUE(K % 32 == 0, "x has ", K, " columns: tiled weights take whole blocks of 32");
    std::vector<Weight> ws;
    std::vector<PathKernels> ks;
    int64_t width = 0, padded = 0, groups = 0;
    for (size_t i = 0; i < packed.size(); ++i) {
        const Tiles lay = checked_tiles(types[i], n_out[i], K, "input_sparse_matmul");
        TORCH_CHECK_VALUE(packed[i].scalar_type() == at::kByte && packed[i].is_contiguous() &&
                              packed[i].numel() == lay.bytes(),
                          "tiled weight ", i, " does not fit (type, N, K or bytes)");
        ws.push_back(Weight{packed[i].data_ptr<uint8_t>(), lay, padded});
        ks.push_back(kernels(lay.type));
        width += lay.N;
        padded += lay.padded();
        groups += lay.groups();
    }
    const float* xp = x.data_ptr<float>();
    const bool sparse = threshold >= 0;
    const float thr = float(threshold);
    auto kept = [&](int64_t t, int64_t i) { return !sparse || std::fabs(xp[t * K + i]) > thr; };
    // The inputs read: those that some row keeps (all without a threshold).
    std::vector<int32_t> cols;
    cols.reserve(K);
    std::vector<int32_t> start16(K / 16 + 1, 0);
    for (int64_t i = 0; i < K; ++i) {
        bool keep = false;
        for (int64_t t = 0; t < T && !keep; ++t) keep = kept(t, i);
        if (keep) cols.push_back(int32_t(i));
        if (i % 16 == 15) start16[i / 16 + 1] = int32_t(cols.size());
    }
    const int64_t n = int64_t(cols.size());
    if (stats.has_value()) {  // [kept, total] input values, across calls
        int64_t kept_values = 0;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < K; ++i) kept_values += kept(t, i);
        int64_t* s = stats->data_ptr<int64_t>();
        s[0] += kept_values;
        s[1] += T * K;
    }
    auto yp = at::zeros({T, padded}, x.options());
    if (width == 0 || T == 0) return yp.narrow(1, 0, width);
    // The float path's x (Q8_0, F32, F16, BF16 weights only; the others read x as XInt): per
    // tile of TT rows, per listed input, the rows' values (dropped ones and rows past T 0); per
    // row, sums of its kept values per 16 inputs, in order.
    const int TT = T == 1 ? 1 : ks[0].tokens;
    const int64_t tiles = (T + TT - 1) / TT;
    const bool float_x = std::any_of(ws.begin(), ws.end(),
                                     [](const Weight& w) { return !int_type(w.lay.type); });
    std::vector<float> xs(float_x ? tiles * n * TT : 0, 0.f), sx16(float_x ? T * (K / 16) : 0, 0.f);
    for (int64_t t = 0; t < (float_x ? T : 0); ++t) {
        for (int64_t j = 0; j < n; ++j)
            if (kept(t, cols[j])) xs[(t / TT * n + j) * TT + t % TT] = xp[t * K + cols[j]];
        for (int64_t c = 0; c < K / 16; ++c) {
            float s = 0.f;
            for (int64_t i = 16 * c; i < 16 * c + 16; ++i)
                if (kept(t, i)) s += xp[t * K + i];
            sx16[t * (K / 16) + c] = s;
        }
    }
    XInt x32, x256;
    for (const Weight& w : ws)
        if (int_type(w.lay.type)) {
            XInt& xi = super_inputs(w.lay.type) == 256 ? x256 : x32;
            if (xi.d.empty()) round_x(xp, T, K, super_inputs(w.lay.type), kept, cols, TT, xi);
        }
    const Listed li{T, K, cols.data(), start16.data(), xs.data(), sx16.data(), &x32, &x256};
    float* y = yp.data_ptr<float>();
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t grain = std::max<int64_t>(1, (groups + threads - 1) / threads);
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        int64_t first = 0;
        for (size_t i = 0; i < ws.size(); ++i) {
            const int64_t ng = ws[i].lay.groups();
            const int64_t lo = std::max(g0 - first, int64_t(0)), hi = std::min(g1 - first, ng);
            if (lo < hi) (T == 1 ? ks[i].one : ks[i].many)(ws[i], lo, hi, li, y, padded);
            first += ng;
        }
    });
    if (padded == width) return yp;
    // Drop the padding rows of each weight.
    auto out = at::empty({T, width}, x.options());
    int64_t at_col = 0;
    for (const Weight& w : ws) {
        out.narrow(1, at_col, w.lay.N).copy_(yp.narrow(1, w.col0, w.lay.N));
        at_col += w.lay.N;
    }
    return out;
}
