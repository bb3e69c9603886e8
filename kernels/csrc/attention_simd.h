// The attention kernels (attention.cpp) on 16-value vectors: one AVX-512 register, or two AVX2
// registers side by side. Both compute attention_math.h's operations in its order: a lane of
// a score's accumulator is lane l of attention_math.h's, the tree is the same tree, so every
// path gives the same bits (tests/test_attention.py checks it).
//
// Scores go in tiles of QN query vectors x KN keys, QN * KN accumulators in registers, each
// key (and query) value loaded once per tile; the 16 accumulators are then reduced together by
// a transposing network (each stage adds lanes 8, 4, 2, 1 apart: tree16 for every one of
// them), not one by one. Values go in runs of keys with NH heads' outputs (W vectors of 16
// columns each) held in registers, each value vector loaded once for the NH heads.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_math.h"
#include "attention_vectors.h"

namespace ember_attention {

// The kernels over a vector type V (Avx2 or Avx512); head dims a multiple of 16.
template <class V>
struct SimdKernels {
    using T = typename V::T;
    // Whether a row's scores and values read float16 or Q8_0 rows in place (converting as
    // they load): when its query heads per KV head fit one score tile and one block of values
    // (see values), so each key and value still converts once, as in a pass.
    static constexpr bool reads_in_place(int64_t heads, int64_t hd) {
        return heads <= V::QN_MAX && (heads <= 3 || six_head_values(hd));
    }

    // Whether values take up to 6 heads in one block (else 3): 6 x 4 vectors on AVX-512 (head
    // dims a multiple of 64), 6 x 1 on AVX2 (12 of its 16 registers).
    static constexpr bool six_head_values(int64_t hd) { return V::MAX_W < 4 || hd / LANES % 4 == 0; }

    static void from_half(const uint16_t* h, int64_t n, float* out) { V::from_half(h, n, out); }
    static void from_int8(const int8_t* q, float d, float* out) { V::from_int8(q, d, out); }

    // A bfloat16 pool's rows as floats (n a multiple of 32): keys in the score lanes' order
    // (bf16_key_dim), values as they are.
    static void from_bf16(const Bf16Row* row, int64_t n, bool keys, float* out) {
        for (int64_t i = 0; i < n; i += LANES) V::store(out + i, keys ? V::load_key(row, i) : V::load(row, i));
    }

    // Values i..i+15 of a value row: floats, or float16, Q8_0 or bfloat16 converted as they load.
    template <class E>
    static EMBER_INLINE T load_at(const E* row, int64_t i) {
        if constexpr (std::is_same_v<E, Q8Row> || std::is_same_v<E, Bf16Row>) return V::load(row, i);
        else return V::load(row + i);
    }
    // The same of a key row (a bfloat16 key in the score lanes' order).
    template <class E>
    static EMBER_INLINE T load_key_at(const E* row, int64_t i) {
        if constexpr (std::is_same_v<E, Bf16Row>) return V::load_key(row, i);
        else return load_at(row, i);
    }

    // Scores of QN query vectors against KN keys, times scale: out[i * KN + j]. Keys here (and
    // values below) are float (E), or float16 or Q8_0 converted in registers as they load: a
    // separate conversion pass into scratch cost a quarter of the kernel's time (Zen 4 converts
    // one 16-value register per two cycles; the pass added a store and a reload of each). Each
    // query vector is loaded once into a register for its KN fmas: left to itself the
    // compiler folds the load into every fma, and a 6 x 2 tile's 14 loads (a 512-bit load a
    // cycle on Zen 4) to 12 fmas then bound it (the 1.5B's 6k decode attention 1.15-1.19x).
    template <int QN, int KN, class E>
    static EMBER_INLINE void tile(const float* const* q, const E* const* k, int64_t hd, float scale, float* out) {
        T acc[QN * KN];
        for (int i = 0; i < QN * KN; ++i) acc[i] = V::zero();
        for (int64_t d = 0; d < hd; d += LANES) {
            T kv[KN];
            for (int j = 0; j < KN; ++j) kv[j] = load_key_at(k[j], d);
            for (int i = 0; i < QN; ++i) {
                T qv = V::load(q[i] + d);
                if constexpr (KN > 1) V::in_register(qv);
                for (int j = 0; j < KN; ++j) acc[i * KN + j] = V::fma(qv, kv[j], acc[i * KN + j]);
            }
        }
        float s[QN * KN];
        V::sums(acc, QN * KN, s);
        for (int i = 0; i < QN * KN; ++i) out[i] = s[i] * scale;
    }

