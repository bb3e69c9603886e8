// Sparse FFN for small-batch decoding on CPU threads (the "cold" side of the hybrid engine).
//
//   out[t, :] = sum_{k} h[t, k] * down_nm[idx[k], :]
//   h[t, k]   = act(gate[idx[k], :] . x[t, :], up[idx[k], :] . x[t, :])
//
// Shapes: x (T, H) fp32; the weights are F neuron bundles (see Layout below): neuron i's
// gate row, up row and down_nm row (its column of the usual (H, F) down matrix), back to
// back. Weights are fp32, or int8 with one fp32 scale per row (w = q * scale), stored in the
// bundle after the rows.
//
// Why it looks like this: batch-1 decode is memory-bound, so the kernel reads each active
// neuron's bundle exactly once, as one sequential stream (no gathered copy), prefetching the
// bundle it will read next (a random address the hardware prefetcher cannot guess).
// Threads split the active neurons; each neuron's gate/up dots and its down update are done
// by the same thread back to back, so there is one parallel region and no barrier between
// the two halves. Each thread accumulates into its own (T, H) buffer; the buffers are summed
// at the end (T * H * threads floats: tiny next to the weights).
//
// Threads come from ATen's pool (at::parallel_for, OpenMP underneath in the CPU wheels), so
// the kernel respects torch.set_num_threads and never starts a second OpenMP runtime whose
// spinning workers would fight torch's for the same cores.

// Narrow includes instead of <torch/extension.h>: the JIT build takes about half as long.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "activation.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EMBER_AVX2 1
#endif

namespace {

#ifdef EMBER_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#ifndef EMBER_PREFETCH
#define EMBER_PREFETCH 1
#endif

// Software prefetch of the next active neuron's row, one cache line per line processed: the
// next row is somewhere else in memory (random active set), so the hardware prefetcher
// cannot guess it, and each row start would otherwise pay full DRAM latency.
inline void prefetch(const void* p) {
#if EMBER_PREFETCH && (defined(__GNUC__) || defined(__clang__))
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

// How far ahead the prefetch runs, in bytes of bundles (at least one neuron): far enough to
// cover DRAM latency with small bundles, near enough that the lines are still in L1/L2 when
// used: the neuron about this many bytes further down this thread's list (1 to 8 neurons).
#ifndef EMBER_PF_BYTES
#define EMBER_PF_BYTES 16384
#endif

// Elements of W per 64-byte cache line (fp32 16, int8 64): the unit of the inner loops.
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);

// out[r * NT + t] = rows[r] . x[t, :] for NR rows (1, or 2: a neuron's gate and up read
// together, two streams in flight) and NT tokens; each row is loaded once for all NT tokens.
// C independent FMA chains per (row, token), at least 4 chains in all: a single chain is
// latency-bound (one FMA per ~5 cycles), which made the int8 path compute-bound.
// pf[r]: the same row of the next neuron (or null), prefetched line by line.
template <int NR, int NT, typename W>
void dot_token_tile(const W* const* rows, const W* const* pf, const float* x, int64_t H, float* out) {
  constexpr int C = NR * NT >= 4 ? 1 : 4 / (NR * NT);
  constexpr int64_t kStep = 8 * C > kLine<W> ? 8 * C : kLine<W>;  // elements per iteration
  int64_t j = 0;
#ifdef EMBER_AVX2
  __m256 a[NR][NT][C];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < C; ++c) a[r][t][c] = _mm256_setzero_ps();
  for (; j + kStep <= H; j += kStep) {
    if (pf)
      for (int r = 0; r < NR; ++r)
        for (int64_t l = 0; l < kStep; l += kLine<W>) prefetch(pf[r] + j + l);
    for (int64_t v = 0; v < kStep; v += 8 * C) {
      for (int c = 0; c < C; ++c) {
        __m256 w[NR];
        for (int r = 0; r < NR; ++r) w[r] = load8(rows[r] + j + v + 8 * c);
        for (int t = 0; t < NT; ++t) {
          const __m256 xv = _mm256_loadu_ps(x + t * H + j + v + 8 * c);
          for (int r = 0; r < NR; ++r) a[r][t][c] = _mm256_fmadd_ps(w[r], xv, a[r][t][c]);
        }
      }
    }
  }
  for (; j + 8 <= H; j += 8) {  // odd sizes: the tail's whole vectors
    for (int r = 0; r < NR; ++r) {
      const __m256 w = load8(rows[r] + j);
      for (int t = 0; t < NT; ++t)
        a[r][t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * H + j), a[r][t][0]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      __m256 sum = a[r][t][0];
      for (int c = 1; c < C; ++c) sum = _mm256_add_ps(sum, a[r][t][c]);
      out[r * NT + t] = hsum(sum);
    }
#else
  (void)pf;
  for (int k = 0; k < NR * NT; ++k) out[k] = 0.f;
#endif
  for (; j < H; ++j)
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) out[r * NT + t] += float(rows[r][j]) * x[t * H + j];
}

