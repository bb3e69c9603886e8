// Row groups (block_formats.h: block_at) taken back to the file's row layout: for the kernels
// that read rows (block_matmul.cpp hands them a tile at a time: the portable and AVX2 paths, a
// path forced by EMBER_CPU_PATH) and for dequantize_row. The groups themselves are made once,
// at load (models/weights.py: QTensor.in_row_groups).
#pragma once

#include <cstdint>
#include <cstring>

#include "block_formats.h"

namespace ember_blocks {

// Rows r0..r1 (whole groups) of a grouped weight into out ((r1 - r0) * rb bytes, the file's
// layout): the groups read in order, each block copied with its size known (inlined moves).
template <int BYTES>
inline void ungroup_blocks(const uint8_t* p, int64_t rb, int64_t r0, int64_t r1, uint8_t* out) {
    const int64_t nb = rb / BYTES;
    for (int64_t g = r0; g < r1; g += LANE_ROWS) {
        const uint8_t* src = p + g * rb;
        uint8_t* dst = out + (g - r0) * rb;
        for (int64_t b = 0; b < nb; ++b, src += LANE_ROWS * BYTES)
            for (int i = 0; i < LANE_ROWS; ++i) std::memcpy(dst + i * rb + b * BYTES, src + i * BYTES, BYTES);
    }
}

// The same for a K-quant's block size: Q4_K 144 bytes, Q5_K 176, Q6_K 210.
inline void ungroup_rows(const uint8_t* p, int64_t rb, int block_bytes, int64_t r0, int64_t r1, uint8_t* out) {
    switch (block_bytes) {
        case 144: return ungroup_blocks<144>(p, rb, r0, r1, out);
        case 176: return ungroup_blocks<176>(p, rb, r0, r1, out);
        default: return ungroup_blocks<210>(p, rb, r0, r1, out);
    }
}

// Row r alone into out (rb bytes): its blocks, LANE_ROWS blocks apart in its group.
inline void ungroup_row(const uint8_t* p, int64_t rb, int block_bytes, int64_t r, uint8_t* out) {
    const uint8_t* src = p + (r / LANE_ROWS) * LANE_ROWS * rb + (r % LANE_ROWS) * block_bytes;
    for (int64_t b = 0; b < rb / block_bytes; ++b)
        std::memcpy(out + b * block_bytes, src + b * LANE_ROWS * block_bytes, block_bytes);
}

}  // namespace ember_blocks
