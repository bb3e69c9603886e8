// See attention.h; how it works and what it costs: docs/long-context.md, "Attention at long
// contexts". Flash attention on the CPU, tiled over query rows and key chunks:
// - For one KV head, a tile of up to TILE_ROWS rows and a chunk of CHUNK positions (aligned,
//   4 paged blocks), the chunk's K and V are read once and used by every query head of every
//   row in the tile (GQA). Each (row, head) turns a chunk into a partial and folds it into its
//   running one in position order (attention_math.h), so a row's bits depend only on its own
//   query and keys: a decoded token, the same token in a prompt chunk or a speculative tree,
//   any thread count. Chunks past a row's position or before its window are skipped; tree
//   rows whose keys differ from the tile's at a chunk take that chunk alone.
// - Work items: (KV head, tile) for a prompt's tiles; (KV heads, the one tile) for a decoded
//   token or a tree, its chunks split between threads when items are fewer (flash-decoding,
//   attention_work.h: the first part folds its chunks as it goes, other chunks keep their
//   partials, folded afterwards in order; a thread done with its part takes chunks from the
//   back of another's).
// - A pool row holds all KV heads side by side: an item of every head reads its chunk's rows
//   whole and in order, one stream (bench/kv_read_patterns.cpp measures the alternatives).
#include "attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_bf16_dots.h"
#include "attention_portable.h"
#include "attention_simd.h"
#include "attention_work.h"
#include "ops.h"
#include "prefetch.h"

namespace ember_attention {
namespace {

constexpr int CHUNK = 64;       // keys per partial; a multiple of LANES
constexpr int TILE_ROWS = 16;   // query rows sharing one read of a chunk
constexpr int SLACK = 16;       // room after a score row for the padded last key tile
constexpr int SUB = 16;         // keys converted and scored at a time
constexpr int PREFETCH_AHEAD = 32;  // positions between a row read and the row prefetched
constexpr int SPREAD_TILE_KEYS = 4; // score tiles this short prefetch as they go (group_of)
// A decoded token's item holds at most this many bytes of a chunk's V as floats (all heads of
// the 1.5B's rows: 2 x 128 values x 64 positions); a model with many KV heads (Llama 2 7B's
// 32) takes them a few at a time rather than a megabyte of scratch per thread.
constexpr int64_t ITEM_VALUES_BYTES = 64 << 10;
#ifdef EMBER_ATTENTION_AVX512
static_assert(CHUNK <= 2 * Avx512Bf16Dots::MAX_PAIRS, "the bfloat16 dot products hold a chunk's weight pairs");
#endif

// A row's keys in one chunk: x in [a, b) is position c0 + x, pool row at[x - a].
struct Span {
    int t, a, b;
    const int64_t* at;
};

// Per-thread buffers, grown as needed.
struct Scratch {
    std::vector<float> k, v, s, p;
    std::vector<const float*> kp, vp, qp, pp;
    std::vector<const uint16_t*> kh, vh;  // float16 rows read in place
    std::vector<const Q8Row*> kq, vq;     // Q8_0 rows read in place
    std::vector<const Bf16Row*> kb, vb;   // bfloat16 rows read in place
    std::vector<float*> op;
    std::vector<Fold> folds;
    std::vector<int64_t> map;
    std::vector<Span> shared, solo;
};

// Element types read in place from the pool (else float copies).
template <class E>
constexpr bool in_place = std::is_same_v<E, uint16_t> || std::is_same_v<E, Q8Row> || std::is_same_v<E, Bf16Row>;

template <class K>
class Attention {
  public:
    Attention(const Rows& r, const KvPools& pools) : r_(r), kv_(pools) {
        hd_ = kv_.head_dim;
        G_ = r.n_heads / kv_.n_kv;
        lds_ = CHUNK + SLACK;
        if (kv_.type == KvType::BF16) rounded_queries();
        state_m_.assign(r.T * r.n_heads, 0.f);
        state_l_.assign(r.T * r.n_heads, 0.f);
        started_.assign(r.T * r.n_heads, 0);
    }

