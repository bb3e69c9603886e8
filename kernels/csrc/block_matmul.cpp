// y = x @ W^T with W read straight from its GGML blocks (the file's own bytes: no float copy,
// no requantized copy), for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32.
// Several weights sharing K go in one call (q/k/v, gate/up): x is quantized once, and the
// outputs sit side by side in one (T, sum N) tensor.
//
// Arithmetic (as llama.cpp's CPU backend, so that quality matches it): x is quantized per row,
// to int8 per 32 values for the 32-value types (Q8_0-style) and per 256 for the K-quants
// (Q8_K-style), see block_formats.h; each block's dot product is exact integer arithmetic, then
// the block's float scales and one fma into the output's float accumulator. F16/BF16/F32
// weights multiply x in float32. kernels/block_matmul.py has the reference in PyTorch.
//
// Batch invariance: x rows are quantized independently, and each output element is computed
// by one thread with the same instructions whatever T is and however rows and tokens are
// tiled or split, so a row of x gives bit-identical outputs alone or among any others (what
// speculative verification relies on).
//
// CPU paths: a table of kernel sets ("portable", "avx2", and "avx512" in a build for AVX-512
// VNNI CPUs), one picked at first use from the CPU or EMBER_CPU_PATH, switchable for tests
// (block_paths.cpp). Whole tiles of 16 rows of x go through a path's prefill kernel where it
// has one, the rest through its row kernels. All paths give the same bits for the K-quants,
// AVX2 and AVX-512 the same for every type; each is batch-invariant.
//
// Row groups: a K-quant weight may also come as (N / 16, 16, row_bytes), its rows interleaved
// block by block in groups of 16 (block_formats.h:block_at; models/weights.py makes them),
// which one token reads on AVX-512 through block_gemv_groups_avx512.h (one sequential stream,
// 16 rows in lanes) and more tokens through the AVX-512 kernels above, told so by a template
// switch. The other paths take each tile of such a weight back to the file's row layout in a
// thread's scratch first (tests, a path forced by EMBER_CPU_PATH): the same bits either way.
//
// Measured figures (decode GB/s against a plain read, prefill GOPS, what was tried and left):
// docs/internals.md, "Block kernel figures".
//
// Narrow includes (as q8_0_matmul.cpp): the JIT build is much faster than <torch/extension.h>.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "block_formats.h"
#include "block_paths.h"
#include "row_groups.h"
#include "x_quant.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace ember_blocks;

// Tokens per tile: each weight block is unpacked once per tile. The driver hands out tiles of
// up to TOKEN_TILE tokens; a kernel splits them into its own Kernel::TILE: 8 for the AVX2
// quant kernels (1 thread, per token against 4: Q5_0 and Q8_0 ~10% faster, Q4_0/Q4_K a few
// %), 4 where 8 tokens' accumulators would not fit in registers (float weights, portable).
constexpr int TOKEN_TILE = 8;

// ---- work split ------------------------------------------------------------------------------

// Threads take contiguous row ranges from a shared counter: long contiguous runs stream far
// better than alternating small chunks (~35% on these machines, see q8_0_matmul.cpp), and a
// counter lets one thread take the rest when the other is preempted. Ranges shrink as the call
// goes (each 1/(2 * threads) of the bytes left, 64 KiB..4 MiB), so that the threads finish
// close together: at one token a call is a few hundred microseconds, and one thread waiting
// out the other's last long range cost ~3% of decode (measured on the 1.1B model). Within a
// range, rows go in tiles of ~16 KiB that stay in L1/L2 while every tile of tokens passes over
// them; ranges and tiles hold whole groups of LANE_ROWS where the prefill kernel wants them.
constexpr int64_t RANGE_MIN_BYTES = 64 << 10, RANGE_MAX_BYTES = 4 << 20, TILE_BYTES = 16 << 10;
constexpr int64_t TILE_MIN_ROWS = 4;

struct Weight {
    const uint8_t* p;
    int64_t n, row_bytes, col0;
    RowsFn fn;
    GemmFn gemm;
    bool grouped;    // rows in groups of LANE_ROWS, interleaved block by block
    int block_bytes;
    RowsFn gemv;     // one row of x, where it differs from fn (row groups on AVX-512)
    bool ungroup;    // the kernels read rows: each tile of the groups is taken back first
};

struct Range {
    int weight;
    int64_t r0, r1;
};

