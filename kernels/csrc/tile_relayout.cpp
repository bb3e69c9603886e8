// tile_relayout: a weight's rows of the file's blocks -> its input-major tiles (input_major.h),
// once at load, the bytes re-ordered and nothing rounded. Python side and the PyTorch version
// it is tested against: kernels/input_sparse.py, kernels/tile_layout.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "input_major.h"
#include "ops.h"

namespace ember_im {

Tiles checked_tiles(int64_t type, int64_t N, int64_t K, const char* what) {
    TORCH_CHECK_VALUE(tiled_type(type), what, ": input-major tiles hold F32, F16, BF16, Q4_0, "
                      "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K weights, not GGML type ", type);
    TORCH_CHECK_VALUE(N > 0 && K > 0 && K % super_inputs(int(type)) == 0, what, ": K=", K,
                      " is not whole blocks of ", super_inputs(int(type)));
    return Tiles{int(type), N, K};
}

}  // namespace ember_im

namespace {

using namespace ember_im;

// One super-block of every row -> its tile (out zeroed).
void tile_super(const Tiles& t, const uint8_t* src, int64_t row_bytes, int64_t kb, uint8_t* out) {
    const int type = t.type, QK = super_inputs(type);
    const TypeInfo& info = TYPES[type_index(type)];
    const int64_t Np = t.padded(), at = kb * QK / info.values * info.bytes;
    int32_t q[256], sc[16], mn[8];
    for (int64_t r = 0; r < t.N; ++r) {
        const uint8_t* blk = src + r * row_bytes + at;
        const int64_t g = r / GROUP, j = r % GROUP;
        if (float_type(type)) {  // the values themselves, each input's at row r of its run
            const int size = low_bytes(type) / GROUP;
            for (int i = 0; i < QK; ++i)
                std::memcpy(out + t.header() + i * t.run() + g * low_bytes(type) + j * size,
                            blk + i * size, size);
            continue;
        }
        if (k_quant(type)) {
            decode_k(type, blk, q, sc, mn);
            if (type == Q6_K) {
                std::memcpy(out + 2 * r, blk + 208, 2);
                for (int f = 0; f < 16; ++f) out[2 * Np + f * Np + r] = blk[192 + f];
            } else {
                std::memcpy(out + 2 * r, blk, 2);
                std::memcpy(out + 2 * Np + 2 * r, blk + 2, 2);
                for (int f = 0; f < 12; ++f) out[4 * Np + f * Np + r] = blk[4 + f];
            }
        } else {
            float d, m;
            decode32(type, blk, q, d, m);
            std::memcpy(out + 2 * r, blk, 2);
            if (has_min(type)) std::memcpy(out + 2 * Np + 2 * r, blk + 2, 2);
        }
        // the stored integers (Q8_0 signed), at row r of each input's run
        for (int i = 0; i < QK; ++i) {
            uint8_t* lo = out + t.header() + i * t.run() + g * low_bytes(type);
            uint8_t* hi = out + t.header() + i * t.run() + t.high_at() + g * high_bytes(type);
            const int v = q[i];
            if (type == Q8_0) {
                lo[j] = uint8_t(int8_t(v));
                continue;
            }
            lo[j % 32] |= uint8_t((v & 15) << (4 * (j / 32)));
            if (high_bytes(type) == 8) hi[j / 8] |= uint8_t(((v >> 4) & 1) << (j % 8));
            if (type == Q6_K) hi[j % 16] |= uint8_t(((v >> 4) & 3) << (2 * (j / 16)));
        }
    }
}

}  // namespace

at::Tensor tile_relayout(at::Tensor rows, int64_t qtype, int64_t N, int64_t K) {
    const Tiles t = checked_tiles(qtype, N, K, "tile_relayout");
    const TypeInfo& info = TYPES[type_index(qtype)];
    const int64_t rb = K / info.values * info.bytes;
    TORCH_CHECK_VALUE(rows.scalar_type() == at::kByte && rows.is_contiguous() &&
                          rows.numel() == N * rb,
                      "rows must be the weight's ", N * rb, " contiguous bytes");
    auto out = at::zeros({t.bytes()}, rows.options());
    const uint8_t* src = rows.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, t.supers(), 1, [&](int64_t k0, int64_t k1) {
        for (int64_t kb = k0; kb < k1; ++kb) tile_super(t, src, rb, kb, dst + kb * t.super_bytes());
    });
    return out;
}

