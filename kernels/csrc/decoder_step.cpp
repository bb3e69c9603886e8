// See decoder_step.h. The same functions in the same order as kernels/decoder_step.py's
// reference chain, so the result is bit-identical to it; every op is row by row.
#include "decoder_step.h"

#include <ATen/ops/empty.h>

#include <cstring>
#include <tuple>

#include "attention.h"
#include "ops.h"

void DecoderStep::add_layer(at::Tensor attn_norm, std::vector<at::Tensor> qkv,
                            std::vector<int64_t> qkv_types, int64_t n_heads, int64_t n_kv,
                            int64_t head_dim, c10::optional<at::Tensor> q_norm,
                            c10::optional<at::Tensor> k_norm, bool interleaved, at::Tensor wo,
                            int64_t wo_type, c10::optional<at::Tensor> post_attn_norm,
                            at::Tensor ffn_norm, std::vector<at::Tensor> gate_up,
                            std::vector<int64_t> gate_up_types, at::Tensor down,
                            int64_t down_type, int64_t activation,
                            c10::optional<at::Tensor> post_ffn_norm, double eps, double scale,
                            c10::optional<at::Tensor> qkv_bias, double attn_softcap) {
    TORCH_CHECK(qkv.size() == 3 && qkv_types.size() == 3, "q, k and v: three weights");
    TORCH_CHECK(!gate_up.empty() && gate_up.size() == gate_up_types.size(),
                "gate/up weights and types must pair up");
    const Activation act = activation_of(activation);
    TORCH_CHECK(gate_up.size() == (is_gated(act) ? 2u : 1u), activation_name(act),
                " takes ", is_gated(act) ? "gate and up" : "up alone", " weights, got ",
                gate_up.size());
    layers_.push_back(Layer{attn_norm, std::move(qkv), std::move(qkv_types), n_heads, n_kv,
                            head_dim, q_norm, k_norm, interleaved, wo, wo_type, post_attn_norm,
                            ffn_norm, std::move(gate_up), std::move(gate_up_types), down,
                            down_type, act, post_ffn_norm, eps, scale,
                            qkv_bias, attn_softcap});
}

// h = rms_norm(x); qkv = h @ [Wq Wk Wv]; q/k norm + rotary; every row's K/V stored at the
// last of its read slots before any row attends (tree rows read their ancestors', prompt
// rows the rows before them); o = attention of each row over its read_slots (attention.h:
// tiled over rows and key chunks, a row's bits its own); a = o @ Wo.
// Returns residual_norm(x, a, post, ffn_norm): (x + post-normed a, the FFN's input).
std::tuple<at::Tensor, at::Tensor> DecoderStep::attention(
    const Layer& l, const at::Tensor& x, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const std::vector<at::Tensor>& read_slots, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin) const {
    const int64_t T = x.size(0), hd = l.head_dim;
    TORCH_CHECK(static_cast<int64_t>(read_slots.size()) == T,
                "decoder_step needs read slots for each of its ", T, " rows");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T &&
                    positions.scalar_type() == at::kLong && positions.is_contiguous(),
                "decoder_step needs each row's position: a contiguous int64 (T,) tensor");
    const ember_attention::KvPools pools = ember_attention::kv_pools(k_pool, v_pool, l.n_kv, hd);
    ember_attention::Rows rows{nullptr, 0, nullptr, 0, T, l.n_heads, {}, {}, {},
                               static_cast<float>(l.scale), static_cast<float>(l.attn_softcap)};
    for (int64_t t = 0; t < T; ++t) {
        const at::Tensor& s = read_slots[t];
        TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kLong && s.is_contiguous() &&
                        s.numel() > 0,
                    "read slots must be non-empty contiguous int64 vectors");
        rows.slots.push_back(s.data_ptr<int64_t>());
        rows.n.push_back(s.numel());
        rows.pos.push_back(positions.data_ptr<int64_t>()[t]);
        const int64_t own = rows.slots[t][s.numel() - 1];
        TORCH_CHECK(own >= 0 && own < pools.n_slots, "write slot out of range");
    }
    auto h = rms_norm(x, l.attn_norm, l.eps);
    auto qkv = l.sparse[0].on() ? l.sparse[0](h) : block_matmul(h, l.qkv, l.qkv_types);
    if (l.qkv_bias) qkv.add_(*l.qkv_bias);
    qk_norm_rope_(qkv, l.n_heads, l.n_kv, hd, l.q_norm, l.k_norm, cos, sin, l.interleaved,
                  l.eps);
    const int64_t width = qkv.size(1), kv = l.n_kv * hd, q_cols = l.n_heads * hd;
    const float* base = qkv.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
        const float* row = base + t * width + q_cols;
        const int64_t own = rows.slots[t][rows.n[t] - 1];
        ember_attention::store_row(k_pool, own, row, l.n_kv, hd);
        ember_attention::store_row(v_pool, own, row + kv, l.n_kv, hd);
    }
    auto o = at::empty({T, q_cols}, x.options());
    rows.q = base, rows.ldq = width, rows.out = o.data_ptr<float>(), rows.ldo = q_cols;
    ember_attention::attend_rows(rows, pools);
    auto a = l.sparse[1].on() ? l.sparse[1](o) : block_matmul(o, {l.wo}, {l.wo_type});
    return residual_norm(x, a, l.post_attn_norm, l.ffn_norm, l.eps);
}

