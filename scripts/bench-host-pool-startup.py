#!/usr/bin/env python3
"""Times a worker's start with a host pool of its own (the host backend's
zeroed allocation) and with a shared host region (vLLM's replicated MLA
layout: a file on /dev/shm every worker maps, its pages allocated when
mapped), first and second mapper, in one run; prints each time and its
ratio to the pool of its own.

Run with the kvoffload package importable (scripts/test-python.sh installs
it into the cached vLLM venv):
    PY=$(scripts/setup-vllm.sh)
    $PY scripts/bench-host-pool-startup.py [GiB ...]    (default: 1 4)
"""

import ctypes
import os
import sys
import time

import kvoffload._native as native

BLOCK = 1 << 20  # bytes of one block (one layer)


def start(chunks: int, region: str | None) -> tuple[float, object]:
    """Seconds to build a host worker of `chunks` one-block chunks."""
    cache = (ctypes.c_uint8 * (4 * BLOCK))()
    tensors = [(ctypes.addressof(cache), BLOCK, BLOCK)]
    extra = {"shared_region": region} if region else {}
    t = time.perf_counter()
    worker = native.WorkerCore.host(tensors, 4, 1, chunks, False, **extra)
    return time.perf_counter() - t, (worker, cache)


def main() -> int:
    sizes = [float(a) for a in sys.argv[1:]] or [1.0, 4.0]
    region = f"/dev/shm/kvoffload-startup-bench-{os.getpid()}.mmap"
    print(f"{'pool':>8}  {'own pool':>10}  {'shared, 1st':>16}  {'shared, 2nd':>16}")
    for gib in sizes:
        chunks = int(gib * (1 << 30)) // BLOCK
        own, kept = start(chunks, None)
        del kept
        first, kept_first = start(chunks, region)
        second, kept_second = start(chunks, region)
        kept_first[0].unlink_shared_region()
        del kept_first, kept_second
        print(f"{gib:>6.1f}G  {own:>9.2f}s  {first:>7.2f}s ({first / own:4.2f}x)  "
              f"{second:>7.2f}s ({second / own:4.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