// acc[t, :] += c[t] * row for NT tokens; the row is loaded once for all NT tokens.
template <int NT, typename W>
void axpy_token_tile(const W* row, const W* pf, const float* c, int64_t H, float* acc) {
  int64_t j = 0;
#ifdef EMBER_AVX2
  __m256 cv[NT];
  for (int t = 0; t < NT; ++t) cv[t] = _mm256_set1_ps(c[t]);
  for (; j + kLine<W> <= H; j += kLine<W>) {
    if (pf) prefetch(pf + j);
    for (int64_t v = 0; v < kLine<W>; v += 16) {
      const __m256 w0 = load8(row + j + v), w1 = load8(row + j + v + 8);
      for (int t = 0; t < NT; ++t) {
        float* a = acc + t * H + j + v;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(cv[t], w0, _mm256_loadu_ps(a)));
        _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(cv[t], w1, _mm256_loadu_ps(a + 8)));
      }
    }
  }
#else
  (void)pf;
#endif
  for (; j < H; ++j)
    for (int t = 0; t < NT; ++t) acc[t * H + j] += c[t] * float(row[j]);
}

// Tokens in tiles of up to 4 (register pressure: accumulators + rows must fit in 16 ymm).
// out: NR runs of T results (the gate dots, then the up dots).
template <int NR, typename W>
void dot_all(const W* const* rows, const W* const* pf, const float* x, int64_t T, int64_t H,
             float* out) {
  for (int64_t t = 0; t < T; t += 4, pf = nullptr) {  // prefetch during the first tile only
    float o[NR * 4];
    const float* xt = x + t * H;
    const int nt = T - t >= 4 ? 4 : (int)(T - t);
    switch (nt) {
      case 4: dot_token_tile<NR, 4>(rows, pf, xt, H, o); break;
      case 3: dot_token_tile<NR, 3>(rows, pf, xt, H, o); break;
      case 2: dot_token_tile<NR, 2>(rows, pf, xt, H, o); break;
      default: dot_token_tile<NR, 1>(rows, pf, xt, H, o); break;
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < nt; ++k) out[r * T + t + k] = o[r * nt + k];
  }
}

template <typename W>
void axpy_all(const W* row, const W* pf, const float* c, int64_t T, int64_t H, float* acc) {
  for (int64_t t = 0; t < T; t += 4, pf = nullptr) {
    switch (T - t >= 4 ? 4 : T - t) {
      case 4: axpy_token_tile<4>(row, pf, c + t, H, acc + t * H); break;
      case 3: axpy_token_tile<3>(row, pf, c + t, H, acc + t * H); break;
      case 2: axpy_token_tile<2>(row, pf, c + t, H, acc + t * H); break;
      default: axpy_token_tile<1>(row, pf, c + t, H, acc + t * H); break;
    }
  }
}

// One neuron's bundle: its rows back to back, then (int8) its scales, padded to a cache line.
//   fp32: [gate H][up H][down H]                 row_elems = round_up(3H, 16) floats
//   int8: [gate H][up H][down H][scales 3 fp32]  scales at round_up(3H, 16) bytes,
//                                                row_elems = round_up(that + 16, 64) bytes
// Plain MLPs ("relu", "relu2") have no gate row (and no gate scale): 2 rows instead of 3.
// Must match bundle_layout in kernels/ffn_bundles.py.
struct Layout {
  int64_t nrows;      // 3 gated, 2 plain
  int64_t row_elems;  // bundle stride, in elements of W
  int64_t scale_off;  // byte offset of the nrows fp32 scales (int8), else -1
};

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

Layout layout_of(int64_t H, bool gated, bool quantized) {
  const int64_t nr = gated ? 3 : 2;
  if (!quantized) return {nr, round_up(nr * H, 16), -1};
  const int64_t s = round_up(nr * H, 16);
  return {nr, round_up(s + 16, 64), s};
}

