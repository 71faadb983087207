// Runs a copy kernel's grid on the host (see cuda_host.h): every CTA, every
// thread, one after the other. Built and loaded by tests/kernel_emulation.rs.

#include "cuda_host.h"

#include "../copy_blocks.cu"

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// Launches `kernel` (0 kv_gather, 1 kv_scatter: `arg` is the descriptor
// count; 2 kv_gather_table, 3 kv_scatter_table: `arg` is the table's
// capacity) on a grid of `ctas` CTAs of `threads` threads. `order` 0 runs
// the threads in launch order; otherwise CTAs run last first and each CTA's
// threads in a shuffled order, so a kernel that relied on the order shows.
// Returns 0, or -1 for an unknown kernel or a shape the GPU would refuse.
extern "C" int kvemu_launch(int kernel, const void* table, uint32_t arg, unsigned ctas, unsigned threads,
                            unsigned order) {
    void (*f)(const CopyDesc*, uint32_t);
    switch (kernel) {
        case 0: f = kv_gather; break;
        case 1: f = kv_scatter; break;
        case 2: f = kv_gather_table; break;
        case 3: f = kv_scatter_table; break;
        default: return -1;
    }
    if (ctas == 0 || threads == 0 || threads > 256 || threads % 32 != 0) return -1;
    gridDim = dim3{ctas, 1, 1};
    blockDim = dim3{threads, 1, 1};
    for (unsigned bi = 0; bi < ctas; ++bi) {
        const unsigned b = order ? ctas - 1 - bi : bi;
        for (unsigned ti = 0; ti < threads; ++ti) {
            // 37 is prime and threads <= 256: a permutation of 0..threads.
            const unsigned t = order ? (ti * 37u + order) % threads : ti;
            blockIdx = dim3{b, 0, 0};
            threadIdx = dim3{t, 0, 0};
            f(static_cast<const CopyDesc*>(table), arg);
        }
    }
    return 0;
}
