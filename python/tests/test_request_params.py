"""kvoffload's reading of a request's ``kv_transfer_params`` against vLLM
0.33.0's own: its ``_parse_tier_filter`` (the ``kv_load_tiers`` filter, every
medium and locality asked) and its ``RequestOffloadState`` (the token
limits), over valid, odd and invalid inputs."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from kvoffload.request_params import REMOTE_TIER, RequestParams, parse_load_tiers, parse_request_params
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    RequestOffloadState,
    _parse_tier_filter,
)
from vllm.v1.kv_offload.base import Locality, Medium

ENTRIES = [
    {},
    {"medium": "cpu"},
    {"medium": "CPU", "locality": "remote"},
    {"medium": "storage"},
    {"locality": "local"},
    {"locality": "Remote"},
    {"medium": "tape"},
    {"locality": "moon"},
    {"medium": 3},
    {"medium": None, "locality": None},
    {"medium": b"cpu"},
    "cpu",
    7,
    None,
]
TIERS = [(m, loc) for m in (None, Medium.CPU, Medium.STORAGE) for loc in (None, Locality.LOCAL, Locality.REMOTE)]


def _both_allow(raw) -> list[tuple[bool, bool]]:
    ours = parse_load_tiers(raw)
    theirs = _parse_tier_filter(raw)
    p = RequestParams(load_tiers=ours)
    out = []
    for m, loc in TIERS:
        want = theirs.allows(m, loc)
        # ``None`` (an unknown medium or locality) matches any matcher, as vLLM.
        got = any(
            (mm is None or m is None or mm == m.value) and (ll is None or loc is None or ll == loc.value)
            for mm, ll in ours
        ) if ours is not None else True
        out.append((got, want))
        if m is not None and loc is not None:
            assert p.allows(m.value, loc.value) == want, (raw, m, loc)
    return out


@pytest.mark.parametrize("raw", ["all", None, 3, {"medium": "cpu"}, [], [None], [{"medium": "tape"}]])
def test_odd_filters_read_as_vllm_reads_them(raw):
    for got, want in _both_allow(raw):
        assert got == want, raw


def test_random_filters_read_as_vllm_reads_them():
    rng = random.Random(5)
    for _ in range(400):
        raw = [rng.choice(ENTRIES) for _ in range(rng.randrange(0, 4))]
        for got, want in _both_allow(raw):
            assert got == want, raw


def test_the_remote_tier_is_left_out_only_by_a_filter_that_excludes_it():
    assert parse_request_params({"kv_load_tiers": [{"locality": "local"}]}).skips_remote_tier
    assert parse_request_params({"kv_load_tiers": []}).skips_remote_tier
    assert not parse_request_params({"kv_load_tiers": [{"medium": "cpu"}]}).skips_remote_tier
    assert not parse_request_params({"kv_load_tiers": "all"}).skips_remote_tier
    assert not parse_request_params({}).skips_remote_tier
    assert REMOTE_TIER == (Medium.CPU.value, Locality.REMOTE.value)


VALUES = [0, 1, 16, 17, -1, -16, True, False, 8.0, "8", None, [8], 2**40]


@pytest.mark.parametrize("load,offload", list(itertools.product(VALUES, VALUES[:6])))
def test_token_limits_read_as_vllm_reads_them(load, offload):
    params = {"max_load_tokens": load, "max_offload_tokens": offload}
    req = SimpleNamespace(kv_transfer_params=params, request_id="r")
    theirs = RequestOffloadState.__new__(RequestOffloadState)
    theirs.req = req
    theirs.config = SimpleNamespace(kv_group_configs=())
    theirs.max_load_tokens = None
    theirs.max_offload_tokens = None
    theirs.__post_init__()
    ours = parse_request_params(params)
    assert (ours.max_load_tokens, ours.max_offload_tokens) == (theirs.max_load_tokens, theirs.max_offload_tokens)


def test_params_that_are_not_a_dict_are_ignored():
    assert parse_request_params(None).is_default
    assert parse_request_params([("max_load_tokens", 4)]).is_default
    assert parse_request_params({"kv_load_tiers": None}).is_default
