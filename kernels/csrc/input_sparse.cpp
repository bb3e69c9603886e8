// y = x @ W^T reading only the weight columns of the inputs that survive a threshold
// (|x_i| > threshold), over W's input-major layout (input_major.h), derived once from the
// file's blocks by im_relayout. Python side, reference and measurements:
// kernels/input_sparse.py.
//
// Decode (T = 1): the surviving inputs are listed once; each thread owns a run of 32-output
// blocks and, per chunk, keeps up to 256 outputs in registers while it walks the survivors'
// column rows (prefetched a few survivors ahead), so a dropped input costs no bytes. Prefill
// (T > 1): every input (or, with a threshold, every input some row keeps, the others' values
// zeroed), in tiles of tokens per 32-output block.
//
// Arithmetic: each output is acc = fma(x_i * d, q - offset, acc) over the listed inputs in
// order (d the block's scale, q its quants), on every CPU path, so the paths agree bit for bit,
// a row's outputs do not depend on the other rows (batch invariance), and a thresholded row
// gives exactly the bits of its masked dense product (a zeroed input adds +-0).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "input_major.h"
#include "ops.h"

namespace {

using namespace ember_im;

constexpr int PREFETCH_SURVIVORS = 4;  // column rows ahead (~4 x 144 bytes in flight per thread)

// The kernels keep up to 16 vectors of outputs in named variables a0..a15: GCC keeps an array
// of vector accumulators in memory, storing it back every iteration (seen in the assembly).
#define EMBER_IM_ACC                                                                        \
    typename P::F a0 = P::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, \
                  a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0
#define EMBER_IM_STORE(count, at)                                                            \
    {                                                                                         \
        const typename P::F all[16] = {a0, a1, a2, a3, a4, a5, a6, a7,                        \
                                       a8, a9, a10, a11, a12, a13, a14, a15};                 \
        for (int v = 0; v < (count); ++v) P::store(at(v), all[v]);                            \
    }
// Slot group g (g < G) of V vectors: x_g += s * q[0..V).
#define EMBER_IM_FMA2(g, G, s, x0, x1)                                                        \
    if constexpr ((g) < (G)) { x0 = P::fma(s, q[0], x0); x1 = P::fma(s, q[1], x1); }
#define EMBER_IM_FMA4(g, G, s, x0, x1, x2, x3)                                                \
    if constexpr ((g) < (G)) {                                                                \
        x0 = P::fma(s, q[0], x0); x1 = P::fma(s, q[1], x1);                                   \
        x2 = P::fma(s, q[2], x2); x3 = P::fma(s, q[3], x3);                                   \
    }

// Outputs [0, NB * 32) of one chunk: y = sum over j of xs[j] * column cols[j] (T = 1).
template <class P, int TYPE, int NB>
void decode_rows(const uint8_t* base, int64_t stride, const int32_t* cols, int64_t n,
                 const float* xs, float* y) {
    constexpr int V = BLOCK / P::L, BB = block_bytes(TYPE);
    static_assert(NB * V <= 16 && (V == 2 || V == 4), "16 accumulators at most");
    EMBER_IM_ACC;
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* col = base + cols[j] * stride;
        if (j + PREFETCH_SURVIVORS < n) {
            const uint8_t* next = base + cols[j + PREFETCH_SURVIVORS] * stride;
            for (int o = 0; o < NB * BB; o += 64) P::prefetch(next + o);
        }
        const float xj = xs[j];
        // block b of the column -> its q and s = x_j * d, then its V accumulators
#define EMBER_IM_BLOCK(b)                                           \
        typename P::F q[V];                                         \
        if constexpr ((b) < NB) P::template decode<TYPE>(col + (b) * BB, q); \
        const auto s = (b) < NB ? P::set1(xj * P::half(col + (b) * BB)) : P::zero();
        if constexpr (V == 2) {
            { EMBER_IM_BLOCK(0) EMBER_IM_FMA2(0, NB, s, a0, a1) }
            { EMBER_IM_BLOCK(1) EMBER_IM_FMA2(1, NB, s, a2, a3) }
            { EMBER_IM_BLOCK(2) EMBER_IM_FMA2(2, NB, s, a4, a5) }
            { EMBER_IM_BLOCK(3) EMBER_IM_FMA2(3, NB, s, a6, a7) }
            { EMBER_IM_BLOCK(4) EMBER_IM_FMA2(4, NB, s, a8, a9) }
            { EMBER_IM_BLOCK(5) EMBER_IM_FMA2(5, NB, s, a10, a11) }
            { EMBER_IM_BLOCK(6) EMBER_IM_FMA2(6, NB, s, a12, a13) }
            { EMBER_IM_BLOCK(7) EMBER_IM_FMA2(7, NB, s, a14, a15) }
        } else {
            { EMBER_IM_BLOCK(0) EMBER_IM_FMA4(0, NB, s, a0, a1, a2, a3) }
            { EMBER_IM_BLOCK(1) EMBER_IM_FMA4(1, NB, s, a4, a5, a6, a7) }
            { EMBER_IM_BLOCK(2) EMBER_IM_FMA4(2, NB, s, a8, a9, a10, a11) }
            { EMBER_IM_BLOCK(3) EMBER_IM_FMA4(3, NB, s, a12, a13, a14, a15) }
        }
#undef EMBER_IM_BLOCK
    }
    auto at = [&](int v) { return y + v * P::L; };
    EMBER_IM_STORE(NB * V, at)
}

