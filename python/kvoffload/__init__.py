"""kvoffload: a KV-cache offload engine (control plane and data plane in
Rust) for LLM serving backends.

- ``kvoffload.SchedulerCore``: the control plane (lookup, loads, stores,
  fences, preemption flush, reset, stall watchdog and quarantine).
- ``kvoffload.WorkerCore``: one worker's data plane (``WorkerCore.host`` over
  CPU tensors, ``WorkerCore.cuda`` over CUDA tensors and a pinned pool).
- ``kvoffload.vllm.KvOffloadConnector``: a vLLM 0.33 KV connector built on
  both (``kv_connector_module_path="kvoffload.vllm"``).
"""

from kvoffload._native import SchedulerCore, WorkerCore, __version__, chunk_key

__all__ = ["SchedulerCore", "WorkerCore", "__version__", "chunk_key"]
