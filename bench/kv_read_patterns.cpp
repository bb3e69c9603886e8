// How fast two threads read a decode step's KV bytes, by access pattern: the measurement
// behind attention.cpp's work split (docs/long-context.md, "Attention at long contexts").
// The bytes are the 1.5B's at 6k tokens (28 layers x K and V x 6,144 rows x 2 KV heads x 128
// float16 values = 176 MB); each pattern converts every float16 it reads and adds it up, as
// the kernel's conversion does, with no other arithmetic, except the last: the kernel's order
// of reads with a fixed amount of fma work per line, from memory and from L3, to see how much
// of the memory time such a loop hides.
//
//   g++ -O3 -march=native -pthread bench/kv_read_patterns.cpp -o /tmp/kv_read && /tmp/kv_read
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "../kernels/csrc/prefetch.h"  // the kernels' own L2 prefetch

namespace {

constexpr size_t BYTES = 176u << 20, ROW = 512, HEAD = 256, BLOCK = 16 * ROW;  // 16-row blocks
const char* pool;
float sink[32];

// Adds up bytes [off, off + len) of each block in order[i0..i1), as floats.
void read_blocks(const std::vector<size_t>& order, size_t i0, size_t i1, size_t off, size_t len,
                 size_t stride, int id) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (size_t i = i0; i < i1; ++i)
        for (size_t r = 0; r < BLOCK; r += stride)
            for (size_t b = 0; b < len; b += 128) {
                const char* p = pool + order[i] * BLOCK + r + off + b;
                for (int a = 0; a < 4; ++a)
                    acc[a] = _mm512_add_ps(acc[a], _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(p + 32 * a))));
            }
    _mm512_storeu_ps(sink + 16 * id, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// The decode kernel's order with arithmetic in place of its own: the pool's first half as K,
// its second as V; each thread takes its half of `span` bytes of each (cycled over until it has
// read a quarter of the pool from each: span BYTES / 2 reads from memory, a few MB from L3),
// CHUNK_ROWS rows of K, then the same rows of V, with `work` fma rounds (4 independent chains)
// per 64-byte line. Whether the memory hides behind the work, as it should; burst: each
// chunk's reads start by prefetching the next chunk's lines all at once (as the kernel's
// per-row prefetch comes in bursts), to see what bursts cost.
constexpr size_t CHUNK_ROWS = 64;

void chunks_with_work(int id, size_t span, int work, bool burst) {
    const __m512 one = _mm512_set1_ps(1.0001f);
    __m512 acc = _mm512_setzero_ps(), w[4] = {acc, acc, acc, acc};
    const char* k = pool;
    const char* v = pool + BYTES / 2;
    const size_t lo = id * span / 2, hi = lo + span / 2, chunk = CHUNK_ROWS * ROW;
    auto read = [&](const char* base, size_t a, size_t b) {
        for (size_t o = a; o < b; o += 64) {
            acc = _mm512_add_ps(acc, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(base + o))));
            acc = _mm512_add_ps(acc, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(base + o + 32))));
            for (int i = 0; i < work; ++i)
                for (auto& c : w) c = _mm512_fmadd_ps(c, one, acc);
        }
    };
    for (size_t done = 0; done < BYTES / 4; done += hi - lo)
        for (size_t c = lo; c < hi; c += chunk) {
            const size_t next = std::min(chunk, hi - std::min(hi, c + chunk));
            if (burst) ember_prefetch::lines_l2(k + c + chunk, next);
            read(k, c, std::min(hi, c + chunk));
            if (burst) ember_prefetch::lines_l2(v + c + chunk, next);
            read(v, c, std::min(hi, c + chunk));
        }
    _mm512_storeu_ps(sink + 16 * id, _mm512_add_ps(acc, _mm512_add_ps(_mm512_add_ps(w[0], w[1]), _mm512_add_ps(w[2], w[3]))));
}

template <class A, class B>
double two_threads(A a, B b) {
    const auto t = std::chrono::steady_clock::now();
    std::thread x(a), y(b);
    x.join(), y.join();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

template <class F>
void report(const char* what, F run) {
    std::vector<double> ms;
    for (int i = 0; i < 9; ++i) ms.push_back(run() * 1e3);
    std::sort(ms.begin(), ms.end());
    std::printf("%-68s %6.2f ms (%.2f-%.2f)\n", what, ms[4], ms[0], ms[8]);
}

}  // namespace

int main() {
    char* p = static_cast<char*>(std::aligned_alloc(2 << 20, BYTES));
    madvise(p, BYTES, MADV_HUGEPAGE);  // as the engine's KV pool
    std::memset(p, 1, BYTES);
    pool = p;
    const size_t n = BYTES / BLOCK;
    std::vector<size_t> in_order(n), shuffled(n);
    std::iota(in_order.begin(), in_order.end(), 0);
    shuffled = in_order;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
    std::printf("%zu MB, two threads\n", BYTES >> 20);
    report("whole rows, each thread half the blocks, in order", [&] {
        return two_threads([&] { read_blocks(in_order, 0, n / 2, 0, ROW, ROW, 0); },
                           [&] { read_blocks(in_order, n / 2, n, 0, ROW, ROW, 1); });
    });
    report("one KV head per thread: every other 256-byte piece", [&] {
        return two_threads([&] { read_blocks(in_order, 0, n, 0, HEAD, ROW, 0); },
                           [&] { read_blocks(in_order, 0, n, HEAD, HEAD, ROW, 1); });
    });
    report("whole rows, each thread half the blocks, blocks shuffled", [&] {
        return two_threads([&] { read_blocks(shuffled, 0, n / 2, 0, ROW, ROW, 0); },
                           [&] { read_blocks(shuffled, n / 2, n, 0, ROW, ROW, 1); });
    });
    for (int work : {0, 5})
        for (bool burst : {false, true}) {
            if (burst && work == 0) continue;
            char what[96];
            for (size_t span : {BYTES / 2, size_t(3) << 20}) {
                std::snprintf(what, sizeof what, "the kernel's order, %d fma rounds a line%s, %s", work,
                              burst ? ", bursts" : "", span == BYTES / 2 ? "from memory" : "3 MB cycled (L3)");
                report(what, [&] {
                    return two_threads([&] { chunks_with_work(0, span, work, burst); },
                                       [&] { chunks_with_work(1, span, work, burst); });
                });
            }
        }
    std::free(p);
}