// One 32-output block for TT tokens: xs holds, per listed input, the TT tokens' values.
template <class P, int TYPE, int TT>
void prefill_block(const uint8_t* base, int64_t stride, const int32_t* cols, int64_t n,
                   const float* xs, int tt, float* y, int64_t ldy) {
    constexpr int V = BLOCK / P::L;
    static_assert(TT * V <= 16 && (V == 2 || V == 4), "16 accumulators at most");
    EMBER_IM_ACC;
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* blk = base + cols[j] * stride;
        const float d = P::half(blk);
        typename P::F q[V];
        P::template decode<TYPE>(blk, q);
        const float* xj = xs + j * TT;
#define EMBER_IM_S(t) const auto s##t = (t) < TT ? P::set1(xj[(t) < TT ? (t) : 0] * d) : P::zero();
        if constexpr (V == 2) {
            { EMBER_IM_S(0) EMBER_IM_FMA2(0, TT, s0, a0, a1) }
            { EMBER_IM_S(1) EMBER_IM_FMA2(1, TT, s1, a2, a3) }
            { EMBER_IM_S(2) EMBER_IM_FMA2(2, TT, s2, a4, a5) }
            { EMBER_IM_S(3) EMBER_IM_FMA2(3, TT, s3, a6, a7) }
            { EMBER_IM_S(4) EMBER_IM_FMA2(4, TT, s4, a8, a9) }
            { EMBER_IM_S(5) EMBER_IM_FMA2(5, TT, s5, a10, a11) }
            { EMBER_IM_S(6) EMBER_IM_FMA2(6, TT, s6, a12, a13) }
            { EMBER_IM_S(7) EMBER_IM_FMA2(7, TT, s7, a14, a15) }
        } else {
            { EMBER_IM_S(0) EMBER_IM_FMA4(0, TT, s0, a0, a1, a2, a3) }
            { EMBER_IM_S(1) EMBER_IM_FMA4(1, TT, s1, a4, a5, a6, a7) }
            { EMBER_IM_S(2) EMBER_IM_FMA4(2, TT, s2, a8, a9, a10, a11) }
            { EMBER_IM_S(3) EMBER_IM_FMA4(3, TT, s3, a12, a13, a14, a15) }
        }
#undef EMBER_IM_S
    }
    auto at = [&](int v) { return y + (v / V) * ldy + (v % V) * P::L; };
    EMBER_IM_STORE(tt * V, at)
}

// A path's kernels for one type: decode over 1..8 blocks, prefill over TT tokens.
struct Kernels {
    void (*decode[CHUNK_BLOCKS + 1])(const uint8_t*, int64_t, const int32_t*, int64_t,
                                      const float*, float*);
    void (*prefill)(const uint8_t*, int64_t, const int32_t*, int64_t, const float*, int, float*,
                    int64_t);
    int max_blocks;  // decode outputs kept in registers: max_blocks * 32
    int tokens;      // TT
};

using DecodeFn = void (*)(const uint8_t*, int64_t, const int32_t*, int64_t, const float*, float*);

template <class P, int TYPE, int NB, int MAXB>
constexpr DecodeFn decode_fn() {
    if constexpr (NB <= MAXB) return decode_rows<P, TYPE, NB>;
    else return nullptr;
}

template <class P, int TYPE, int MAXB, int TT>
constexpr Kernels kernels_for() {
    return Kernels{{nullptr, decode_fn<P, TYPE, 1, MAXB>(), decode_fn<P, TYPE, 2, MAXB>(),
                    decode_fn<P, TYPE, 3, MAXB>(), decode_fn<P, TYPE, 4, MAXB>(),
                    decode_fn<P, TYPE, 5, MAXB>(), decode_fn<P, TYPE, 6, MAXB>(),
                    decode_fn<P, TYPE, 7, MAXB>(), decode_fn<P, TYPE, 8, MAXB>()},
                   prefill_block<P, TYPE, TT>, MAXB, TT};
}

