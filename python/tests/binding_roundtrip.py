"""The binding's data path end to end without vLLM (and without PyTorch): a
`SchedulerCore` plans a request's stores, a `WorkerCore` copies its KV blocks
to the host pool, the blocks are wiped, a second request with the same prefix
looks it up, and its load must bring the same bytes back into other blocks.
With `--sync` the load is synchronous (a sync-load budget): the worker waits
for it inside `start_transfers`, so the bytes must be back before any poll.
With `--shared-region` two workers hold the same KV (vLLM's replicated MLA
layout) and map one host region: the first writes the stores, the second
never copies one (its KV memory starts empty), and both must get the bytes
back, the second from what the first wrote. With `--turns` as well, the two
workers write the stores by turns of host chunk (the connector's default for
replicated KV): each copies half the chunks, and each loads the other's half
back from what the other wrote.

It runs on the host backend here (pytest: `test_binding_roundtrip.py`) and,
with `--backend cuda`, on the CUDA backend over device memory allocated
through the CUDA driver with ctypes (`scripts/gpu-check.sh run` carries the
binding and runs it on a GPU machine, where vLLM may not be installable).
Exits 0 when the bytes match, 1 when they do not, 2 when the backend cannot
run here (no driver), printing `SKIP: <reason>` then.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import json
import sys
import time
from typing import Any

import kvoffload._native as native

TOKENS_PER_BLOCK = 16
LAYERS = 4
PAGE = 32 * 1024  # bytes per block and layer
NUM_BLOCKS = 64
PROMPT_BLOCKS = 12


class Unavailable(Exception):
    """The backend cannot run on this machine."""


class HostMemory:
    """KV "device" memory in host RAM (the host backend copies from it)."""

    def __init__(self, size: int) -> None:
        self.buf = (ctypes.c_uint8 * size)()
        self.addr = ctypes.addressof(self.buf)
        self.size = size

    def write(self, data: bytes) -> None:
        ctypes.memmove(self.addr, data, len(data))

    def read(self) -> bytes:
        return bytes(self.buf)


class CudaMemory:
    """Device memory through the CUDA driver API (ctypes), on device 0's
    primary context (the one PyTorch and kvoffload use)."""

    def __init__(self, size: int) -> None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            self.cu = ctypes.CDLL(name)
        except OSError as e:
            raise Unavailable(f"no CUDA driver library ({e})") from None
        self.check(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        ptr = ctypes.c_uint64()
        self.check(self.cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
        self.addr = ptr.value
        self.size = size

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise Unavailable(f"{what} returned CUDA error {rc}")

    def write(self, data: bytes) -> None:
        src = ctypes.create_string_buffer(data, len(data))
        self.check(self.cu.cuMemcpyHtoD_v2(ctypes.c_uint64(self.addr), src, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")

    def read(self) -> bytes:
        dst = ctypes.create_string_buffer(self.size)
        self.check(self.cu.cuMemcpyDtoH_v2(dst, ctypes.c_uint64(self.addr), ctypes.c_size_t(self.size)), "cuMemcpyDtoH")
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")
        return dst.raw


class Request:
    """What the binding reads of vLLM's `Request`."""

    def __init__(self, request_id: str, tokens: int, block_hashes: list[bytes]) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = tokens
        self.num_tokens = tokens
        self.block_hashes = block_hashes


