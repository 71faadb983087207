"""kvoffload: a KV-cache offload engine (control plane and data plane in
Rust) for LLM serving backends.

- ``kvoffload.SchedulerCore``: the control plane (lookup, loads, stores,
  fences, preemption flush, reset, stall watchdog and quarantine).
- ``kvoffload.HostWorkerCore``: one worker's data plane over host memory.
- ``kvoffload.vllm.KvOffloadConnector``: a vLLM 0.33 KV connector built on
  both (``kv_connector_module_path="kvoffload.vllm"``).
"""

from kvoffload._native import HostWorkerCore, SchedulerCore, __version__, chunk_key

__all__ = ["HostWorkerCore", "SchedulerCore", "__version__", "chunk_key"]