    void run() {
        std::vector<Item> items = plan();
        std::atomic<size_t> next{0};
        const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
        at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
            thread_local Scratch sc;
            for (size_t i; (i = next.fetch_add(1)) < items.size();) process(items[i], sc);
            take_the_rest(items, sc);
        });
        fold_partials(items);
        normalize();
    }

  private:
    const Rows& r_;
    const KvPools& kv_;
    const float* q_ = r_.q;  // the queries the scores read (r_.q, or rounded_queries)
    int64_t ldq_ = r_.ldq;
    std::vector<float> q_bf16_;
    int64_t hd_, G_;
    int lds_;
    std::vector<float> state_m_, state_l_;
    std::vector<uint8_t> started_;
    SplitWork split_;

    int64_t lo(int64_t t) const { return r_.pos[t] - r_.n[t] + 1; }

    // A bfloat16 pool's scores take the queries bf16_round-ed and in the score lanes' order
    // (attention_math.h, bf16_key_dim), as its keys are read.
    void rounded_queries() {
        const int64_t n = r_.n_heads * hd_;  // a multiple of 32 (kv_pools checks the head dim)
        q_bf16_.resize(r_.T * n);
        for (int64_t t = 0; t < r_.T; ++t)
            for (int64_t i = 0; i < n; i += BF16_PAIRS) {
                const float* q = r_.q + t * r_.ldq + i;
                float* out = q_bf16_.data() + t * n + i;
                for (int l = 0; l < LANES; ++l)
                    out[l] = bf16_round(q[2 * l + 1]), out[LANES + l] = bf16_round(q[2 * l]);
            }
        q_ = q_bf16_.data(), ldq_ = n;
    }

    std::vector<Item> plan() {
        const int64_t tiles = (r_.T + TILE_ROWS - 1) / TILE_ROWS;
        const int64_t heads_per_item = tiles == 1 ? heads_per_row_item() : 1;
        std::vector<Item> base;
        for (int64_t tile = tiles - 1; tile >= 0; --tile)  // the longest (last) rows first
            for (int64_t h = 0; h < kv_.n_kv; h += heads_per_item) {
                const int64_t t0 = tile * TILE_ROWS, t1 = std::min(r_.T, t0 + TILE_ROWS);
                int64_t c0 = INT64_MAX, c1 = 0;
                for (int64_t t = t0; t < t1; ++t) {
                    c0 = std::min(c0, lo(t) / CHUNK);
                    c1 = std::max(c1, r_.pos[t] / CHUNK + 1);
                }
                base.push_back({h, heads_per_item, t0, t1, c0, c1, -1, true});
            }
        return split_.split(base, at::get_num_threads(), G_, hd_);
    }

    // The KV heads of a decoded token's (or tree's) item: the most that divide the KV heads and
    // keep a chunk's values within ITEM_VALUES_BYTES.
    int64_t heads_per_row_item() const {
        for (int64_t d = kv_.n_kv; d > 1; --d)
            if (kv_.n_kv % d == 0 && d * hd_ * CHUNK * int64_t(sizeof(float)) <= ITEM_VALUES_BYTES) return d;
        return 1;
    }

    const uint8_t* pool_head(const uint8_t* pool, int64_t slot, int64_t kvh) const {
        return pool + slot * kv_.slot_bytes + kvh * kv_.head_bytes;
    }

    // The float values of `heads` KV heads side by side in a pool row: in place (float32) or
    // converted into buf (bfloat16 keys in the score lanes' order).
    const float* as_float(const uint8_t* head, int64_t heads, bool keys, float* buf) const {
        switch (kv_.type) {
            case KvType::BF16: K::from_bf16(reinterpret_cast<const Bf16Row*>(head), heads * hd_, keys, buf); return buf;
            case KvType::F32: return reinterpret_cast<const float*>(head);
            case KvType::F16: K::from_half(reinterpret_cast<const uint16_t*>(head), heads * hd_, buf); return buf;
            case KvType::Q8_0:
                for (int64_t b = 0; b < heads * hd_ / Q8_VALUES; ++b) {
                    const uint8_t* blk = head + b * Q8_BYTES;
                    const c10::Half d(static_cast<uint16_t>(q8_scale_bits(blk)), c10::Half::from_bits());
                    K::from_int8(q8_values(blk), static_cast<float>(d), buf + b * Q8_VALUES);
                }
                return buf;
        }
        return nullptr;
    }

