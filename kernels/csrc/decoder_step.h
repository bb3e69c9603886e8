// Every decoder layer's forward for T rows in one call, on weights in the file's own GGML
// blocks (offload/body/quant_model.py; Python reference: kernels/decoder_step.py). The rows are a
// decoded token, a prompt chunk or a speculative tree's nodes; each reads its own keys from
// the paged KV pool. One call per pass, rather than a return to Python per layer: at batch 1
// those returns cost more than their own work (measured on the default model: the Python
// between per-layer calls took ~2 ms of a ~16 ms token).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

#include "activation.h"
#include "input_sparse.h"

class DecoderStep {
  public:
    // One layer's fixed arguments, in order (kernels/decoder_step.py's DecoderLayer): each
    // weight as (rows, row_bytes) uint8 in its GGML type; q, k and v side by side in one
    // call, gate and up likewise (gated activations; `up` alone otherwise). qkv_bias: added to
    // the q, k and v outputs (Qwen 2); attn_softcap > 0: soft-capped scores (Gemma 2).
    void add_layer(at::Tensor attn_norm, std::vector<at::Tensor> qkv,
                   std::vector<int64_t> qkv_types, int64_t n_heads, int64_t n_kv,
                   int64_t head_dim, c10::optional<at::Tensor> q_norm,
                   c10::optional<at::Tensor> k_norm, bool interleaved, at::Tensor wo,
                   int64_t wo_type, c10::optional<at::Tensor> post_attn_norm,
                   at::Tensor ffn_norm, std::vector<at::Tensor> gate_up,
                   std::vector<int64_t> gate_up_types, at::Tensor down, int64_t down_type,
                   int64_t activation, c10::optional<at::Tensor> post_ffn_norm, double eps,
                   double scale, c10::optional<at::Tensor> qkv_bias, double attn_softcap);
    // x (T, hidden) through every layer. Per layer: for each row the pool slots it reads (its
    // own, where its K/V are written before any row attends, last: positions
    // positions[t] - n + 1 .. positions[t]), and the rows' rotary cos/sin (T, head_dim / 2).
    // Pools: float32, float16 or Q8_0 blocks (attention.h).
    at::Tensor run(at::Tensor x, at::Tensor k_pool, at::Tensor v_pool,
                   const std::vector<std::vector<at::Tensor>>& slots, at::Tensor positions,
                   const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin) const;
    // Layer `layer`'s attention sub-layer alone, for a runtime that computes the FFN itself
    // (the hybrid split, offload/body/quant_model.py): returns (x + post-normed attention, the
    // FFN's normed input). Same arguments as one layer of run().
    std::tuple<at::Tensor, at::Tensor> run_attention(int64_t layer, at::Tensor x,
                                                     at::Tensor k_pool, at::Tensor v_pool,
                                                     const std::vector<at::Tensor>& read_slots,
                                                     at::Tensor positions, at::Tensor cos,
                                                     at::Tensor sin) const;

    // Run matmul `slot` of layer `layer` (0: q/k/v, 1: attention output, 2: gate/up, 3: down)
    // input-sparse over these input-major weights (kernels/input_sparse.py); a threshold < 0
    // puts the slot back on the file's blocks.
    void set_input_sparse(int64_t layer, int64_t slot, std::vector<at::Tensor> packed,
                          std::vector<int64_t> types, std::vector<int64_t> n_out,
                          double threshold, at::Tensor stats);

  private:
    struct Layer {
        at::Tensor attn_norm;
        std::vector<at::Tensor> qkv;
        std::vector<int64_t> qkv_types;
        int64_t n_heads, n_kv, head_dim;
        c10::optional<at::Tensor> q_norm, k_norm;
        bool interleaved;
        at::Tensor wo;
        int64_t wo_type;
        c10::optional<at::Tensor> post_attn_norm;
        at::Tensor ffn_norm;
        std::vector<at::Tensor> gate_up;
        std::vector<int64_t> gate_up_types;
        at::Tensor down;
        int64_t down_type;
        Activation activation;
        c10::optional<at::Tensor> post_ffn_norm;
        double eps, scale;
        c10::optional<at::Tensor> qkv_bias;
        double attn_softcap;
        InputSparseMatmul sparse[4];  // per slot; unset: dense on the file's blocks
    };
    std::tuple<at::Tensor, at::Tensor> attention(const Layer& l, const at::Tensor& x,
                                                 const at::Tensor& k_pool,
                                                 const at::Tensor& v_pool,
                                                 const std::vector<at::Tensor>& read_slots,
                                                 const at::Tensor& positions,
                                                 const at::Tensor& cos,
                                                 const at::Tensor& sin) const;
    at::Tensor ffn(const Layer& l, const at::Tensor& x, const at::Tensor& h) const;
    std::vector<Layer> layers_;
};