// Registers: AVX-512 keeps 8 blocks (16 zmm) or 8 tokens x 1 block; AVX2 and portable half.
template <class P, int MAXB, int TT>
const Kernels* path_kernels(int type) {
    static const Kernels k4 = kernels_for<P, Q4_0, MAXB, TT>(), k5 = kernels_for<P, Q5_0, MAXB, TT>(),
                         k8 = kernels_for<P, Q8_0, MAXB, TT>();
    return type == Q4_0 ? &k4 : type == Q5_0 ? &k5 : &k8;
}

const Kernels* kernels(int type) {
    const std::string path = cpu_path();  // block_matmul's choice (EMBER_CPU_PATH, set_cpu_path)
#ifdef EMBER_IM_AVX512
    if (path == "avx512") return path_kernels<Avx512, 8, 8>(type);
#endif
#ifdef EMBER_IM_AVX2
    if (path == "avx2") return path_kernels<Avx2, 4, 4>(type);
#endif
    return path_kernels<Portable, 4, 4>(type);
}

struct Weight {
    const uint8_t* p;
    Layout lay;
    int64_t col0;  // first output column in y
    const Kernels* k;
};

// Output blocks [g0, g1) of the call (all weights' blocks in order) for T = 1.
void decode_range(const std::vector<Weight>& ws, int64_t g0, int64_t g1, const int32_t* cols,
                  int64_t n, const float* xs, float* y) {
    int64_t first = 0;
    for (const Weight& w : ws) {
        const int64_t nb = w.lay.N / BLOCK, lo = std::max(g0 - first, int64_t(0)),
                      hi = std::min(g1 - first, nb);
        for (int64_t b = lo; b < hi;) {
            const int64_t c = b / CHUNK_BLOCKS, in = b % CHUNK_BLOCKS;
            const int64_t end = std::min({hi, c * CHUNK_BLOCKS + w.lay.blocks_in(c),
                                          b + w.k->max_blocks});
            const uint8_t* base = w.p + w.lay.chunk_offset(c) + in * block_bytes(w.lay.type);
            w.k->decode[end - b](base, w.lay.row_bytes(c), cols, n, xs, y + w.col0 + b * BLOCK);
            b = end;
        }
        first += nb;
    }
}

// The same blocks for T rows, tokens in tiles (xs: per tile, per listed input, TT values).
void prefill_range(const std::vector<Weight>& ws, int64_t g0, int64_t g1, const int32_t* cols,
                   int64_t n, const float* xs, int64_t T, float* y, int64_t ldy) {
    int64_t first = 0;
    for (const Weight& w : ws) {
        const int64_t nb = w.lay.N / BLOCK, lo = std::max(g0 - first, int64_t(0)),
                      hi = std::min(g1 - first, nb);
        const int TT = w.k->tokens;
        for (int64_t b = lo; b < hi; ++b) {
            const int64_t c = b / CHUNK_BLOCKS, in = b % CHUNK_BLOCKS;
            const uint8_t* base = w.p + w.lay.chunk_offset(c) + in * block_bytes(w.lay.type);
            for (int64_t t0 = 0; t0 < T; t0 += TT)
                w.k->prefill(base, w.lay.row_bytes(c), cols, n, xs + t0 / TT * n * TT,
                             int(std::min<int64_t>(TT, T - t0)), y + t0 * ldy + w.col0 + b * BLOCK,
                             ldy);
        }
        first += nb;
    }
}

}  // namespace