// Weight rows: contiguous uint8 (N, row_bytes), the same bytes flat (N * row_bytes,), or row
// groups (N / 16, 16, row_bytes) where `groups` allows them.
void check_rows(const at::Tensor& t, const char* what, bool groups = false) {
    const bool grouped = groups && t.dim() == 3 && t.size(1) == LANE_ROWS;
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kByte &&
                          (t.dim() == 2 || t.dim() == 1 || grouped) && t.is_contiguous(),
                      what, " must be a contiguous uint8 CPU tensor (N, row_bytes)",
                      groups ? " or row groups (N / 16, 16, row_bytes)" : "", ", got ",
                      t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
}

bool is_k_quant(int id) { return id == Q4_K || id == Q5_K || id == Q6_K; }

const TypeInfo& checked_type(int64_t qtype) {
    const int i = type_index(qtype);
    if (i < 0) {
        std::string names;
        for (const TypeInfo& t : TYPES) names += (names.empty() ? "" : ", ") + std::string(t.name);
        TORCH_CHECK_VALUE(false, "GGML type ", qtype, " is not read natively; supported: ", names);
    }
    return TYPES[i];
}

}  // namespace

at::Tensor block_matmul(at::Tensor x, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& qtypes) {
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                          x.is_contiguous(),
                      "x must be a contiguous float32 CPU tensor (T, K), got ", x.scalar_type(),
                      " of shape ", x.sizes());
    TORCH_CHECK_VALUE(weights.size() == qtypes.size(), "got ", weights.size(), " weights and ",
                      qtypes.size(), " types");
    const int64_t T = x.size(0), K = x.size(1);
    const CpuPath& path = current_path();
    std::vector<Weight> ws;
    ws.reserve(weights.size());
    int64_t n_total = 0, total_bytes = 0;
    bool q32 = false, qk = false;
    for (size_t i = 0; i < weights.size(); ++i) {
        const at::Tensor& w = weights[i];
        check_rows(w, "each weight", true);
        const TypeInfo& ti = checked_type(qtypes[i]);
        TORCH_CHECK_VALUE(K % ti.values == 0, "x has ", K, " columns, not a whole number of ",
                          ti.name, " blocks (", ti.values, " values each) for weight ", i);
        const bool grouped = w.dim() == 3;
        TORCH_CHECK_VALUE(!grouped || is_k_quant(ti.id), "row groups hold K-quants only, not ",
                          ti.name, " (weight ", i, ")");
        const int64_t rb = K / ti.values * ti.bytes;
        const int64_t n = w.dim() == 1 ? (rb > 0 ? w.numel() / rb : 0) : w.numel() / w.size(-1);
        TORCH_CHECK_VALUE(w.dim() == 1 ? n * rb == w.numel() : w.size(-1) == rb, "weight ", i, " (",
                          ti.name, ", shape ", w.sizes(), ") is not whole rows of x's ", K,
                          " columns (", rb, " bytes each)");
        const int t = &ti - TYPES;
        const bool in_place = grouped && path.group_rows[t];
        ws.push_back({w.data_ptr<uint8_t>(), n, rb, n_total, in_place ? path.group_rows[t] : path.rows[t],
                      in_place ? path.group_gemm[t] : path.gemm[t], grouped, ti.bytes,
                      in_place ? path.group_gemv[t] : nullptr, grouped && !in_place});
        n_total += n;
        total_bytes += n * rb;
        q32 |= ti.x == XStyle::Q32;
        qk |= ti.x == XStyle::QK;
    }
    auto y = at::empty({T, n_total}, x.options());
    if (T == 0 || n_total == 0 || K == 0) {
        if (K == 0) y.zero_();
        return y;
    }
    at::Tensor storage;
    const XLayouts layouts{path.quantize, path.pairs, path.gemm[type_index(Q4_K)] != nullptr,
                           path.gemm_layout == GemmLayout::Quads, path.gemm[type_index(Q4_0)] != nullptr,
                           path.lane_tokens};
    const XQuant a = quantize_x(x.data_ptr<float>(), T, K, q32, qk, layouts, storage);

    const int threads = std::max(1, at::get_num_threads());
    // rows in whole groups for kernels that hold LANE_ROWS weight rows in lanes, and for
    // weights in row groups
    bool any_grouped = false;
    for (const Weight& w : ws) any_grouped |= w.grouped;
    const int64_t group = (path.lane_tokens && T >= path.lane_tokens) || any_grouped ? LANE_ROWS : 1;
    auto grouped = [group](int64_t rows) { return (rows + group - 1) / group * group; };
    std::vector<Range> ranges;
    int64_t left = total_bytes;
    for (size_t i = 0; i < ws.size(); ++i) {
        for (int64_t r = 0; r < ws[i].n;) {
            const int64_t bytes = std::clamp<int64_t>(left / (2 * threads), RANGE_MIN_BYTES, RANGE_MAX_BYTES);
            const int64_t r1 = std::min(ws[i].n, r + grouped(std::max<int64_t>(1, bytes / ws[i].row_bytes)));
            ranges.push_back({int(i), r, r1});
            left -= (r1 - r) * ws[i].row_bytes;
            r = r1;
        }
    }
    float* yp = y.data_ptr<float>();
    std::atomic<int64_t> next{0};
    const int64_t n_ranges = int64_t(ranges.size());
    const int64_t workers = std::min<int64_t>(threads, n_ranges);
    auto work = [&](int64_t, int64_t) {
        for (int64_t c; (c = next.fetch_add(1)) < n_ranges;) {
            const Range& rg = ranges[c];
            const Weight& w = ws[rg.weight];
            if (w.gemv && T == 1) {  // one stream through the groups
                w.gemv(a, w.p, w.row_bytes, rg.r0, rg.r1, 0, 1, yp + w.col0, n_total);
                continue;
            }
            const int64_t tile = grouped(std::max<int64_t>(TILE_MIN_ROWS, TILE_BYTES / w.row_bytes));
            thread_local std::vector<uint8_t> rows_back;  // a grouped tile in the file's layout
            for (int64_t r0 = rg.r0; r0 < rg.r1; r0 += tile) {
                const int64_t r1 = std::min(rg.r1, r0 + tile);
                // the kernels read rows r0..r1 at p + r * row_bytes and write y's columns r
                const uint8_t* p = w.p;
                int64_t k0 = r0, k1 = r1;
                float* yw = yp + w.col0;
                if (w.ungroup) {
                    rows_back.resize((r1 - r0) * w.row_bytes);
                    ungroup_rows(w.p, w.row_bytes, w.block_bytes, r0, r1, rows_back.data());
                    p = rows_back.data(), k0 = 0, k1 = r1 - r0, yw += r0;
                }
                int64_t t0 = 0;  // whole tiles of 16 rows of x through the prefill kernel
                if (w.gemm && a.tiles) {
                    w.gemm(a, p, w.row_bytes, k0, k1, 0, a.tiles, yw, n_total);
                    t0 = a.tiles * GEMM_TOKENS;
                }
                for (; t0 < T; t0 += TOKEN_TILE)
                    w.fn(a, p, w.row_bytes, k0, k1, t0, std::min<int64_t>(TOKEN_TILE, T - t0), yw, n_total);
            }
        }
    };
    if (workers > 1) at::parallel_for(0, workers, 1, work);
    else work(0, 1);  // one range (small weights, decode): no parallel region to open
    return y;
}