    // An item's chunks in order, folded as they go; a split item's part takes them from its
    // front (folded as they go for the first part, else kept as partials) until none is left.
    void process(const Item& it, Scratch& sc) {
        size_for(it, sc);
        if (it.split < 0) {
            for (int64_t c = it.c0; c < it.c1; ++c) chunk(it, c, false, sc);
            return;
        }
        const int64_t most = it.first ? first_part_chunks.load(std::memory_order_relaxed) : -1;
        for (int64_t c, n = 0; (most < 0 || n < most) && split_.range(it).take_front(c); ++n)
            chunk(it, c, !it.first, sc);
    }

    // Chunks left in split items, taken from the back of the part with the most left.
    void take_the_rest(const std::vector<Item>& items, Scratch& sc) {
        for (const Item* sized = nullptr;;) {
            const Item* most = nullptr;
            int64_t most_left = 0;
            for (const Item& it : items) {
                const int64_t left = it.split >= 0 ? split_.range(it).left() : 0;
                if (left > most_left) most = &it, most_left = left;
            }
            if (!most) return;
            int64_t c;
            if (!split_.range(*most).take_back(c)) continue;
            if (most != sized) size_for(*most, sc), sized = most;
            chunk(*most, c, true, sc);
        }
    }

    void size_for(const Item& it, Scratch& sc) const {
        const int64_t rows = it.t1 - it.t0, heads = rows * G_ * it.nkv;
        sc.k.resize(SUB * hd_ * it.nkv), sc.v.resize(CHUNK * hd_ * it.nkv);
        sc.s.resize(heads * lds_), sc.p.resize(heads * lds_);
        sc.map.resize(CHUNK);
        sc.qp.resize(heads), sc.pp.resize(heads), sc.op.resize(heads), sc.folds.resize(heads);
    }

    // Chunk c of item it for its rows: folded into their running partials, or (stored) each
    // (row, head)'s partial kept in the partial store.
    void chunk(const Item& it, int64_t c, bool stored, Scratch& sc) {
        std::vector<Span>& shared = sc.shared;
        std::vector<Span>& solo = sc.solo;
        const int64_t c0 = c * CHUNK;
        shared.clear(), solo.clear();
        std::fill(sc.map.begin(), sc.map.end(), -1);
        for (int64_t t = it.t0; t < it.t1; ++t) {
            const int64_t l = lo(t), a = std::max(l, c0) - c0, b = std::min(r_.pos[t] + 1, c0 + CHUNK) - c0;
            if (a >= b) continue;
            const Span sp{static_cast<int>(t), static_cast<int>(a), static_cast<int>(b), r_.slots[t] + (c0 + a - l)};
            bool agrees = true;
            for (int64_t x = a; x < b; ++x) {
                const int64_t slot = sp.at[x - a];
                TORCH_CHECK_INDEX(slot >= 0 && slot < kv_.n_slots, "slot ", slot, " out of range (",
                                  kv_.n_slots, " pool rows)");
                agrees &= sc.map[x] < 0 || sc.map[x] == slot;
            }
            if (!agrees) {
                solo.push_back(sp);
                continue;
            }
            for (int64_t x = a; x < b; ++x) sc.map[x] = sp.at[x - a];
            shared.push_back(sp);
        }
        if (!shared.empty()) group(it, c, stored, shared.data(), shared.size(), sc.map.data(), sc);
        for (const Span& sp : solo) {
            for (int x = sp.a; x < sp.b; ++x) sc.map[x] = sp.at[x - sp.a];
            group(it, c, stored, &sp, 1, sc.map.data(), sc);
        }
    }

