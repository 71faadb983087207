// Lets the copy kernels (kernels/copy_blocks.cu) compile as host C++, so that
// tests/kernel_emulation.rs can run their code on a machine without a GPU.
//
// The kernels use no shared memory, no barriers and no warp intrinsics: every
// thread works on its own bytes, so running a grid's threads one after the
// other computes what the GPU computes. What this cannot show is anything the
// GPU adds: the memory model, the cache hints, speed. The hints become plain
// loads and stores here.
#pragma once

#include <stdint.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct uint4 {
    unsigned int x, y, z, w;
};

struct dim3 {
    unsigned int x, y, z;
};

// The running thread's coordinates, set by the launcher (launch.cpp); one
// set per host thread, so that tests may launch from several threads at once.
extern thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// Streaming load and store (`.cs`): plain accesses on the host.
template <class T>
inline T __ldcs(const T* p) {
    return *p;
}

template <class T>
inline void __stcs(T* p, T v) {
    *p = v;
}
