// One matmul of a decoder layer run input-sparse (input_sparse.cpp): its weights in the
// input-major layout, side by side, the threshold below which an input is dropped, and the
// counters of inputs kept / seen (read by offload/body/input_sparsity.py for the realized sparsity).
// DecoderStep holds one per matmul slot that a profile thresholds; unset slots run dense on the
// file's blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "ops.h"

struct InputSparseMatmul {
    std::vector<at::Tensor> packed;  // input-major bytes per weight
    std::vector<int64_t> types, n_out;
    double threshold = -1;  // < 0: unset (the slot runs on the file's blocks)
    at::Tensor stats;       // int64 [kept, seen]

    bool on() const { return threshold >= 0; }
    at::Tensor operator()(const at::Tensor& x) const {
        return input_sparse_matmul(x.contiguous(), packed, types, n_out, threshold, stats);
    }
};
