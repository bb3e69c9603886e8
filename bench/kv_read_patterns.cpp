// How fast two threads read a decode step's KV bytes, by access pattern: the measurement
// behind attention.cpp's work split (docs/long-context.md, "Attention at long contexts").
// The bytes are the 1.5B's at 6k tokens (28 layers x K and V x 6,144 rows x 2 KV heads x 128
// float16 values = 176 MB); each pattern converts every float16 it reads and adds it up, as
// the kernel's conversion does, with no other arithmetic.
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
    std::printf("%-62s %6.2f ms (%.2f-%.2f)\n", what, ms[4], ms[0], ms[8]);
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
    std::free(p);
}
