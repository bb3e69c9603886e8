// Every transformer block's forward for T rows (one decoded token, or a speculative tree's
// rows) in one call, on Q8_0 weights (offload/body/fused_body.py): per layer, the attention
// sub-layer (attention_step, fused_ops.cpp) then the dense Q8_0 FFN sub-layer (ffn_step). A
// decode step otherwise returns to Python twice per layer, and measured on the
// default model that Python (argument handling, slot lookups, module checks) cost ~2 ms of a
// ~16 ms token, against ~0.6 ms for the same Python alone (likely because each layer's weight
// stream evicts the interpreter's working set from the caches).
// Same functions in the same order, so the result is bit-identical to the per-layer calls.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

class BodyStep {
  public:
    // One transformer block's fixed arguments, in order (see attention_step and ffn_step);
    // activation: a models/activations.py code (activation.h).
    void add_layer(at::Tensor attn_norm, at::Tensor qkv_rows, int64_t n_heads, int64_t n_kv,
                   int64_t head_dim, c10::optional<at::Tensor> q_norm,
                   c10::optional<at::Tensor> k_norm, bool interleaved, at::Tensor wo_rows,
                   c10::optional<at::Tensor> post_attn_norm, at::Tensor ffn_norm,
                   at::Tensor gate_up_rows, at::Tensor down_rows, int64_t activation,
                   c10::optional<at::Tensor> post_ffn_norm, double eps, double scale);
    // x (T, hidden) through every layer: one decoded token, or the rows of a speculative
    // tree. Per layer: for each row the pool slots it reads (its own, where its K/V are
    // written, last), and the rows' rotary cos/sin (T, head_dim / 2).
    at::Tensor run(at::Tensor x, at::Tensor k_pool, at::Tensor v_pool,
                   const std::vector<std::vector<at::Tensor>>& slots,
                   const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin) const;

  private:
    struct Layer {
        at::Tensor attn_norm, qkv_rows;
        int64_t n_heads, n_kv, head_dim;
        c10::optional<at::Tensor> q_norm, k_norm;
        bool interleaved;
        at::Tensor wo_rows;
        c10::optional<at::Tensor> post_attn_norm;
        at::Tensor ffn_norm, gate_up_rows, down_rows;
        int64_t activation;  // models/activations.py code (activation.h)
        c10::optional<at::Tensor> post_ffn_norm;
        double eps, scale;
    };
    std::vector<Layer> layers_;
};
