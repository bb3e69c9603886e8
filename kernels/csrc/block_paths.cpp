// The CPU paths block_matmul runs (block_paths.h): the table of kernel sets and the choice
// among them. Whole tiles of 16 rows of x go through a prefill kernel for the K-quants
// (block_gemm_avx2.h, block_gemm_avx512.h; on AVX-512 from 48 rows, block_gemm_lanes_avx512.h)
// and, on AVX-512, for the 32-value types too; the rest through the row kernels
// (block_dots_*.h); a weight in row groups through block_gemv_groups_avx512.h for one token.
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "block_paths.h"
#include "block_dots_portable.h"
#include "ops.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "block_dots_avx2.h"
#include "block_gemm_avx2.h"
#define EMBER_BLOCK_AVX2 1
#endif
// The AVX-512 path needs a build for it (kernels/cpu_extension.py: x86-64-v4 plus VNNI).
#if defined(EMBER_BLOCK_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include "block_dots_avx512.h"
#include "block_gemm_avx512.h"
#include "block_gemm_lanes_avx512.h"
#include "block_gemv_groups_avx512.h"
#define EMBER_BLOCK_AVX512 1
#endif

namespace ember_blocks {
namespace {

// A kernel's rows over tt tokens, in its own tiles of up to Kernel::TILE.
template <class Kernel, int TT>
inline void tile_of(const XQuant& a, const uint8_t* w, int64_t rb, int64_t r0, int64_t r1,
                    int64_t t0, int64_t tt, float* y, int64_t ldy) {
    if constexpr (TT > 1) {
        if (tt < TT) return tile_of<Kernel, TT - 1>(a, w, rb, r0, r1, t0, tt, y, ldy);
    }
    Kernel::template rows<TT>(a, w, rb, r0, r1, t0, y, ldy);
}

template <class Kernel>
void token_tile(const XQuant& a, const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, int64_t t0,
                int64_t tt, float* y, int64_t ldy) {
    for (; tt > 0; t0 += Kernel::TILE, tt -= Kernel::TILE)
        tile_of<Kernel, Kernel::TILE>(a, w, rb, r0, r1, t0, std::min<int64_t>(tt, Kernel::TILE), y, ldy);
}

bool always() { return true; }

#ifdef EMBER_BLOCK_AVX2
bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
#endif

namespace P = ember_blocks::portable;
#ifdef EMBER_BLOCK_AVX2
namespace A = ember_blocks::avx2;
#endif
#ifdef EMBER_BLOCK_AVX512
namespace V = ember_blocks::avx512;
template <int TYPE>
void group_gemv(const XQuant& a, const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, int64_t t0,
                int64_t, float* y, int64_t ldy) {
    V::GroupGemv<TYPE>::rows(a, w, rb, r0, r1, t0, y, ldy);
}
bool cpu_has_avx512() {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

// Later entries are preferred when usable.
const CpuPath PATHS[] = {
    {"portable", always, false, GemmLayout::Pairs, ember_blocks::quantize_row,
     {token_tile<P::Float<F32>>, token_tile<P::Float<F16>>, token_tile<P::Float<BF16>>,
      token_tile<P::Small<Q4_0>>, token_tile<P::Small<Q4_1>>, token_tile<P::Small<Q5_0>>,
      token_tile<P::Small<Q5_1>>, token_tile<P::Small<Q8_0>>, token_tile<P::KQuant<Q4_K>>,
      token_tile<P::KQuant<Q5_K>>, token_tile<P::KQuant<Q6_K>>},
     {}},
#ifdef EMBER_BLOCK_AVX2
    {"avx2", cpu_has_avx2, true, GemmLayout::Pairs, A::quantize_row,
     {token_tile<A::Float<F32>>, token_tile<A::Float<F16>>, token_tile<A::Float<BF16>>,
      token_tile<A::Small<Q4_0>>, token_tile<A::Small<Q4_1>>, token_tile<A::Small<Q5_0>>,
      token_tile<A::Small<Q5_1>>, token_tile<A::Small<Q8_0>>, token_tile<A::KQuant<Q4_K>>,
      token_tile<A::KQuant<Q5_K>>, token_tile<A::KQuant<Q6_K>>},
     {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
      A::KGemm<Q4_K>::rows, A::KGemm<Q5_K>::rows, A::KGemm<Q6_K>::rows}},
#endif
#ifdef EMBER_BLOCK_AVX512
    // float weights as on AVX2 (rare in real files, and bandwidth-bound)
    {"avx512", cpu_has_avx512, true, GemmLayout::Quads, A::quantize_row,
     {token_tile<A::Float<F32>>, token_tile<A::Float<F16>>, token_tile<A::Float<BF16>>,
      token_tile<V::Small<Q4_0>>, token_tile<V::Small<Q4_1>>, token_tile<V::Small<Q5_0>>,
      token_tile<V::Small<Q5_1>>, token_tile<V::Small<Q8_0>>, token_tile<V::KQuant<Q4_K>>,
      token_tile<V::KQuant<Q5_K>>, token_tile<V::KQuant<Q6_K>>},
     {nullptr, nullptr, nullptr, V::gemm_rows<V::SGemm<Q4_0>>, V::gemm_rows<V::SGemm<Q4_1>>, V::gemm_rows<V::SGemm<Q5_0>>,
      V::gemm_rows<V::SGemm<Q5_1>>, V::gemm_rows<V::SGemm<Q8_0>>,
      V::LaneGemm<Q4_K>::gemm, V::LaneGemm<Q5_K>::gemm, V::LaneGemm<Q6_K>::gemm},
     V::LaneGemm<Q4_K>::MIN_TOKENS,
     {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
      group_gemv<Q4_K>, group_gemv<Q5_K>, group_gemv<Q6_K>},
     {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
      token_tile<V::KQuant<Q4_K, true>>, token_tile<V::KQuant<Q5_K, true>>, token_tile<V::KQuant<Q6_K, true>>},
     {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
      V::LaneGemm<Q4_K, true>::gemm, V::LaneGemm<Q5_K, true>::gemm, V::LaneGemm<Q6_K, true>::gemm}},
#endif
};
constexpr int N_PATHS = sizeof(PATHS) / sizeof(PATHS[0]);

std::atomic<int> g_path{-1};
std::mutex g_path_lock;

std::string path_choices() {
    std::string s;
    for (const CpuPath& p : PATHS)
        if (p.usable()) s += (s.empty() ? "" : ", ") + std::string(p.name);
    return s;
}

// The index of a usable path by name; a ValueError naming the choices otherwise.
int checked_path(const std::string& name, const char* what) {
    for (int i = 0; i < N_PATHS; ++i) {
        if (name != PATHS[i].name) continue;
        TORCH_CHECK_VALUE(PATHS[i].usable(), what, "'", name, "': this CPU lacks the instructions; "
                          "choices here: ", path_choices());
        return i;
    }
    std::string built;
    for (const CpuPath& p : PATHS) built += (built.empty() ? "" : ", ") + std::string(p.name);
    TORCH_CHECK_VALUE(false, what, "'", name, "' is not a CPU path; choices here: ", path_choices(),
                      " (this build: ", built, ")");
    return -1;
}

}  // namespace

const CpuPath& current_path() {
    int p = g_path.load(std::memory_order_acquire);
    if (p < 0) {  // first use: EMBER_CPU_PATH, else the best this CPU runs
        std::lock_guard<std::mutex> lock(g_path_lock);
        p = g_path.load(std::memory_order_relaxed);
        if (p < 0) {
            const char* env = std::getenv("EMBER_CPU_PATH");
            if (env && *env) {
                p = checked_path(env, "EMBER_CPU_PATH=");  // throws, and stays unset, if bad
            } else {
                for (p = N_PATHS - 1; p > 0 && !PATHS[p].usable(); --p) {}
            }
            g_path.store(p, std::memory_order_release);
        }
    }
    return PATHS[p];
}

}  // namespace ember_blocks

void set_cpu_path(const std::string& name) {
    using namespace ember_blocks;
    const int p = checked_path(name, "CPU path ");
    std::lock_guard<std::mutex> lock(g_path_lock);
    g_path.store(p, std::memory_order_release);
}

std::string cpu_path() { return ember_blocks::current_path().name; }
