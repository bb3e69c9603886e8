// block_matmul's CPU paths: a table of kernel sets ("portable", "avx2", and "avx512" in a
// build for AVX-512 VNNI CPUs), one picked at first use from the CPU or EMBER_CPU_PATH and
// switchable for tests (set_cpu_path, ops.h). block_paths.cpp holds the table.
#pragma once

#include <cstdint>

#include "block_formats.h"
#include "x_quant.h"

namespace ember_blocks {

using RowsFn = void (*)(const XQuant&, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t t0, int64_t tt, float* y, int64_t ldy);
// Rows [r0, r1) against tiles g0..g1-1 of 16 rows of x each (XQuant::tiles).
using GemmFn = void (*)(const XQuant&, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t g0, int64_t g1, float* y, int64_t ldy);

// How a path's prefill kernels read x: XQuant's qg/dg/m32g/s8g (AVX2) or qq/dq/m32q/s16q.
enum class GemmLayout { Pairs, Quads };

struct CpuPath {
    const char* name;
    bool (*usable)();  // does this CPU run it
    bool pairs;  // reads the 32-value types' x in pair layout (block_dots_avx2.h)
    GemmLayout gemm_layout;
    // a row of x in blocks of 32 or 256, with sums per 8 values (same result on every path)
    void (*quantize)(const float* x, int64_t n, int block, int8_t* q, float* d, int16_t* sum8);
    RowsFn rows[N_TYPES];  // in the order of TYPES
    GemmFn gemm[N_TYPES];  // prefill kernels for tiles of 16 rows of x (null: rows only)
    // From this many rows of x on, the K-quant prefill kernels hold LANE_ROWS weight rows in
    // lanes and read x's rows as they are (XLayouts::k_rows_from); 0: never.
    int64_t lane_tokens = 0;
    // A weight in row groups, read in place (null: each tile is taken back to rows first):
    // one row of x, more rows, tiles of 16 rows.
    RowsFn group_gemv[N_TYPES] = {};
    RowsFn group_rows[N_TYPES] = {};
    GemmFn group_gemm[N_TYPES] = {};
};

// The path block_matmul runs (chosen at first use).
const CpuPath& current_path();

}  // namespace ember_blocks