    // Pool row x (as the tile's last row reads it) in `pools`, `heads` of the item's KV heads
    // from its head j, on its way into L2 while the rows before it compute: the hardware
    // prefetchers run too little ahead of a thread that reads 8 KiB, then computes.
    void prefetch_row(std::initializer_list<const uint8_t*> pools, const Item& it, int64_t x, int64_t j,
                      int64_t heads) const {
        const int64_t t = it.t1 - 1;
        if (x < lo(t) || x > r_.pos[t] || x >= it.c1 * CHUNK) return;
        const int64_t slot = r_.slots[t][x - lo(t)];
        if (slot < 0 || slot >= kv_.n_slots) return;  // reported when read
        for (const uint8_t* pool : pools) ember_prefetch::lines_l2(pool_head(pool, slot, it.kvh + j), kv_.head_bytes * heads);
    }

    // A float16 or Q8_0 pool is read in place by one row whose heads fit the kernels' score
    // tile and value block (a decoded token): each value converts once as it loads (for Q8_0
    // the same product as a converted copy's, so the same bits). Rows sharing a chunk (a
    // prompt tile, a tree) take converted copies, which every row's heads reuse.
    void group(const Item& it, int64_t c, bool stored, const Span* spans, size_t n, const int64_t* map,
               Scratch& sc) {
        if constexpr (!std::is_same_v<K, Portable>) {
            if (kv_.type != KvType::F32 && n == 1 && K::reads_in_place(G_, hd_)) {
                if (kv_.type == KvType::BF16) {
                    sc.kb.resize(CHUNK * it.nkv), sc.vb.resize(CHUNK * it.nkv);
                    return group_of(it, c, stored, spans, n, map, sc, sc.kb.data(), sc.vb.data());
                }
                if (kv_.type == KvType::Q8_0) {
                    sc.kq.resize(CHUNK * it.nkv), sc.vq.resize(CHUNK * it.nkv);
                    return group_of(it, c, stored, spans, n, map, sc, sc.kq.data(), sc.vq.data());
                }
                sc.kh.resize(CHUNK * it.nkv), sc.vh.resize(CHUNK * it.nkv);
                return group_of(it, c, stored, spans, n, map, sc, sc.kh.data(), sc.vh.data());
            }
        }
        sc.kp.resize(CHUNK * it.nkv), sc.vp.resize(CHUNK * it.nkv);
        group_of(it, c, stored, spans, n, map, sc, sc.kp.data(), sc.vp.data());
    }

    // Pool row slot's `heads` KV heads from kvh as E values: float16, Q8_0 or bfloat16 in
    // place, or floats (in place for a float32 pool, else converted into buf).
    template <class E>
    const E* row_as(const uint8_t* pool, int64_t slot, int64_t kvh, int64_t heads, float* buf) const {
        const uint8_t* head = pool_head(pool, slot, kvh);
        if constexpr (in_place<E>) return reinterpret_cast<const E*>(head);
        else return as_float(head, heads, pool == kv_.k, buf);
    }

    // Head j of a row row_as gave: in place, a pool head apart; a float copy, hd_ floats.
    template <class E>
    const E* head_of(const E* row, int64_t j) const {
        if constexpr (in_place<E>)
            return reinterpret_cast<const E*>(reinterpret_cast<const uint8_t*>(row) + j * kv_.head_bytes);
        else return row + j * hd_;
    }

