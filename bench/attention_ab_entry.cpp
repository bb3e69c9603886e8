// attention_ab.cpp's way into one build of the kernel: attend_A, or with -DENTRY_B (and the
// tree compiled into namespace ember_attention_B) attend_B. Rows and pools pass as void*: the
// two builds' types have the same layout under different names.
#include <cstdlib>
#include <string>

#include "attention.h"

#ifdef ENTRY_B
void attend_B(const void* rows, const void* pools) {
#else
// ops.h: the path block_matmul would run; EMBER_CPU_PATH=avx2 (or portable) picks another
std::string cpu_path() {
    const char* path = std::getenv("EMBER_CPU_PATH");
    return path && *path ? path : "avx512";
}
void attend_A(const void* rows, const void* pools) {
#endif
    ember_attention::attend_rows(*static_cast<const ember_attention::Rows*>(rows),
                                 *static_cast<const ember_attention::KvPools*>(pools));
}
