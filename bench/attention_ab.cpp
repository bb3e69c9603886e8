// Two builds of the attention kernel side by side: kernels/csrc/attention.cpp from two source
// trees (A and B, the second compiled into namespace ember_attention_B), driven from C++ as a
// decode step meets it: one decoded row over every layer's own float16 (KV=q8_0: Q8_0; KV=bf16:
// bfloat16, AVX512_BF16's dot products where the CPU has them unless EMBER_BF16_DOTS=0) K/V in
// turn (from memory once they outgrow the caches), then one layer's again and again (in
// cache). A and B alternate round by round, so the host's drift falls on both; the outputs
// must be the same bits. Built and run by bench/attention_ab.sh (docs/long-context.md, "Measured").
//
//   attention_ab KEYS LAYERS ROUNDS      (SHAPE=n_heads,n_kv,head_dim; default 12,2,128;
//                                         KV=f16, q8_0 or bf16, default f16)
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention.h"

// bench/attention_ab_entry.cpp, compiled once per tree
void attend_A(const void* rows, const void* pools);
void attend_B(const void* rows, const void* pools);

namespace {

using Clock = std::chrono::steady_clock;

uint8_t* huge_page_buffer(size_t bytes) {
    const size_t huge = 2u << 20, rounded = (bytes + huge - 1) / huge * huge;
    auto* pool = static_cast<uint8_t*>(aligned_alloc(huge, rounded));
    madvise(pool, rounded, MADV_HUGEPAGE);  // as the engine's pool (kernels/page_advice.py)
    return pool;
}

// float16 (or bfloat16) values of a normal distribution
uint8_t* random_half_pool(size_t bytes, std::mt19937& rng, bool bf16) {
    auto* pool = reinterpret_cast<uint16_t*>(huge_page_buffer(bytes));
    std::normal_distribution<float> normal;
    for (size_t i = 0; i < bytes / 2; ++i)
        pool[i] = bf16 ? ember_attention::bf16_bits(normal(rng)) : _cvtss_sh(normal(rng), 0);
    return reinterpret_cast<uint8_t*>(pool);
}

// Q8_0 blocks: a float16 scale near a normal value's, then 32 random int8.
uint8_t* random_q8_pool(size_t bytes, std::mt19937& rng) {
    uint8_t* pool = huge_page_buffer(bytes);
    std::uniform_int_distribution<int> q(-127, 127);
    const uint16_t d = _cvtss_sh(3.f / 127, 0);
    for (size_t b = 0; b < bytes; b += ember_attention::Q8_BYTES) {
        std::memcpy(pool + b, &d, 2);
        for (int i = 0; i < ember_attention::Q8_VALUES; ++i) pool[b + 2 + i] = static_cast<uint8_t>(q(rng));
    }
    return pool;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s KEYS LAYERS ROUNDS\n", argv[0]);
        return 2;
    }
    const int keys = std::atoi(argv[1]), layers = std::atoi(argv[2]), rounds = std::atoi(argv[3]);
    if (keys < 1 || layers < 1 || rounds < 1) {
        std::fprintf(stderr, "KEYS, LAYERS and ROUNDS must be positive whole numbers\n");
        return 2;
    }
    int n_heads = 12, n_kv = 2, hd = 128;
    if (const char* shape = std::getenv("SHAPE")) std::sscanf(shape, "%d,%d,%d", &n_heads, &n_kv, &hd);
    const std::string kv = std::getenv("KV") ? std::getenv("KV") : "f16";
    const bool q8 = kv == "q8_0", bf16 = kv == "bf16";
    if (!q8 && !bf16 && kv != "f16") {
        std::fprintf(stderr, "KV must be f16, q8_0 or bf16, got %s\n", kv.c_str());
        return 2;
    }
    if ((q8 || bf16) && hd % 32) {
        std::fprintf(stderr, "KV=%s needs a head dim that is a multiple of 32\n", kv.c_str());
        return 2;
    }
    using ember_attention::Q8_BYTES, ember_attention::Q8_VALUES;
    const int64_t head = q8 ? int64_t(hd) / Q8_VALUES * Q8_BYTES : int64_t(hd) * 2;
    const int64_t row = n_kv * head;
    std::mt19937 rng(1);
    auto pool = [&] { return q8 ? random_q8_pool(keys * row, rng) : random_half_pool(keys * row, rng, bf16); };
    using ember_attention::KvType;
    const KvType type = q8 ? KvType::Q8_0 : bf16 ? KvType::BF16 : KvType::F16;
    std::vector<ember_attention::KvPools> pools;
    for (int l = 0; l < layers; ++l) pools.push_back({pool(), pool(), type, row, head, keys, n_kv, hd});
    std::vector<float> q(n_heads * hd), out_a(q.size()), out_b(q.size());
    std::normal_distribution<float> normal;
    for (float& x : q) x = normal(rng);
    std::vector<int64_t> slots(keys);
    for (int i = 0; i < keys; ++i) slots[i] = i;
    // ms for one decoded row over every layer's pool (layer < 0) or one layer's, `layers` times
    auto step = [&](bool b, int layer) {
        const auto t0 = Clock::now();
        for (int l = 0; l < layers; ++l) {
            ember_attention::Rows rows{q.data(), n_heads * hd, (b ? out_b : out_a).data(), n_heads * hd, 1,
                                       n_heads, {slots.data()}, {keys}, {keys - 1}, 1.f / 11.3f, 0.f};
            (b ? attend_B : attend_A)(&rows, &pools[layer < 0 ? l : layer]);
        }
        return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    };
    step(false, -1), step(true, -1);
    if (std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)) != 0) {
        std::printf("A and B give different outputs\n");
        return 1;
    }
    std::vector<double> a, b, a_cache, b_cache, ratio, ratio_cache;
    for (int r = 0; r < rounds; ++r) {
        const bool a_first = r % 2 == 0;
        const double first = step(!a_first, -1), second = step(a_first, -1);
        a.push_back(a_first ? first : second), b.push_back(a_first ? second : first);
        step(false, 0), a_cache.push_back(step(false, 0));
        step(true, 0), b_cache.push_back(step(true, 0));
        ratio.push_back(a.back() / b.back()), ratio_cache.push_back(a_cache.back() / b_cache.back());
    }
    auto range = [](const std::vector<double>& v) { return std::minmax_element(v.begin(), v.end()); };
    const auto [rlo, rhi] = range(ratio);
    const auto [clo, chi] = range(ratio_cache);
    std::printf("%d keys x %d layers (%d,%d,%d), medians of %d rounds: from memory A %.2f B %.2f ms, "
                "A/B %.3f (%.2f-%.2f); in cache A %.2f B %.2f ms, A/B %.3f (%.2f-%.2f)\n",
                keys, layers, n_heads, n_kv, hd, rounds, median(a), median(b), median(ratio), *rlo, *rhi,
                median(a_cache), median(b_cache), median(ratio_cache), *clo, *chi);
    return 0;
}