// h_threshold >= 0: a token's h = act(gate, up) with |h| <= h_threshold is dropped (the down
// matmul's input threshold, issue 18); kept[slot * T + t] counts the neurons token t kept.
// h_threshold < 0: nothing is dropped but exact zeros, which change nothing (kept unused).
template <typename W>
void run(const float* x, int64_t T, int64_t H, const W* P, Layout L, bool gated,
         const int64_t* idx, int64_t n, Activation act, float* out, float* scratch, int nslots,
         std::vector<char>& used, float h_threshold, int64_t* kept) {
  const int64_t R = L.row_elems;
  const int64_t ahead_n = std::max<int64_t>(1, std::min<int64_t>(
      8, EMBER_PF_BYTES / std::max<int64_t>(1, R * (int64_t)sizeof(W))));
  // Chunks are dealt round-robin to n_workers slots (chunk c to slot c % n_workers), each
  // slot summing into its own buffer, and the buffers are added in slot order: the result is
  // the same bits on every call, whichever OpenMP thread runs which slot. (An earlier shared
  // counter balanced better under preemption but made the sums' order, and so the low bits
  // of the output, differ from call to call.) A chunk holds at least ~64 KiB of weights.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(
      16384 / std::max<int64_t>(H, 1) + 1, n / (8 * (int64_t)nslots) + 1));
  const int64_t n_workers = std::min<int64_t>(nslots, (n + chunk - 1) / chunk);
  const int64_t stride = n_workers * chunk;
  auto work = [&](int64_t slot) {
    float* acc = slot == 0 ? out : scratch + (slot - 1) * T * H;
    used[slot] = 1;
    float buf[3 * 16];  // g, u, c for T tokens (heap only past 16 tokens)
    std::vector<float> big(T > 16 ? 3 * T : 0);
    float* g = T > 16 ? big.data() : buf;
    float *u = g + T, *c = u + T;
    // The slot's next chunk is known in advance, so the neurons it prefetches near a chunk's
    // end are ones it will process itself.
    for (int64_t begin = slot * chunk, ahead; begin < n; begin = ahead) {
      const int64_t end = std::min(n, begin + chunk);
      ahead = begin + stride;
      for (int64_t k = begin; k < end; ++k) {
        const int64_t i = idx ? idx[k] : k;
        const W* rec = P + i * R;
        // This slot's neuron ahead_n further on (or this one, at the very end: harmless).
        int64_t kn = k + ahead_n < end ? k + ahead_n : ahead + (k + ahead_n - end);
        if (kn >= n || kn >= ahead + chunk) kn = k;
        const W* nrec = P + (idx ? idx[kn] : kn) * R;
        if (L.scale_off >= 0) prefetch(reinterpret_cast<const char*>(nrec) + L.scale_off);
        if (gated) {  // g and u are adjacent in buf, so one call fills both
          const W* rows[2] = {rec, rec + H};
          const W* pf[2] = {nrec, nrec + H};
          dot_all<2>(rows, pf, x, T, H, g);
        } else {
          const W* rows[1] = {rec};
          const W* pf[1] = {nrec};
          dot_all<1>(rows, pf, x, T, H, u);
        }
        float gs = 1.f, us = 1.f, ds = 1.f;
        if (L.scale_off >= 0) {
          const float* s = reinterpret_cast<const float*>(
              reinterpret_cast<const char*>(rec) + L.scale_off);
          gs = gated ? s[0] : 1.f;
          us = s[L.nrows - 2];
          ds = s[L.nrows - 1];
        }
        bool any = false;
        for (int64_t t = 0; t < T; ++t) {
          const float h = activate(act, gated ? g[t] * gs : 0.f, u[t] * us);
          const bool keep = h_threshold < 0.f || std::fabs(h) > h_threshold;
          c[t] = keep ? h * ds : 0.f;
          if (kept && keep) ++kept[slot * T + t];
          any |= c[t] != 0.f;
        }
        // Exact zeros (ReLU family) skip the down row: a third of the neuron's bytes.
        const int64_t dn = (L.nrows - 1) * H;
        if (any) axpy_all(rec + dn, nrec + dn, c, T, H, acc);
      }
    }
  };
  if (n_workers <= 1) {
    work(0);  // no parallel region: no wake-up of the pool for small active sets
  } else {
    at::parallel_for(0, n_workers, 1, [&](int64_t b, int64_t e) {
      for (int64_t slot = b; slot < e; ++slot) work(slot);
    });
  }
  for (int s = 1; s < nslots; ++s) {
    if (!used[s]) continue;
    const float* src = scratch + (int64_t)(s - 1) * T * H;
    for (int64_t j = 0; j < T * H; ++j) out[j] += src[j];
  }
}

}  // namespace

