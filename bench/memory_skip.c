/* How much faster a machine's memory reads a random subset of fixed-size runs than all of them:
 * the ceiling of any kernel that skips bytes at that granularity (input sparsity skips one
 * input's column of quants, N/2 bytes for a 4-bit weight of N outputs). Built and run by
 * bench/memory_skip.py, which explains the output.
 *
 * usage: memory_skip BUFFER_MIB THREADS REPEATS RUN_BYTES... -- KEEP_FRACTIONS...
 * prints one line per (run bytes, kept fraction):
 *   run_bytes keep all_gbps subset_seconds all_seconds ideal
 * Each thread reads its own contiguous share of the listed runs in ascending order (as a
 * kernel walks a weight), with 64-byte vector loads folded into a checksum that is printed at
 * the end so the compiler keeps every load. Timings are the best of REPEATS, the two reads
 * alternated. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef uint64_t lanes __attribute__((vector_size(64)));
static uint64_t checksum;

/* Reads runs idx[0..n) of `bytes` each from buf; returns the seconds taken. */
static double read_runs(const char *buf, size_t bytes, const int64_t *idx, int64_t n, int threads) {
    double t0 = now();
    uint64_t sums[256] = {0};
#pragma omp parallel num_threads(threads)
    {
        int id = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t a = n * id / nt, b = n * (id + 1) / nt;
        lanes acc0 = {0}, acc1 = {0};
        for (int64_t k = a; k < b; ++k) {
            const char *p = buf + (size_t)idx[k] * bytes;
            for (size_t o = 0; o + 128 <= bytes; o += 128) {
                lanes v0, v1;
                memcpy(&v0, p + o, 64);
                memcpy(&v1, p + o + 64, 64);
                acc0 ^= v0;
                acc1 ^= v1;
            }
        }
        lanes acc = acc0 ^ acc1;
        uint64_t s = 0;
        for (int i = 0; i < 8; ++i) s ^= acc[i];
        sums[id % 256] = s;
    }
    double t = now() - t0;
    for (int i = 0; i < 256; ++i) checksum ^= sums[i];
    return t;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s BUFFER_MIB THREADS REPEATS RUN_BYTES... -- KEEP...\n", argv[0]);
        return 2;
    }
    size_t total = (size_t)atol(argv[1]) << 20;
    int threads = atoi(argv[2]), repeats = atoi(argv[3]);
    int sep = 4;
    while (sep < argc && strcmp(argv[sep], "--") != 0) ++sep;
    if (sep >= argc - 1 || sep == 4 || total == 0 || threads < 1 || repeats < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    /* 2 MiB-aligned and advised for huge pages, as Ember's big buffers are */
    char *buf = aligned_alloc(2 << 20, total);
    if (!buf) {
        fprintf(stderr, "cannot allocate %zu bytes\n", total);
        return 1;
    }
    madvise(buf, total, MADV_HUGEPAGE);
    for (size_t i = 0; i < total; ++i) buf[i] = (char)(i * 131);
    for (int r = 4; r < sep; ++r) {
        size_t bytes = (size_t)atol(argv[r]);
        if (bytes < 128 || bytes % 128 || bytes > total) {
            fprintf(stderr, "run bytes must be a multiple of 128 up to the buffer: %s\n", argv[r]);
            return 2;
        }
        int64_t n = (int64_t)(total / bytes);
        int64_t *all = malloc(n * sizeof *all), *sub = malloc(n * sizeof *sub);
        for (int64_t i = 0; i < n; ++i) all[i] = i;
        for (int f = sep + 1; f < argc; ++f) {
            double keep = atof(argv[f]);
            int64_t m = 0;
            srand(12345);
            for (int64_t i = 0; i < n; ++i)
                if (rand() < keep * RAND_MAX) sub[m++] = i;
            double best_all = 1e30, best_sub = 1e30;
            for (int k = 0; k < repeats; ++k) {
                double t = read_runs(buf, bytes, all, n, threads);
                if (t < best_all) best_all = t;
                t = read_runs(buf, bytes, sub, m, threads);
                if (t < best_sub) best_sub = t;
            }
            printf("%zu %.4f %.3f %.6f %.6f %.4f\n", bytes, m / (double)n,
                   (double)n * bytes / best_all / 1e9, best_sub, best_all,
                   m ? (double)n / m : 0.0);
            fflush(stdout);
        }
        free(all);
        free(sub);
    }
    fprintf(stderr, "checksum %llu\n", (unsigned long long)checksum);
    return 0;
}
