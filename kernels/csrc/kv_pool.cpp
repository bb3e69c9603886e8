// The KV pools attention reads (attention.h): checked views of the pool tensors, writing one
// position's K or V in the pool's type, and the `attend` binding (kernels/attention.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#include "attention.h"
#include "attention_simd.h"
#include "block_formats.h"
#include "ops.h"

namespace ember_attention {

KvPools kv_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t n_kv, int64_t head_dim) {
    TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                    k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
                    k_pool.device().is_cpu() && v_pool.device().is_cpu() && k_pool.size(1) == n_kv,
                "k_pool and v_pool must be contiguous CPU tensors of one type, (rows, ", n_kv,
                " kv heads, values)");
    KvType type;
    int64_t head_bytes;
    switch (k_pool.scalar_type()) {
        case at::kFloat: type = KvType::F32, head_bytes = head_dim * 4; break;
        case at::kHalf: type = KvType::F16, head_bytes = head_dim * 2; break;
        case at::kBFloat16:
            TORCH_CHECK(head_dim % BF16_PAIRS == 0, "a bfloat16 KV pool needs a head dim that is a "
                        "multiple of ", BF16_PAIRS, ", not ", head_dim);
            type = KvType::BF16, head_bytes = head_dim * 2;
            break;
        case at::kByte:
            TORCH_CHECK(head_dim % Q8_VALUES == 0, "a Q8_0 KV pool needs a head dim that is a "
                        "multiple of 32, not ", head_dim);
            type = KvType::Q8_0, head_bytes = head_dim / Q8_VALUES * Q8_BYTES;
            break;
        default: TORCH_CHECK(false, "KV pools are float32, float16, bfloat16 or uint8 (Q8_0 blocks), not ",
                             k_pool.scalar_type());
    }
    TORCH_CHECK(k_pool.size(2) * k_pool.element_size() == head_bytes, "pool rows hold ",
                k_pool.size(2), " values a KV head; head dim ", head_dim, " needs ",
                head_bytes / k_pool.element_size());
    return {static_cast<const uint8_t*>(k_pool.data_ptr()), static_cast<const uint8_t*>(v_pool.data_ptr()),
            type, n_kv * head_bytes, head_bytes, k_pool.size(0), n_kv, head_dim};
}

void store_row(const at::Tensor& pool, int64_t slot, const float* values, int64_t n_kv, int64_t head_dim) {
    const int64_t n = n_kv * head_dim;
    switch (pool.scalar_type()) {
        case at::kFloat: std::memcpy(pool.data_ptr<float>() + slot * n, values, n * sizeof(float)); break;
        case at::kHalf: {  // rounded to nearest even, as torch's .half()
            at::Half* out = pool.data_ptr<at::Half>() + slot * n;
            int64_t i = 0;
#ifdef EMBER_ATTENTION_AVX2
            for (; i + 8 <= n; i += 8)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(values + i), _MM_FROUND_TO_NEAREST_INT));
#endif
            for (; i < n; ++i) out[i] = at::Half(values[i]);
            break;
        }
        case at::kBFloat16: {  // subnormals as zeros: see bf16_bits
            uint16_t* out = reinterpret_cast<uint16_t*>(pool.data_ptr<at::BFloat16>()) + slot * n;
            for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(values[i]);
            break;
        }
        default: {
            const int64_t blocks = n / Q8_VALUES;
            uint8_t* out = pool.data_ptr<uint8_t>() + slot * blocks * Q8_BYTES;
            for (int64_t b = 0; b < blocks; ++b)
                ember_blocks::quantize_q8_0_block(values + b * Q8_VALUES, out + b * Q8_BYTES);
        }
    }
}

}  // namespace ember_attention

// The `attend` binding: q (T, n_heads * head_dim) float32; slots[t] the pool rows row t reads
// (position order, its own last); positions (T,) each row's position. Returns (T, n_heads * hd).
at::Tensor attend(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                  const std::vector<at::Tensor>& slots, at::Tensor positions, int64_t n_heads,
                  double scale, double softcap) {
    using namespace ember_attention;
    TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous() &&
                    n_heads > 0 && q.size(1) % n_heads == 0,
                "q must be a contiguous float32 (T, n_heads * head_dim) tensor");
    const int64_t T = q.size(0), hd = q.size(1) / n_heads;
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong &&
                    positions.is_contiguous() && static_cast<int64_t>(slots.size()) == T,
                "positions (T,) int64 and one slot vector per row");
    const KvPools pools = kv_pools(k_pool, v_pool, k_pool.size(1), hd);
    auto out = at::empty({T, q.size(1)}, q.options());
    Rows rows{q.data_ptr<float>(), q.size(1), out.data_ptr<float>(), q.size(1), T, n_heads,
              {}, {}, {}, static_cast<float>(scale), static_cast<float>(softcap)};
    for (int64_t t = 0; t < T; ++t) {
        const at::Tensor& s = slots[t];
        TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kLong && s.is_contiguous(),
                    "slots must be contiguous int64 vectors");
        rows.slots.push_back(s.data_ptr<int64_t>());
        rows.n.push_back(s.numel());
        rows.pos.push_back(positions.data_ptr<int64_t>()[t]);
    }
    attend_rows(rows, pools);
    return out;
}