def pattern(layer: int, block: int) -> bytes:
    """The bytes of one block of one layer (distinct everywhere)."""
    seed = hashlib.sha256(f"{layer}:{block}".encode()).digest()
    return (seed * (PAGE // len(seed) + 1))[:PAGE]


#: The plan bytes of the last `step`.
last_plan = b""


class Workers:
    """The engine's workers, driven together as vLLM drives its ranks: each
    step's plan goes to every one, and their reports are summed."""

    def __init__(self, cores: list[Any]) -> None:
        self.cores = cores
        self.backend = cores[0].backend
        #: Store bytes each worker copied.
        self.stored = [0] * len(cores)

    def bind(self, plan: bytes) -> None:
        for c in self.cores:
            c.bind(plan)

    def handle_preemptions(self) -> None:
        for c in self.cores:
            c.handle_preemptions()

    def start_transfers(self) -> None:
        for c in self.cores:
            c.start_transfers()

    def queue_stores(self) -> None:
        for c in self.cores:
            c.queue_stores()

    def get_finished(self) -> tuple[dict[int, int], set[int], Any]:
        completed: dict[int, int] = {}
        failed: set[int] = set()
        for i, c in enumerate(self.cores):
            done, bad, stats = c.get_finished()
            self.stored[i] += stats["store"][0]
            for job, n in done.items():
                completed[job] = completed.get(job, 0) + n
            failed |= set(bad)
        return completed, failed, None


def step(core: Any, worker: Any, scheduled: dict[str, int], new: list, finished: list | None = None) -> tuple:
    plan, load_requests, failed = core.build_step(scheduled, new, [], [], [], set(), [], finished or [])
    worker.bind(plan)
    worker.handle_preemptions()
    worker.start_transfers()
    worker.queue_stores()
    global last_plan
    last_plan = plan
    return native.plan_jobs(plan), load_requests, failed


def wait_done(core: Any, worker: Any, jobs: set[int], timeout_s: float = 30.0) -> None:
    """Polls the worker until `jobs` reported (and tells the scheduler)."""
    deadline = time.monotonic() + timeout_s
    # Each job is done once every worker reported it.
    left = {job: len(worker.cores) for job in jobs}
    while left:
        completed, failed, _ = worker.get_finished()
        if completed or failed:
            core.on_worker_output(completed, sorted(failed))
        bad = set(failed) & set(left)
        if bad:
            raise AssertionError(f"jobs failed: {sorted(bad)}")
        for job, n in completed.items():
            if job in left:
                left[job] -= n
                if left[job] <= 0:
                    del left[job]
        jobs = set(left)
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {sorted(jobs)} did not report in {timeout_s} s")
        time.sleep(0.001)


def wrong_blocks(got: bytes, first: list[int], second: list[int]) -> list[tuple[int, int]]:
    """The (layer, block) of `second` whose bytes are not those of `first`'s block."""
    return [
        (l, b)
        for l in range(LAYERS)
        for i, b in enumerate(second[:PROMPT_BLOCKS])
        if got[(l * NUM_BLOCKS + b) * PAGE:(l * NUM_BLOCKS + b + 1) * PAGE] != pattern(l, first[i])
    ]


def roundtrip(backend: str, strategy_table: str | None = None, sync: bool = False,
              shared_region: str | None = None, turns: bool = False, numa: str = "auto") -> dict[str, Any]:
    """The round trip on `backend`; with `shared_region` (a file path), two
    workers of the same KV over one host region mapped there, the second
    never copying a store, or with `turns` each copying its turn's chunks.
    `numa`: where each worker's host pool goes (``"auto"``, ``"off"`` or a
    NUMA node)."""
    size = LAYERS * NUM_BLOCKS * PAGE
    ranks = 2 if shared_region else 1
    mems = [CudaMemory(size) if backend == "cuda" else HostMemory(size) for _ in range(ranks)]
    cfg = {"tokens_per_block": TOKENS_PER_BLOCK, "blocks_per_chunk": 1, "num_cpu_chunks": 32,
           "offload_prompt_only": True, "world_size": ranks}
    if sync:
        # Room for the whole prefix: its load is synchronous.
        cfg["sync_load_budget_bytes"] = PROMPT_BLOCKS * LAYERS * PAGE
        cfg["sync_load_bytes_per_token"] = LAYERS * PAGE // TOKENS_PER_BLOCK
    core = native.SchedulerCore(json.dumps(cfg), watchdog=False, kv_events=False)
    cores = []
    for rank, mem in enumerate(mems):
        # Layer-outermost, as vLLM's kernel blocks: layer l, block b at (l * NUM_BLOCKS + b) * PAGE.
        tensors = [(mem.addr + l * NUM_BLOCKS * PAGE, PAGE, PAGE) for l in range(LAYERS)]
        shared = {"shared_region": shared_region, "store_writer": rank == 0} if shared_region else {}
        if shared_region and turns:
            shared["store_turn"] = (rank, ranks)
        if backend == "cuda":
            cores.append(native.WorkerCore.cuda(tensors, NUM_BLOCKS, 1, 32, False, 0, 0, strategy_table,
                                                numa=numa, **shared))
        else:
            cores.append(native.WorkerCore.host(tensors, NUM_BLOCKS, 1, 32, False, numa=numa, **shared))
    if shared_region:
        cores[0].unlink_shared_region()
    worker = Workers(cores)
    image = bytearray(size)
    for l in range(LAYERS):
        for b in range(NUM_BLOCKS):
            image[(l * NUM_BLOCKS + b) * PAGE:(l * NUM_BLOCKS + b + 1) * PAGE] = pattern(l, b)
    # With a shared region the second worker's KV starts empty: what it
    # loads back can only come from the first worker's stores. By turns
    # both hold the KV (each writes half of it).
    for mem in mems[: 2 if turns else 1]:
        mem.write(bytes(image))

    tokens = PROMPT_BLOCKS * TOKENS_PER_BLOCK
    hashes = [hashlib.sha256(f"prefix-{i}".encode()).digest() for i in range(PROMPT_BLOCKS)]
    # Block 0 is vLLM's null block: never stored nor loaded.
    first = list(range(1, PROMPT_BLOCKS + 1))
    core.add_request(Request("a", tokens, hashes))
    assert core.lookup("a", 0) == 0
    core.on_alloc("a", first, 0)
    (_, stores, _), _, _ = step(core, worker, {"a": tokens}, [("a", first, 0)])
    assert stores, "the prompt's blocks are stored"
    # Stores are submitted at the next step's start, then polled to the end.
    step(core, worker, {}, [])
    wait_done(core, worker, set(stores))
    core.request_finished("a", first, False, tokens)
    step(core, worker, {}, [], ["a"])

    # Wipe the GPU side, then a second request with the same prefix loads it
    # into other blocks.
    for mem in mems:
        mem.write(bytes(size))
    second = list(range(32, 32 + PROMPT_BLOCKS + 1))
    core.add_request(Request("b", tokens + 1, hashes))
    hit = core.lookup("b", 0)
    assert hit == tokens, f"lookup hit {hit} tokens, {tokens} expected"
    assert core.sync_load_reserved("b") == sync, "a sync load exactly with a budget"
    load = core.on_alloc("b", second, hit)
    assert load is not None, "a load job"
    (loads, _, _), load_requests, _ = step(core, worker, {}, [])
    assert loads == [load] and load_requests == {load: "b"}, (loads, load_requests)
    if sync:
        # The worker waited for it in start_transfers: the bytes are back
        # before any poll, and the plan names it synchronous.
        assert native.plan_sync_loads(last_plan) == [load], "the plan names it synchronous"
        for rank, mem in enumerate(mems):
            early = wrong_blocks(mem.read(), first, second)
            if early:
                raise AssertionError(f"sync load: {len(early)} blocks not back on worker {rank} after start_transfers")
    wait_done(core, worker, {load})
    for rank, mem in enumerate(mems):
        wrong = wrong_blocks(mem.read(), first, second)
        if wrong:
            raise AssertionError(
                f"{len(wrong)} blocks came back wrong on worker {rank}, first (layer, block): {wrong[0]}"
            )
    one_copy = PROMPT_BLOCKS * LAYERS * PAGE
    if sum(worker.stored) != one_copy:
        raise AssertionError(f"the workers stored {worker.stored} bytes, {one_copy} (one copy) expected")
    if turns and not all(worker.stored):
        raise AssertionError(f"by turns every worker copies part of the stores: {worker.stored}")
    state = core.state()
    return {"backend": worker.backend, "sync": sync, "blocks": PROMPT_BLOCKS * LAYERS,
            "bytes": one_copy, "jobs_left": state["jobs"], "workers": ranks, "stored": worker.stored,
            "placement": [c.host_placement for c in cores]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("host", "cuda"), default="host")
    ap.add_argument("--sync", action="store_true",
                    help="a synchronous load (a sync-load budget): the bytes must be back when start_transfers returns")
    ap.add_argument("--strategy-table", metavar="FILE",
                    help="a strategy table for the CUDA worker (kvoffload bench --calibrate's format)")
    ap.add_argument("--shared-region", action="store_true",
                    help="two workers of the same KV over one host region (a file under the temp directory)")
    ap.add_argument("--turns", action="store_true",
                    help="with --shared-region: the workers write the stores by turns of host chunk")
    ap.add_argument("--numa", default="auto", metavar="auto|off|NODE",
                    help="where each worker's host pool goes (default auto: the GPU's NUMA node where there are several)")
    args = ap.parse_args(argv)
    if args.strategy_table and args.backend != "cuda":
        ap.error("--strategy-table goes with --backend cuda")
    if args.turns and not args.shared_region:
        ap.error("--turns goes with --shared-region")
    region = None
    if args.shared_region:
        import os
        import tempfile

        region = os.path.join(tempfile.gettempdir(), f"kvoffload-roundtrip-{os.getpid()}.mmap")
    try:
        out = roundtrip(args.backend, args.strategy_table, args.sync, region, args.turns, args.numa)
    except Unavailable as e:
        print(f"SKIP: binding round trip on {args.backend}: {e}")
        return 2
    except RuntimeError as e:
        if args.backend == "cuda" and "driver" in str(e).lower():
            print(f"SKIP: binding round trip on cuda: {e}")
            return 2
        raise
    except AssertionError as e:
        print(f"FAIL: binding round trip on {args.backend}: {e}")
        return 1
    kind = ("sync load, " if out["sync"] else "") + ("2 workers over one shared region, " if region else "")
    if args.turns:
        kind += f"by turns (store bytes {out['stored']}), "
    print(f"PASS: binding round trip on {out['backend']} ({kind}{out['blocks']} blocks, {out['bytes']} bytes): "
          f"stored, wiped and loaded back equal; jobs left {out['jobs_left']}; "
          f"host pool NUMA placement: {out['placement'][0]['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