at::Tensor im_relayout(at::Tensor rows, int64_t qtype, int64_t N, int64_t K, int64_t im) {
    TORCH_CHECK_VALUE(im_type(im), "input-major blocks are Q4_0, Q5_0 or Q8_0 (GGML ids 2, 6, 8)");
    TORCH_CHECK_VALUE(N % BLOCK == 0, "an input-major weight needs whole 32-output blocks, N=", N);
    const int ti = type_index(qtype);
    TORCH_CHECK_VALUE(ti >= 0, "GGML type ", qtype, " is not read natively");
    const TypeInfo& info = TYPES[ti];
    TORCH_CHECK_VALUE(K % info.values == 0, "K=", K, " is not whole ", info.name, " blocks");
    const int64_t rb = K / info.values * info.bytes;
    TORCH_CHECK_VALUE(rows.scalar_type() == at::kByte && rows.is_contiguous() &&
                          rows.numel() == N * rb,
                      "rows must be the weight's ", N * rb, " contiguous bytes");
    const Layout lay{int(im), N, K};
    auto out = at::empty({lay.bytes()}, rows.options());
    const uint8_t* src = rows.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const int bb = block_bytes(int(im));
    at::parallel_for(0, lay.chunks(), 1, [&](int64_t c0, int64_t c1) {
        std::vector<float> w(CHUNK * K), col(CHUNK);
        for (int64_t c = c0; c < c1; ++c) {
            const int64_t n = lay.blocks_in(c) * BLOCK;
            for (int64_t r = 0; r < n; ++r)
                dequantize_one(int(qtype), src + (c * CHUNK + r) * rb, K, w.data() + r * K);
            uint8_t* chunk = dst + lay.chunk_offset(c);
            for (int64_t i = 0; i < K; ++i) {
                for (int64_t r = 0; r < n; ++r) col[r] = w[r * K + i];
                for (int64_t b = 0; b < n / BLOCK; ++b)
                    quantize_block32(int(im), col.data() + b * BLOCK, chunk + i * lay.row_bytes(c) + b * bb);
            }
        }
    });
    return out;
}

at::Tensor input_sparse_matmul(at::Tensor x, const std::vector<at::Tensor>& packed,
                               const std::vector<int64_t>& types, const std::vector<int64_t>& n_out,
                               double threshold, c10::optional<at::Tensor> stats) {
    TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                      "x must be a contiguous float32 (T, K) tensor");
    TORCH_CHECK_VALUE(packed.size() == types.size() && packed.size() == n_out.size(),
                      "one type and one N per input-major weight");
    const int64_t T = x.size(0), K = x.size(1);
    std::vector<Weight> ws;
    int64_t width = 0, blocks = 0;
    for (size_t i = 0; i < packed.size(); ++i) {
        const Layout lay{int(types[i]), n_out[i], K};
        TORCH_CHECK_VALUE(im_type(types[i]) && lay.N % BLOCK == 0 &&
                              packed[i].scalar_type() == at::kByte && packed[i].is_contiguous() &&
                              packed[i].numel() == lay.bytes(),
                          "input-major weight ", i, " does not fit (type, N, K or bytes)");
        ws.push_back(Weight{packed[i].data_ptr<uint8_t>(), lay, width, kernels(lay.type)});
        width += lay.N;
        blocks += lay.N / BLOCK;
    }
    auto y = at::empty({T, width}, x.options());
    const float* xp = x.data_ptr<float>();
    const bool sparse = threshold >= 0;
    const float thr = float(threshold);
    // The inputs read: those that some row keeps (all without a threshold).
    std::vector<int32_t> cols;
    cols.reserve(K);
    int64_t kept_values = 0;
    for (int64_t i = 0; i < K; ++i) {
        bool keep = !sparse;
        for (int64_t t = 0; t < T && !keep; ++t) keep = std::fabs(xp[t * K + i]) > thr;
        if (keep) cols.push_back(int32_t(i));
    }
    const int64_t n = int64_t(cols.size());
    if (stats.has_value()) {  // [kept, total] input values, across calls
        for (int64_t t = 0; t < T && sparse; ++t)
            for (int64_t i = 0; i < K; ++i) kept_values += std::fabs(xp[t * K + i]) > thr;
        int64_t* s = stats->data_ptr<int64_t>();
        s[0] += sparse ? kept_values : T * K;
        s[1] += T * K;
    }
    if (width == 0) return y;
    const int64_t grain = std::max<int64_t>(1, blocks / std::max<int64_t>(1, at::get_num_threads()));
    if (T == 1) {
        std::vector<float> xs(n);
        for (int64_t j = 0; j < n; ++j) xs[j] = xp[cols[j]];
        at::parallel_for(0, blocks, grain, [&](int64_t g0, int64_t g1) {
            decode_range(ws, g0, g1, cols.data(), n, xs.data(), y.data_ptr<float>());
        });
        return y;
    }
    // x per token tile, per listed input, the tile's values (dropped ones as 0; rows past T 0).
    const int TT = ws.empty() ? 1 : ws[0].k->tokens;
    const int64_t tiles = (T + TT - 1) / TT;
    std::vector<float> xs(tiles * n * TT, 0.f);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < n; ++j) {
            const float v = xp[t * K + cols[j]];
            xs[(t / TT * n + j) * TT + t % TT] = sparse && !(std::fabs(v) > thr) ? 0.f : v;
        }
    at::parallel_for(0, blocks, grain, [&](int64_t g0, int64_t g1) {
        prefill_range(ws, g0, g1, cols.data(), n, xs.data(), T, y.data_ptr<float>(), width);
    });
    return y;
}
