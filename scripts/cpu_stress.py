"""`--stress K` for the widening scripts: K busy processes beside the run.

Races between kvoffload's copy threads and the fake model's writes (the
harness settles which step a job ends in, not the order between a copy and
the next step's writes) showed only when both cores were busy: the fence
bug of e656a0d was found that way. K processes that spin at normal
priority take the CPU from the copy threads at arbitrary points, so such
races show up on any machine.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator


@contextlib.contextmanager
def busy(k: int) -> Iterator[None]:
    """K spinning processes for the duration of the block, stopped after it
    (also when it raises)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
