"""The command line both widening scripts share (`widen-hybrid.py`,
`widen-hybrid-remote.py`): a seed count, `--only S`, `--from SEED` and
`--stress K`, parsed before anything starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Seeds:
    """Which seeds a widening runs, and the configuration each one uses."""

    count: int
    first: int
    base: int

    def seed(self, k: int) -> int:
        """The k-th seed of the run."""
        return self.first + k

    def case_index(self, seed: int, cases: int) -> int:
        """The configuration `seed` uses, out of `cases`: counted from the
        default first seed, so a seed means the same configuration whether a
        run starts there or reaches it from an earlier `--from`."""
        return (seed - self.base) % cases


def parser(doc: str, default_base: int, only_base: int) -> argparse.ArgumentParser:
    """The shared options; the caller adds its own. `default_base` is the
    first seed of a run over every configuration, `only_base` that of a run
    with `--only`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("count", type=_count, help="how many seeds to run")
    p.add_argument("--only", metavar="S", help="only the configurations whose group names contain S")
    p.add_argument(
        "--from",
        dest="first",
        metavar="SEED",
        type=_count,
        help=f"first seed (default {default_base}, {only_base} with --only)",
    )
    p.add_argument("--stress", metavar="K", type=_count, default=0, help="K busy processes beside the run")
    p.set_defaults(default_base=default_base, only_base=only_base)
    return p


def seeds(args: argparse.Namespace) -> Seeds:
    """The seeds the parsed `args` ask for."""
    base = args.default_base if args.only is None else args.only_base
    first = base if args.first is None else args.first
    return Seeds(count=args.count, first=first, base=base)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count")
    return int(text)
