"""A request's ``kv_transfer_params`` as vLLM 0.33.0's ``OffloadingConnector``
reads them: ``max_load_tokens`` and ``max_offload_tokens`` (non-negative
ints, anything else is ignored with a warning) and ``kv_load_tiers`` (a list
of ``{"medium": ..., "locality": ...}`` matchers naming the secondary tiers a
request may load from; invalid entries are skipped, a list of only invalid
entries allows every tier, an empty list allows none).

kvoffload has one secondary tier, the remote store (``remote_tier``): memory
on other machines, so medium ``CPU``, locality ``REMOTE``. As in vLLM, the
filter never applies to the host tier itself (vLLM's primary tier).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: vLLM's ``Medium`` and ``Locality`` values (matched case-insensitively).
MEDIA = ("CPU", "STORAGE")
LOCALITIES = ("LOCAL", "REMOTE")
#: What the remote tier is, in those terms.
REMOTE_TIER = ("CPU", "REMOTE")

#: A matcher: ``(medium, locality)``, ``None`` matching anything.
Matcher = tuple["str | None", "str | None"]


@dataclass(frozen=True)
class RequestParams:
    """The limits a request's ``kv_transfer_params`` set (``None``: no limit)."""

    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    #: The ``kv_load_tiers`` matchers; ``None`` allows every tier.
    load_tiers: tuple[Matcher, ...] | None = None

    def allows(self, medium: str, locality: str) -> bool:
        """Whether the request may load from a tier of this medium and
        locality (vLLM's ``TierFilter.allows``)."""
        if self.load_tiers is None:
            return True
        return any(
            (m is None or m == medium) and (loc is None or loc == locality) for m, loc in self.load_tiers
        )

    @property
    def skips_remote_tier(self) -> bool:
        """Whether its lookups must not ask the remote tier."""
        return not self.allows(*REMOTE_TIER)

    @property
    def is_default(self) -> bool:
        """Whether nothing is limited (the core needs no call)."""
        return self == RequestParams()


def _token_limit(params: dict, name: str) -> int | None:
    raw = params.get(name)
    # ``type(raw) is int``, as vLLM: a bool or a float is not a limit.
    if type(raw) is int and raw >= 0:
        return raw
    if raw is not None:
        logger.warning("%s must be a non-negative int, got %r; ignoring", name, raw)
    return None


def _enum_value(raw: Any, allowed: tuple[str, ...]) -> str | None:
    """vLLM's ``Enum(raw.upper())``: the value, or ``None`` when invalid."""
    try:
        value = raw.upper()
    except AttributeError:
        return None
    return value if isinstance(value, str) and value in allowed else None


def _matcher_field(entry: dict, name: str, allowed: tuple[str, ...]) -> tuple[bool, str | None]:
    """One matcher field: ``(valid, value)``, ``None`` matching anything; an
    unknown value makes the entry invalid (skipped, with a warning)."""
    raw = entry.get(name)
    if raw is None:
        return True, None
    value = _enum_value(raw, allowed)
    if value is None:
        logger.warning("kv_load_tiers: unknown %s %r; skipping entry", name, raw)
        return False, None
    return True, value


def parse_load_tiers(raw: Any) -> tuple[Matcher, ...] | None:
    """``kv_load_tiers`` as vLLM's ``_parse_tier_filter`` reads it; ``None``
    allows every tier."""
    if not isinstance(raw, list):
        logger.warning("kv_load_tiers: expected list, got %s; ignoring", type(raw).__name__)
        return None
    matchers: list[Matcher] = []
    for entry in raw:
        if not isinstance(entry, dict):
            logger.warning("kv_load_tiers: entry is not a dict; skipping")
            continue
        fields = [_matcher_field(entry, name, allowed) for name, allowed in (("medium", MEDIA), ("locality", LOCALITIES))]
        if all(ok for ok, _ in fields):
            matchers.append((fields[0][1], fields[1][1]))
    if not matchers:
        # An empty list asks for no tier; a list of only invalid entries is ignored.
        return () if not raw else None
    return tuple(matchers)


def parse_request_params(params: dict | None) -> RequestParams:
    """A request's limits from its ``kv_transfer_params`` (``None``: none)."""
    if not params:
        return RequestParams()
    if not isinstance(params, dict):
        logger.warning("kv_transfer_params must be a dict, got %s; ignoring", type(params).__name__)
        return RequestParams()
    raw_tiers = params.get("kv_load_tiers")
    return RequestParams(
        max_load_tokens=_token_limit(params, "max_load_tokens"),
        max_offload_tokens=_token_limit(params, "max_offload_tokens"),
        load_tiers=None if raw_tiers is None else parse_load_tiers(raw_tiers),
    )