    // QN query vectors against keys x0..x1-1: s[i * lds + x]. Keys past x1 in the last tile
    // repeat key x1 - 1 (their scores land in s's slack, never read). before_tile(a, b) runs
    // ahead of each tile, keys a..b-1 (attention.cpp prefetches there).
    template <int QN, class E, class Hook>
    static void score_rows(const float* const* q, const E* const* k, int x0, int x1, int64_t hd,
                           float scale, float* s, int lds, const Hook& before_tile) {
        constexpr int KN = V::KN_OF[QN];
        float out[QN * KN];
        for (int x = x0; x < x1; x += KN) {
            before_tile(x, x + KN < x1 ? x + KN : x1);
            const E* kx[KN];
            for (int j = 0; j < KN; ++j) kx[j] = k[x + j < x1 ? x + j : x1 - 1];
            tile<QN, KN>(q, kx, hd, scale, out);
            for (int i = 0; i < QN; ++i)
                for (int j = 0; j < KN; ++j) s[i * lds + x + j] = out[i * KN + j];
        }
    }

    // nq query vectors, in tiles of up to QN of them (5 or 6 in one tile); before_tile runs for
    // the first tiles' keys only, so once for each key.
    template <class E, class Hook = NoHook>
    static void scores(const float* const* q, int nq, const E* const* k, int x0, int x1,
                       int64_t hd, float scale, float* s, int lds, const Hook& before_tile = {}) {
        if constexpr (V::QN_MAX >= 6) {
            if (nq == 5) return score_rows<5>(q, k, x0, x1, hd, scale, s, lds, before_tile);
            if (nq == 6) return score_rows<6>(q, k, x0, x1, hd, scale, s, lds, before_tile);
        }
        for (int i = 0; i < nq;) {
            const int n = nq - i < V::QN ? nq - i : V::QN;
            float* si = s + static_cast<int64_t>(i) * lds;
            if (i == 0) score_group(n, q, k, x0, x1, hd, scale, si, lds, before_tile);
            else score_group(n, q + i, k, x0, x1, hd, scale, si, lds, NoHook{});
            i += n;
        }
    }

    // Keys in one of scores' first tiles for nq query vectors.
    static constexpr int tile_keys(int nq) {
        return V::QN_MAX >= 6 && (nq == 5 || nq == 6) ? V::KN_OF[nq] : V::KN_OF[nq < V::QN ? nq : V::QN];
    }

    // score_rows for a group of n <= QN query vectors
    template <class E, class Hook>
    static void score_group(int n, const float* const* q, const E* const* k, int x0, int x1, int64_t hd,
                            float scale, float* s, int lds, const Hook& before_tile) {
        switch (n) {
            case 1: score_rows<1>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
            case 2: score_rows<2>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
            case 3: if constexpr (V::QN >= 3) score_rows<3>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
            default: if constexpr (V::QN >= 4) score_rows<4>(q, k, x0, x1, hd, scale, s, lds, before_tile); break;
        }
    }

    // max of s[a..b) (exact in any order)
    static float max_of(const float* s, int a, int b) {
        T best = V::bcast(-INFINITY);
        for (int g = a & ~(LANES - 1); g < b; g += LANES) best = V::max(best, V::keep_or(V::load(s + g), g, a, b, -INFINITY));
        return V::lane_max(best);
    }

    // p[x] = exp(s[x] - m) for a <= x < b (zeros around it, within its 16-aligned groups),
    // bf16_round-ed for a bfloat16 pool; returns their sum (lane per position mod 16, then
    // tree16).
    static float exp_sum(const float* s, float* p, int a, int b, float m, bool bf16) {
        T acc = V::zero();
        for (int g = a & ~(LANES - 1); g < b; g += LANES) {
            T e = V::keep(V::exp_shifted(V::load(s + g), m), g, a, b);
            if (bf16) e = V::round_bf16(e);
            V::store(p + g, e);
            acc = V::add(acc, e);
        }
        return V::lane_tree(acc);
    }