// f = down(act(h @ Wgate, h @ Wup)); returns x + (post ? rms_norm(f, post) : f).
at::Tensor DecoderStep::ffn(const Layer& l, const at::Tensor& x, const at::Tensor& h) const {
    auto gu = l.sparse[2].on() ? l.sparse[2](h) : block_matmul(h, l.gate_up, l.gate_up_types);
    const bool gated = is_gated(l.activation);  // add_layer checked gate_up holds 2 then
    const int64_t n = gated ? gu.size(1) / 2 : gu.size(1);  // gate and up side by side
    auto gate = gated ? gu.narrow(1, 0, n) : at::Tensor();
    auto up = gated ? gu.narrow(1, n, n) : gu;
    auto act = ffn_activation(l.activation, gate, up).contiguous();
    auto f = l.sparse[3].on() ? l.sparse[3](act) : block_matmul(act, {l.down}, {l.down_type});
    return std::get<0>(residual_norm(x, f, l.post_ffn_norm, c10::nullopt, l.eps));
}

void DecoderStep::set_input_sparse(int64_t layer, int64_t slot, std::vector<at::Tensor> packed,
                                   std::vector<int64_t> types, std::vector<int64_t> n_out,
                                   double threshold, at::Tensor stats) {
    TORCH_CHECK_VALUE(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && slot >= 0 &&
                          slot < 4, "no matmul slot ", slot, " in layer ", layer);
    TORCH_CHECK_VALUE(stats.scalar_type() == at::kLong && stats.numel() == 2 && stats.is_contiguous(),
                      "stats must be a contiguous int64 tensor of 2");
    layers_[layer].sparse[slot] = InputSparseMatmul{std::move(packed), std::move(types),
                                                    std::move(n_out), threshold, stats};
}

at::Tensor DecoderStep::run(at::Tensor x, at::Tensor k_pool, at::Tensor v_pool,
                            const std::vector<std::vector<at::Tensor>>& slots,
                            at::Tensor positions, const std::vector<at::Tensor>& cos,
                            const std::vector<at::Tensor>& sin) const {
    const size_t n = layers_.size();
    TORCH_CHECK(slots.size() == n && cos.size() == n && sin.size() == n,
                "decoder_step needs slots, cos and sin for each of its ", n, " layers");
    for (size_t i = 0; i < n; ++i) {
        auto [mid, h] = attention(layers_[i], x, k_pool, v_pool, slots[i], positions, cos[i].contiguous(),
                                  sin[i].contiguous());
        x = ffn(layers_[i], mid, h);
    }
    return x;
}

std::tuple<at::Tensor, at::Tensor> DecoderStep::run_attention(
    int64_t layer, at::Tensor x, at::Tensor k_pool, at::Tensor v_pool,
    const std::vector<at::Tensor>& read_slots, at::Tensor positions, at::Tensor cos,
    at::Tensor sin) const {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "layer ", layer,
                " out of range (", layers_.size(), " layers)");
    return attention(layers_[layer], x, k_pool, v_pool, read_slots, positions, cos.contiguous(),
                     sin.contiguous());
}
