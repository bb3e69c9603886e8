// The extension's functions, one declaration each (defined in the .cpp file named beside
// them; bindings.cpp exposes them to Python).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "activation.h"

// sparse_ffn.cpp
at::Tensor ffn(at::Tensor x, at::Tensor packed, int64_t hidden, c10::optional<at::Tensor> idx,
               int64_t act);
std::tuple<at::Tensor, at::Tensor> ffn_thresholded(at::Tensor x, at::Tensor packed,
                                                   int64_t hidden, c10::optional<at::Tensor> idx,
                                                   int64_t act, double h_threshold);
int64_t parallel_workers();
bool has_avx2();

// q8_0_matmul.cpp
at::Tensor q8_0_matmul(at::Tensor x, at::Tensor w);
at::Tensor q8_0_quantize(at::Tensor w);

// fused_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
std::tuple<at::Tensor, at::Tensor> residual_norm(at::Tensor x, at::Tensor a,
                                                 c10::optional<at::Tensor> post,
                                                 c10::optional<at::Tensor> next, double eps);
void qk_norm_rope_(at::Tensor qkv, int64_t n_heads, int64_t n_kv, int64_t hd,
                   c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                   at::Tensor cos, at::Tensor sin, bool interleaved, double eps);
at::Tensor ffn_activation(Activation act, const at::Tensor& gate, const at::Tensor& up);

// attention.cpp: q (T, n_heads * hd) over each row's pool rows (attention.h); softcap > 0
// (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap).
at::Tensor attend(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                  const std::vector<at::Tensor>& slots, at::Tensor positions, int64_t n_heads,
                  double scale, double softcap);

// select.cpp
int64_t argmax(at::Tensor v);
std::tuple<at::Tensor, at::Tensor> top_k(at::Tensor v, int64_t k);

// block_matmul.cpp
at::Tensor block_matmul(at::Tensor x, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& qtypes);
at::Tensor dequantize_row(at::Tensor rows, int64_t qtype, int64_t index);
void set_cpu_path(const std::string& name);
std::string cpu_path();

// input_sparse.cpp
at::Tensor tile_relayout(at::Tensor rows, int64_t qtype, int64_t N, int64_t K);
at::Tensor input_sparse_matmul(at::Tensor x, const std::vector<at::Tensor>& packed,
                               const std::vector<int64_t>& types, const std::vector<int64_t>& n_out,
                               double threshold, c10::optional<at::Tensor> stats);
