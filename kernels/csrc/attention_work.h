// How attention.cpp shares its work between threads: work items, the parts a decoded token's
// (or a tree's) context is split into when there are fewer items than threads
// (flash-decoding), and the partials of the chunks those parts do not fold as they go.
//
// A split item's first part folds the chunks it takes from the front into the rows' running
// partials; every other chunk (the other parts', and those a thread with nothing left takes
// from the back of any part) keeps its partial here, folded afterwards in chunk order. So the
// threads finish together even when one runs slower than the other (as this host's do), and
// which thread computed a chunk never changes a bit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace ember_attention {

// One work item: KV heads [kvh, kvh + nkv), rows [t0, t1), chunks [c0, c1). split >= 0: a part
// of a split item (SplitWork); first: its first part.
struct Item {
    int64_t kvh, nkv, t0, t1, c0, c1, split;
    bool first;
};

// A part's chunks not yet taken, [front, back) in one word: the thread that took the part takes
// them from the front, a thread with nothing left from the back.
class ChunkRange {
  public:
    void reset(int64_t front, int64_t back) { word_.store(pack(front, back), std::memory_order_relaxed); }
    int64_t front() const { return word_.load(std::memory_order_relaxed) & 0xffffffffu; }
    int64_t left() const {
        const uint64_t w = word_.load(std::memory_order_relaxed);
        return std::max<int64_t>(0, int64_t(w >> 32) - int64_t(w & 0xffffffffu));
    }
    bool take_front(int64_t& c) { return take(c, true); }
    bool take_back(int64_t& c) { return take(c, false); }

  private:
    std::atomic<uint64_t> word_{0};
    static uint64_t pack(int64_t front, int64_t back) { return uint64_t(back) << 32 | uint32_t(front); }
    bool take(int64_t& c, bool front) {
        uint64_t w = word_.load(std::memory_order_relaxed);
        for (;;) {
            const int64_t f = w & 0xffffffffu, b = w >> 32;
            if (f >= b) return false;
            const uint64_t after = front ? pack(f + 1, b) : pack(f, b - 1);
            if (word_.compare_exchange_weak(w, after, std::memory_order_relaxed)) {
                c = front ? f : b - 1;
                return true;
            }
        }
    }
};

// For tests (set_first_part_chunks): the most chunks a first part folds as it goes (< 0: no
// limit), as if its thread ran slow.
inline std::atomic<int64_t> first_part_chunks{-1};

// Split items' parts: their chunk ranges and kept partials.
class SplitWork {
  public:
    // `base` itself when it has at least `threads` items; else each item's chunks split into
    // parts, about `threads` in all. heads: query heads per row and KV head; hd: head dim.
    std::vector<Item> split(const std::vector<Item>& base, int64_t threads, int64_t heads, int64_t hd) {
        if (static_cast<int64_t>(base.size()) >= threads) return base;
        heads_ = heads, hd_ = hd;
        std::vector<Item> parts;
        for (const Item& it : base) {
            const int64_t chunks = it.c1 - it.c0;
            const int64_t n = std::min(chunks, (threads + (int64_t)base.size() - 1) / (int64_t)base.size());
            for (int64_t p = 0; p < n; ++p) {
                Item part = it;
                part.c0 = it.c0 + chunks * p / n;
                part.c1 = it.c0 + chunks * (p + 1) / n;
                part.split = static_cast<int64_t>(base_.size());
                part.first = p == 0;
                base_.push_back(present_.size());
                present_.resize(present_.size() + (part.c1 - part.c0) * (it.t1 - it.t0) * heads * it.nkv, 0);
                parts.push_back(part);
            }
        }
        ranges_ = std::make_unique<ChunkRange[]>(parts.size());
        for (const Item& it : parts) ranges_[it.split].reset(it.c0, it.c1);
        std::vector<float>& o = store_.o;
        std::vector<float>& ml = store_.ml;
        if (o.size() < present_.size() * hd) o.resize(present_.size() * hd);
        if (ml.size() < present_.size() * 2) ml.resize(present_.size() * 2);
        return parts;
    }

    ChunkRange& range(const Item& it) { return ranges_[it.split]; }

    // Keeps chunk c's partial for row t and query head g of the item's heads: its (m, l) now,
    // its hd values at the pointer returned.
    float* keep(const Item& it, int64_t c, int64_t t, int64_t g, float m, float l) {
        const int64_t i = slot(it, c, t, g);
        present_[i] = 1;
        store_.ml[2 * i] = m, store_.ml[2 * i + 1] = l;
        return store_.o.data() + i * hd_;
    }

    // f(t, head, m, l, values) for each kept partial in fold order: the parts in order, a first
    // part's chunks from where its front stopped (it folded the ones before), each chunk's rows
    // and heads. head counts the query heads of every KV head.
    template <class F>
    void for_each_kept(const std::vector<Item>& items, F&& f) const {
        for (const Item& it : items) {
            if (it.split < 0) continue;
            for (int64_t c = it.first ? ranges_[it.split].front() : it.c0; c < it.c1; ++c)
                for (int64_t t = it.t0; t < it.t1; ++t)
                    for (int64_t g = 0; g < heads_ * it.nkv; ++g) {
                        const int64_t i = slot(it, c, t, g);
                        if (present_[i])
                            f(t, it.kvh * heads_ + g, store_.ml[2 * i], store_.ml[2 * i + 1],
                              store_.o.data() + i * hd_);
                    }
        }
    }

  private:
    // The partials' values and (m, l): the thread's that makes the SplitWork (the caller;
    // its workers write there too), kept between calls (a decoded token makes one a layer),
    // so they are neither allocated nor zeroed each time.
    struct Store {
        std::vector<float> o, ml;
    };
    static Store& callers_store() {
        thread_local Store s;
        return s;
    }

    Store& store_ = callers_store();
    int64_t heads_ = 0, hd_ = 0;
    std::unique_ptr<ChunkRange[]> ranges_;
    std::vector<int64_t> base_;     // per part: its first slot
    std::vector<uint8_t> present_;  // per slot: whether it holds a partial (rows skip chunks)

    int64_t slot(const Item& it, int64_t c, int64_t t, int64_t g) const {
        return base_[it.split] + ((c - it.c0) * (it.t1 - it.t0) + (t - it.t0)) * heads_ * it.nkv + g;
    }
};

}  // namespace ember_attention
