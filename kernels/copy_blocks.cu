// Block gather/scatter between paged GPU KV caches and (mapped, pinned) host chunk rows.
//
// A transfer is a table of descriptors {src, dst, bytes}: one per coalesced run of
// bytes. The same table layout serves both directions; the entry points differ in
// their cache hints:
//   kv_gather  (GPU pages -> host chunks): streaming loads of live KV (.cs), streaming
//              stores to host memory (do not pollute L2 with write-once data);
//   kv_scatter (host chunks -> GPU pages): streaming loads from host, normal stores so
//              that the model's next kernels find the fresh KV in L2.
// One warp owns one descriptor at a time (grid-stride over descriptors by warp), each
// lane keeps UNROLL 16-byte loads in flight before storing. The grid size is the SM
// budget chosen by the host (a few CTAs by default) so copies do not starve compute.

#include <stdint.h>

struct CopyDesc {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long bytes;
};

#define UNROLL 8

// Both directions read with the streaming hint: the source (live KV being
// offloaded, or host rows over the link) is read exactly once.
__device__ __forceinline__ uint4 load16(const uint4* p) { return __ldcs(p); }

template <bool kGather>
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
    if (kGather) {
        __stcs(p, v);
    } else {
        *p = v;
    }
}

// The same hints for 8-byte words (runs aligned to 8 but not to 16).
__device__ __forceinline__ unsigned long long load8(const unsigned long long* p) { return __ldcs(p); }

template <bool kGather>
__device__ __forceinline__ void store8(unsigned long long* p, unsigned long long v) {
    if (kGather) {
        __stcs(p, v);
    } else {
        *p = v;
    }
}

template <bool kGather>
__device__ void copy_one(const CopyDesc d, unsigned lane) {
    const unsigned long long bytes = d.bytes;
    const bool aligned = ((d.src | d.dst) & 15ull) == 0;
    unsigned long long done = 0;
    if (aligned) {
        const uint4* s = reinterpret_cast<const uint4*>(d.src);
        uint4* t = reinterpret_cast<uint4*>(d.dst);
        const unsigned long long n16 = bytes >> 4;
        const unsigned long long step = 32ull * UNROLL;
        unsigned long long i = lane;
        for (; i + 32ull * (UNROLL - 1) < n16; i += step) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = load16(s + i + 32ull * u);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) store16<kGather>(t + i + 32ull * u, v[u]);
        }
        for (; i < n16; i += 32ull) store16<kGather>(t + i, load16(s + i));
        done = n16 << 4;
    } else if (((d.src | d.dst) & 7ull) == 0) {
        // 8-byte aligned (an odd number of 8-byte words before it, say):
        // words, not bytes.
        const unsigned long long* s = reinterpret_cast<const unsigned long long*>(d.src);
        unsigned long long* t = reinterpret_cast<unsigned long long*>(d.dst);
        const unsigned long long n8 = bytes >> 3;
        for (unsigned long long i = lane; i < n8; i += 32ull) store8<kGather>(t + i, load8(s + i));
        done = n8 << 3;
    }
    const unsigned char* sb = reinterpret_cast<const unsigned char*>(d.src);
    unsigned char* tb = reinterpret_cast<unsigned char*>(d.dst);
    for (unsigned long long i = done + lane; i < bytes; i += 32ull) tb[i] = sb[i];
}

template <bool kGather>
__device__ void copy_table(const CopyDesc* __restrict__ descs, uint32_t n) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warps_per_block = blockDim.x >> 5;
    const unsigned long long warp = (unsigned long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5);
    const unsigned long long nwarps = (unsigned long long)gridDim.x * warps_per_block;
    for (unsigned long long k = warp; k < n; k += nwarps) {
        copy_one<kGather>(descs[k], lane);
    }
}

// GPU pages -> host chunk rows.
extern "C" __global__ void __launch_bounds__(256, 1) kv_gather(const CopyDesc* __restrict__ descs, uint32_t n) {
    copy_table<true>(descs, n);
}

// Host chunk rows -> GPU pages.
extern "C" __global__ void __launch_bounds__(256, 1) kv_scatter(const CopyDesc* __restrict__ descs, uint32_t n) {
    copy_table<false>(descs, n);
}

// The plain entry points (a count argument, no table header) are kept for
// tools and direct launches; the backend launches the table variants below.

// Table variants for persistent tables and CUDA graphs: `table[0].bytes` holds the
// descriptor count (written by the same memcpy that refreshes the descriptors), the
// descriptors follow at `table + 1`, and `capacity` bounds the count. A graph
// captured once per capacity therefore replays with any count up to it.
__device__ __forceinline__ uint32_t table_count(const CopyDesc* table, uint32_t capacity) {
    const unsigned long long n = table[0].bytes;
    return n < capacity ? (uint32_t)n : capacity;
}

extern "C" __global__ void __launch_bounds__(256, 1) kv_gather_table(const CopyDesc* __restrict__ table, uint32_t capacity) {
    copy_table<true>(table + 1, table_count(table, capacity));
}

extern "C" __global__ void __launch_bounds__(256, 1) kv_scatter_table(const CopyDesc* __restrict__ table, uint32_t capacity) {
    copy_table<false>(table + 1, table_count(table, capacity));
}