    // NH heads of one row, columns col..col + 16 W: o = sum over a <= x < b of p[h][x] v[x],
    // joined into O[h] as f[h] says.
    template <int W, int NH, class E>
    static EMBER_INLINE void value_block(const float* const* p, const E* const* v, int a, int b, int64_t col,
                            float* const* O, const Fold* f) {
        T acc[NH][W];
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < W; ++w) acc[h][w] = V::zero();
        for (int x = a; x < b; ++x) {
            T vv[W];
            for (int w = 0; w < W; ++w) {
                vv[w] = load_at(v[x], col + LANES * w);
                if constexpr (NH > 1) V::in_register(vv[w]);  // one load for the NH fmas (see tile)
            }
            // each head's weight broadcast just before its fmas: NH of them computed first
            // and held (AVX2's 6 x 1 block: 12 accumulators, 2 value and 6 weight registers)
            // left the compiler 20 registers to place in 16, and it spilled accumulators
            for (int h = 0; h < NH; ++h) {
                const T b = V::bcast(p[h][x]);
                for (int w = 0; w < W; ++w) acc[h][w] = V::fma(b, vv[w], acc[h][w]);
            }
        }
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < W; ++w) merge_into(O[h] + col + LANES * w, acc[h][w], f[h]);
    }

    // 16 values of a chunk's o joined into O's at `out` as f says (attention_math.h's merge).
    static EMBER_INLINE void merge_into(float* out, T o, Fold f) {
        const T c = V::bcast(f.coef);
        switch (f.how) {
            case Merge::FIRST: V::store(out, o); break;
            case Merge::SCALE_CHUNK: V::store(out, V::fma(o, c, V::load(out))); break;
            case Merge::SCALE_RUNNING: V::store(out, V::fma(V::load(out), c, o)); break;
        }
    }

    // Heads in blocks of up to NH_MAX: each value vector loaded once per block (a load per
    // NH_MAX fmas, not per head: 8 x 16 columns and 3 heads took ~27 loads per 24 fmas).
    template <int W, int NH_MAX, class E>
    static void value_heads(const float* const* p, int nh, const E* const* v, int a, int b,
                            int64_t hd, float* const* O, const Fold* f) {
        for (int64_t col = 0; col < hd; col += LANES * W)
            for (int h = 0; h < nh; h += NH_MAX) {
                const int n = nh - h < NH_MAX ? nh - h : NH_MAX;
                switch (n) {
                    case 1: value_block<W, 1>(p + h, v, a, b, col, O + h, f + h); break;
                    case 2: value_block<W, 2>(p + h, v, a, b, col, O + h, f + h); break;
                    case 3: value_block<W, 3>(p + h, v, a, b, col, O + h, f + h); break;
                    case 4: if constexpr (NH_MAX >= 4) value_block<W, 4>(p + h, v, a, b, col, O + h, f + h); break;
                    case 5: if constexpr (NH_MAX >= 5) value_block<W, 5>(p + h, v, a, b, col, O + h, f + h); break;
                    default: if constexpr (NH_MAX >= 6) value_block<W, 6>(p + h, v, a, b, col, O + h, f + h); break;
                }
            }
    }

    template <class E>
    static void values(const float* const* p, int nh, const E* const* v, int a, int b,
                       int64_t hd, float* const* O, const Fold* f) {
        // 24 accumulator registers on AVX-512: 6 heads x 4 vectors, or 3 x 8 for 3 heads or
        // fewer; AVX2's 16 registers hold 6 heads x 1 or 3 x 2 (two registers each)
        const int64_t n16 = hd / LANES;
        if (nh > 3 && six_head_values(hd)) return value_heads<V::MAX_W >= 4 ? 4 : 1, 6>(p, nh, v, a, b, hd, O, f);
        if (V::MAX_W >= 8 && n16 % 8 == 0) return value_heads<V::MAX_W >= 8 ? 8 : 1, 3>(p, nh, v, a, b, hd, O, f);
        if (V::MAX_W >= 4 && n16 % 4 == 0) return value_heads<V::MAX_W >= 4 ? 4 : 1, 3>(p, nh, v, a, b, hd, O, f);
        if (n16 % 2 == 0) return value_heads<2, 3>(p, nh, v, a, b, hd, O, f);
        value_heads<1, 3>(p, nh, v, a, b, hd, O, f);
    }
};

}  // namespace ember_attention
