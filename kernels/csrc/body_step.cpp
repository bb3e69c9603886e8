// See body_step.h.
#include "body_step.h"

#include <tuple>

#include "ops.h"

void BodyStep::add_layer(at::Tensor attn_norm, at::Tensor qkv_rows, int64_t n_heads,
                         int64_t n_kv, int64_t head_dim, c10::optional<at::Tensor> q_norm,
                         c10::optional<at::Tensor> k_norm, bool interleaved, at::Tensor wo_rows,
                         c10::optional<at::Tensor> post_attn_norm, at::Tensor ffn_norm,
                         at::Tensor gate_up_rows, at::Tensor down_rows, int64_t activation,
                         c10::optional<at::Tensor> post_ffn_norm, double eps, double scale) {
    activation_of(activation);  // an unknown code fails here, not at the first token
    layers_.push_back(Layer{attn_norm, qkv_rows, n_heads, n_kv, head_dim, q_norm, k_norm,
                            interleaved, wo_rows, post_attn_norm, ffn_norm, gate_up_rows,
                            down_rows, activation, post_ffn_norm, eps, scale});
}

at::Tensor BodyStep::run(at::Tensor x, at::Tensor k_pool, at::Tensor v_pool,
                         const std::vector<std::vector<at::Tensor>>& slots,
                         const std::vector<at::Tensor>& cos,
                         const std::vector<at::Tensor>& sin) const {
    const size_t n = layers_.size();
    TORCH_CHECK(slots.size() == n && cos.size() == n && sin.size() == n,
                "body_step needs slots, cos and sin for each of its ", n, " layers");
    for (size_t i = 0; i < n; ++i) {
        const Layer& l = layers_[i];
        auto [mid, h] = attention_step(x, l.attn_norm, l.qkv_rows, l.n_heads, l.n_kv,
                                       l.head_dim, l.q_norm, l.k_norm, cos[i], sin[i],
                                       l.interleaved, k_pool, v_pool, slots[i], l.wo_rows,
                                       l.post_attn_norm, l.ffn_norm, l.eps, l.scale);
        x = ffn_step(mid, h, l.gate_up_rows, l.down_rows, l.activation, l.post_ffn_norm, l.eps);
    }
    return x;
}