    // Chunk c for the rows `spans` (their keys at x are pool rows map[x]), for each of the
    // item's KV heads: the chunk's K rows (then V rows) are read whole, in position order, and
    // each head computes from its part of them; kp and vp (CHUNK per head) point at them.
    template <class E>
    void group_of(const Item& it, int64_t c, bool stored, const Span* spans, size_t n, const int64_t* map,
                  Scratch& sc, const E** kp, const E** vp) {
        int ua = CHUNK, ub = 0;
        for (size_t i = 0; i < n; ++i) ua = std::min(ua, spans[i].a), ub = std::max(ub, spans[i].b);
        int64_t any = -1;  // positions no row of the group reads (a hole) repeat a read one
        for (int x = ua; x < ub && any < 0; ++x) any = map[x];
        const int64_t nkv = it.nkv, per_head = static_cast<int64_t>(n) * G_;
        // rows x0..x1 (converted: row x at buf + (x - x0) * nkv * hd), head j's at at[j * CHUNK + x];
        // with `ahead`, each row's read prefetches the row PREFETCH_AHEAD positions on
        auto convert = [&](const uint8_t* pool, int x0, int x1, float* buf, const E** at, bool ahead) {
            for (int x = x0; x < x1; ++x) {
                if (ahead) prefetch_row({pool}, it, c * CHUNK + x + PREFETCH_AHEAD, 0, nkv);
                const int64_t slot = map[x] >= 0 ? map[x] : any;
                const E* row = row_as<E>(pool, slot, it.kvh, nkv, buf + (x - x0) * nkv * hd_);
                for (int64_t j = 0; j < nkv; ++j) at[j * CHUNK + x] = head_of(row, j);
            }
        };
        for (int64_t j = 0; j < nkv; ++j)
            for (size_t i = 0; i < n; ++i)
                for (int64_t g = 0; g < G_; ++g)
                    sc.qp[j * per_head + i * G_ + g] = q_ + spans[i].t * ldq_ + ((it.kvh + j) * G_ + g) * hd_;
        // Scores read in place in short tiles (a decoded token whose KV heads each serve
        // several query heads: 2 keys a tile on the 1.5B) prefetch as they go, each head's
        // tile that head's K and V PREFETCH_AHEAD positions on: the reads spread over the
        // arithmetic instead of coming in bursts (measured: docs/long-context.md, "Measured").
        // Tiles of 16 keys would prefetch 32 row parts at once: they prefetch row by row.
        bool spread = false;
        if constexpr (in_place<E> && !std::is_same_v<K, Portable>)
            spread = K::tile_keys(static_cast<int>(per_head)) <= SPREAD_TILE_KEYS;
        if (spread) convert(kv_.k, ua, ub, sc.v.data(), kp, false);  // in place: buf is not written
        // keys SUB at a time, so their float copies stay in L1 while every head scores them
        for (int u = ua; u < ub; u += SUB) {
            const int w = std::min(ub, u + SUB);
            if (!spread) convert(kv_.k, u, w, sc.k.data(), kp, true);
            for (int64_t j = 0; j < nkv; ++j) {
                const float* const* q = sc.qp.data() + j * per_head;
                float* s = sc.s.data() + j * per_head * lds_;
                auto ahead = [&, j](int a, int b) {
                    for (int x = a; x < b; ++x) prefetch_row({kv_.k, kv_.v}, it, c * CHUNK + x + PREFETCH_AHEAD, j, 1);
                };
                if (spread) K::scores(q, static_cast<int>(per_head), kp + j * CHUNK, u, w, hd_, r_.scale, s, lds_, ahead);
                else K::scores(q, static_cast<int>(per_head), kp + j * CHUNK, u, w, hd_, r_.scale, s, lds_);
            }
        }
        for (int64_t j = 0; j < nkv; ++j) {
            const int64_t h = it.kvh + j, base = j * per_head;
            for (size_t i = 0; i < n; ++i) {
                const Span& sp = spans[i];
                for (int64_t g = 0; g < G_; ++g) {
                    const int64_t qi = base + i * G_ + g, head = h * G_ + g;
                    float* s = sc.s.data() + qi * lds_;
                    float* p = sc.p.data() + qi * lds_;
                    if (r_.softcap > 0.f)
                        for (int x = sp.a; x < sp.b; ++x) s[x] = softcapped(s[x], r_.softcap);
                    const float m = K::max_of(s, sp.a, sp.b);
                    const float l = K::exp_sum(s, p, sp.a, sp.b, m, kv_.type == KvType::BF16);
                    sc.pp[qi] = p;
                    const int64_t state = sp.t * r_.n_heads + head;
                    if (stored) {
                        sc.op[qi] = split_.keep(it, c, sp.t, j * G_ + g, m, l);
                        sc.folds[qi] = {Merge::FIRST, 1.f};
                    } else {
                        bool started = started_[state];
                        sc.folds[qi] = fold(m, l, state_m_[state], state_l_[state], started);
                        started_[state] = started;
                        sc.op[qi] = r_.out + sp.t * r_.ldo + head * hd_;
                    }
                }
            }
        }
        convert(kv_.v, ua, ub, sc.v.data(), vp, !spread);
        for (int64_t j = 0; j < nkv; ++j)
            for (size_t i = 0; i < n; ++i) {
                const int64_t at = j * per_head + i * G_;
                K::values(sc.pp.data() + at, G_, vp + j * CHUNK, spans[i].a, spans[i].b, hd_,
                          sc.op.data() + at, sc.folds.data() + at);
            }
    }

