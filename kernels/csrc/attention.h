// Attention of T query rows over keys and values read in place from a paged KV pool
// (attention.cpp; Python: kernels/attention.py). Used by DecoderStep for every pass (a decoded
// token, a prompt chunk, a speculative tree's rows) and by the `attend` binding.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "attention_math.h"  // Q8_VALUES, Q8_BYTES

namespace ember_attention {

// How a pool row stores one KV head's head_dim values.
enum class KvType { F32, F16, Q8_0, BF16 };

// The K and V pools: (slots, n_kv, head_dim) float32, float16 or bfloat16, or (slots, n_kv,
// head_dim / 32 * 34) uint8 of Q8_0 blocks (an fp16 scale and 32 int8 each).
struct KvPools {
    const uint8_t* k;
    const uint8_t* v;
    KvType type;
    int64_t slot_bytes, head_bytes, n_slots, n_kv, head_dim;
};

// Checked views of two pool tensors for n_kv heads of head_dim values (kv_pool.cpp).
KvPools kv_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t n_kv, int64_t head_dim);

// Writes one position's n_kv * head_dim values into pool row `slot` in the pool's type
// (float16 rounded to nearest even, bfloat16 as bf16_bits, Q8_0 as quantize_q8_0_block).
void store_row(const at::Tensor& pool, int64_t slot, const float* values, int64_t n_kv, int64_t head_dim);

// T rows: row t's query heads at q + t * ldq (n_heads * head_dim values); it reads the keys at
// pool rows slots[t][0..n[t]), which hold positions pos[t] - n[t] + 1 .. pos[t] (its own last).
// Its output, softmax(scale * q.k) @ v per head (scores soft-capped when softcap > 0), goes to
// out + t * ldo. A row's bits depend only on its own query and keys: not on the other rows,
// the tiling, the thread count or the CPU path (attention_math.h).
struct Rows {
    const float* q;
    int64_t ldq;
    float* out;
    int64_t ldo;
    int64_t T, n_heads;
    std::vector<const int64_t*> slots;
    std::vector<int64_t> n, pos;
    float scale, softcap;
};

void attend_rows(const Rows& rows, const KvPools& pools);

// For tests: the thread holding the first part of a split context (a decoded token's, a tree's)
// folds at most `chunks` of them as it goes (< 0: no limit), as if it ran slow, so the other
// threads take the rest; the bits must not change.
void set_first_part_chunks(int64_t chunks);

// Whether a bfloat16 pool's decoded tokens use AVX512_BF16's dot products (the same bits as
// the float path: tests compare them); a ValueError where the CPU lacks them. Returns the
// setting before.
bool set_bf16_dots(bool on);

}  // namespace ember_attention
