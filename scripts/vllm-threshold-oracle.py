#!/usr/bin/env python3
"""vLLM 0.33.0's answers for host-tier traces run with the reuse filter
(`store_threshold` >= 2, `max_tracker_size`), which the oracle's
`vllm_manager_oracle.py` does not configure.

For every NAME.trace.jsonl of SRC it replays the trace on vLLM's
`CPUOffloadingManager(store_threshold=T, max_tracker_size=K)` (through the
oracle's own `ManagerOracle`, with only the manager replaced) and, when vLLM
accepts every operation, writes the trace with `store_threshold` and
`max_tracker_size` added to its header, and vLLM's answers, into DST. Traces
with an operation vLLM rejects under the filter (a load of a key the filter
kept out, say) are skipped.

Usage (vLLM's venv; see ../shared/oracle/setup-vllm.sh):
    $PY scripts/vllm-threshold-oracle.py SRC DST T K [--oracle ../shared/oracle]
"""

import argparse
import glob
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("threshold", type=int)
    ap.add_argument("tracker", type=int)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--oracle", default=os.path.join(here, "..", "..", "shared", "oracle"))
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.oracle))
    import vllm_manager_oracle as vmo  # noqa: E402  (imports vLLM lazily)

    os.makedirs(args.dst, exist_ok=True)
    written = 0
    for path in sorted(glob.glob(os.path.join(args.src, "*.trace.jsonl"))):
        lines = open(path).read().splitlines()
        header = json.loads(lines[0])
        cfg = vmo.parse_header(lines[0])
        oracle = vmo.ManagerOracle(cfg)
        oracle.mgr = vmo._vllm()["CPUOffloadingManager"](
            num_chunks=cfg["num_cpu_chunks"],
            cache_policy=cfg["eviction_policy"],
            enable_events=True,
            store_threshold=args.threshold,
            max_tracker_size=args.tracker,
        )
        outs = []
        try:
            for i, text in enumerate(lines[1:], start=2):
                outs.append(oracle.apply(i, json.loads(text)))
        except vmo.TraceError:
            continue
        name = os.path.basename(path)[: -len(".trace.jsonl")]
        header["config"]["store_threshold"] = args.threshold
        header["config"]["max_tracker_size"] = args.tracker
        with open(os.path.join(args.dst, name + ".trace.jsonl"), "w") as f:
            f.write(json.dumps(header) + "\n" + "\n".join(lines[1:]) + "\n")
        with open(os.path.join(args.dst, name + ".expected.jsonl"), "w") as f:
            f.write("".join(vmo.dumps(o) + "\n" for o in outs))
        written += 1
    print(f"{written} traces written to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