    // The kept partials, folded in order after the chunks the first parts folded as they went.
    void fold_partials(const std::vector<Item>& items) {
        split_.for_each_kept(items, [&](int64_t t, int64_t head, float m, float l, const float* o) {
            const int64_t state = t * r_.n_heads + head;
            bool started = started_[state];
            const Fold f = fold(m, l, state_m_[state], state_l_[state], started);
            started_[state] = started;
            merge_values(r_.out + t * r_.ldo + head * hd_, o, hd_, f);
        });
    }

    void normalize() {
        for (int64_t t = 0; t < r_.T; ++t)
            for (int64_t h = 0; h < r_.n_heads; ++h) {
                const float inv = 1.f / state_l_[t * r_.n_heads + h];
                float* o = r_.out + t * r_.ldo + h * hd_;
                for (int64_t d = 0; d < hd_; ++d) o[d] *= inv;
            }
    }
};

// Whether a bfloat16 pool's decoded tokens use AVX512_BF16's dot products (-1: not decided
// yet): where the CPU has them, unless EMBER_BF16_DOTS=0; set_bf16_dots for tests.
std::atomic<int> bf16_dots_choice{-1};

bool cpu_has_bf16_dots() {
#ifdef EMBER_ATTENTION_AVX512
    return __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
}

bool bf16_dots() {
    int on = bf16_dots_choice.load(std::memory_order_relaxed);
    if (on < 0) {
        const char* env = std::getenv("EMBER_BF16_DOTS");
        on = cpu_has_bf16_dots() && !(env && std::string(env) == "0");
        bf16_dots_choice.store(on, std::memory_order_relaxed);
    }
    return on;
}

// The path block_matmul runs (its CPU path, EMBER_CPU_PATH) picks the kernels here too;
// head dims that are not a multiple of 16 take the portable code (the same arithmetic).
void dispatch(const Rows& rows, const KvPools& pools) {
    const std::string path = cpu_path();
    const bool vectors = pools.head_dim % LANES == 0;
#ifdef EMBER_ATTENTION_AVX512
    if (vectors && path == "avx512" && pools.type == KvType::BF16 && bf16_dots())
        return Attention<Avx512Bf16Dots>(rows, pools).run();
    if (vectors && path == "avx512") return Attention<SimdKernels<Avx512>>(rows, pools).run();
#endif
#ifdef EMBER_ATTENTION_AVX2
    if (vectors && (path == "avx2" || path == "avx512")) return Attention<SimdKernels<Avx2>>(rows, pools).run();
#endif
    Attention<Portable>(rows, pools).run();
}

}  // namespace

void set_first_part_chunks(int64_t chunks) { first_part_chunks.store(chunks); }

bool set_bf16_dots(bool on) {
    TORCH_CHECK_VALUE(!on || cpu_has_bf16_dots(), "bfloat16 dot products need AVX512_BF16, which this CPU lacks");
    const bool before = bf16_dots();
    bf16_dots_choice.store(on);
    return before;
}

void attend_rows(const Rows& rows, const KvPools& pools) {
    TORCH_CHECK(pools.n_kv > 0 && rows.n_heads % pools.n_kv == 0, rows.n_heads,
                " query heads do not group over ", pools.n_kv, " KV heads");
    for (int64_t t = 0; t < rows.T; ++t)
        TORCH_CHECK(rows.n[t] > 0 && rows.pos[t] - rows.n[t] + 1 >= 0,
                    "row ", t, " must see at least one key, at positions >= 0 (", rows.n[t],
                    " keys ending at position ", rows.pos[t], ")");
    if (rows.T > 0) dispatch(rows, pools);
}

}  // namespace ember_attention
