// Software prefetch into L2 that the optimizer keeps. GCC (12) deletes a loop whose body is
// only __builtin_prefetch as a loop without effects (the kernels' prefetch loops compiled to
// nothing until this was found), so on x86 the instruction is written out.
#pragma once

#include <cstdint>

namespace ember_prefetch {

inline void line_l2(const void* p) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
    asm volatile("prfm pldl2keep, [%0]" : : "r"(p));
#else  // elsewhere a loop of these may compile to nothing
    __builtin_prefetch(p, 0, 2);
#endif
}

// The cache lines of p[0..n).
inline void lines_l2(const void* p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) line_l2(static_cast<const char*>(p) + o);
}

}  // namespace ember_prefetch