namespace {

// The shared body of ffn and ffn_thresholded; kept: (T,) int64 counts, or undefined.
at::Tensor ffn_impl(at::Tensor x, at::Tensor packed, int64_t hidden,
                    c10::optional<at::Tensor> idx, int64_t act, double h_threshold,
                    at::Tensor* kept) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 (T, hidden)");
  const Activation activation = activation_of(act);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(H == hidden, "x has ", H, " features, the weights ", hidden);
  const auto dt = packed.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kChar, "weights must be fp32 or int8");
  const bool q = dt == at::kChar;
  const bool gated = is_gated(activation);
  const Layout L = layout_of(H, gated, q);
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == L.row_elems && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              "packed must be contiguous (ffn, ", L.row_elems, ") on the CPU, got ", packed.sizes());
  const int64_t F = packed.size(0);
  const int64_t* ip = nullptr;
  int64_t n = F;
  if (idx.has_value()) {
    const auto& ix = *idx;
    TORCH_CHECK(ix.dim() == 1 && ix.scalar_type() == at::kLong && ix.is_contiguous(),
                "active_idx must be a contiguous int64 vector");
    ip = ix.data_ptr<int64_t>();
    n = ix.size(0);
    for (int64_t k = 0; k < n; ++k)
      TORCH_CHECK_INDEX(ip[k] >= 0 && ip[k] < F, "active index ", ip[k], " out of range [0, ", F, ")");
  }
  auto out = at::zeros({T, H}, x.options());
  const int nslots = std::max(1, at::get_num_threads());
  auto scratch = at::zeros({std::max(nslots - 1, 0), T, H}, x.options());
  std::vector<char> used(nslots, 0);
  // Per slot, so threads never share a counter; summed below.
  std::vector<int64_t> counts(kept ? (size_t)(nslots * T) : 0, 0);
  const float thr = kept ? (float)h_threshold : -1.f;
  if (n > 0 && T > 0 && H > 0) {
    if (q)
      run<int8_t>(x.data_ptr<float>(), T, H, packed.data_ptr<int8_t>(), L, gated, ip, n,
                  activation, out.data_ptr<float>(), scratch.data_ptr<float>(), nslots, used,
                  thr, kept ? counts.data() : nullptr);
    else
      run<float>(x.data_ptr<float>(), T, H, packed.data_ptr<float>(), L, gated, ip, n,
                 activation, out.data_ptr<float>(), scratch.data_ptr<float>(), nslots, used,
                 thr, kept ? counts.data() : nullptr);
  }
  if (kept) {
    *kept = at::zeros({T}, x.options().dtype(at::kLong));
    int64_t* k = kept->data_ptr<int64_t>();
    for (int s = 0; s < nslots; ++s)
      for (int64_t t = 0; t < T; ++t) k[t] += counts[(size_t)(s * T + t)];
  }
  return out;
}

}  // namespace

// x (T, H) fp32; packed (F, row_elems) bundles, fp32 or int8 (see Layout); idx optional
// (None = every neuron, dense).
at::Tensor ffn(at::Tensor x, at::Tensor packed, int64_t hidden, c10::optional<at::Tensor> idx,
               int64_t act) {
  return ffn_impl(x, packed, hidden, idx, act, -1.0, nullptr);
}

// ffn with the down matmul's input thresholded: each token drops the neurons whose
// |act(gate, up)| <= h_threshold (>= 0). Returns (out (T, H), kept (T,) int64).
std::tuple<at::Tensor, at::Tensor> ffn_thresholded(at::Tensor x, at::Tensor packed,
                                                   int64_t hidden, c10::optional<at::Tensor> idx,
                                                   int64_t act, double h_threshold) {
  TORCH_CHECK(h_threshold >= 0.0, "h_threshold must be >= 0, got ", h_threshold);
  at::Tensor kept;
  at::Tensor out = ffn_impl(x, packed, hidden, idx, act, h_threshold, &kept);
  return {out, kept};
}

// How many threads one at::parallel_for region of this extension really runs on (tests check
// it follows torch.set_num_threads: a build without OpenMP silently runs regions serially).
int64_t parallel_workers() {
  const int n = std::max(1, at::get_num_threads());
  std::vector<std::atomic<int>> seen(n);
  for (auto& s : seen) s.store(0);
  std::atomic<int> arrived{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && tid < n) seen[tid].store(1);
    // Hold every worker until all have arrived (or a short timeout), so one fast thread
    // cannot take every chunk and hide the others.
    arrived.fetch_add(1);
    for (int spin = 0; spin < 2000000 && arrived.load() < n; ++spin) {}
  });
  int64_t count = 0;
  for (auto& s : seen) count += s.load();
  return count;
}

bool has_avx2() {
#ifdef EMBER_AVX2
  return true;
#else
  return false;
#endif
}