at::Tensor dequantize_row(at::Tensor rows, int64_t qtype, int64_t index) {
    check_rows(rows, "rows", true);
    TORCH_CHECK_VALUE(rows.dim() >= 2, "rows must be (N, row_bytes) or row groups, got shape ",
                      rows.sizes());
    const TypeInfo& ti = checked_type(qtype);
    const int64_t rb = rows.size(-1), n = rows.numel() / std::max<int64_t>(rb, 1);
    TORCH_CHECK_VALUE(rb % ti.bytes == 0, ti.name, " rows must be whole ", ti.bytes,
                      "-byte blocks, got ", rb, " bytes per row");
    TORCH_CHECK_INDEX(index >= 0 && index < n, "row ", index, " outside ", n, " rows");
    const int64_t K = rb / ti.bytes * ti.values;
    auto out = at::empty({1, K}, rows.options().dtype(at::kFloat));
    const uint8_t* row = rows.data_ptr<uint8_t>() + index * rb;
    std::vector<uint8_t> back;
    if (rows.dim() == 3) {  // row groups: the row's own blocks
        back.resize(rb);
        ungroup_row(rows.data_ptr<uint8_t>(), rb, ti.bytes, index, back.data());
        row = back.data();
    }
    dequantize_one(ti.id, row, K, out.data_ptr<float>());
    return out;
}
