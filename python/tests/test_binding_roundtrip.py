"""The binding's store-wipe-load round trip without vLLM (binding_roundtrip.py):
on the host backend always; on the CUDA backend where a driver and a device
are present (elsewhere it shows as skipped, with the reason)."""

import pytest

import binding_roundtrip as rt


def test_round_trip_on_the_host_backend():
    out = rt.roundtrip("host")
    assert out["backend"] == "host"
    assert out["jobs_left"] == 0


def test_a_sync_load_is_back_when_start_transfers_returns():
    out = rt.roundtrip("host", sync=True)
    assert out["sync"] and out["jobs_left"] == 0


@pytest.mark.parametrize("sync", [False, True])
def test_two_workers_over_one_shared_region_both_get_the_bytes_back(tmp_path, sync):
    # The second worker never copies a store and its KV starts empty: its
    # bytes come back from what the first wrote into the shared region.
    region = tmp_path / "region.mmap"
    out = rt.roundtrip("host", sync=sync, shared_region=str(region))
    assert out["workers"] == 2 and out["jobs_left"] == 0
    assert not region.exists(), "the name goes once both mapped it"
    assert out["stored"] == [out["bytes"], 0]


@pytest.mark.parametrize("sync", [False, True])
def test_two_workers_writing_a_shared_region_by_turns_each_load_the_other_s_chunks(tmp_path, sync):
    out = rt.roundtrip("host", sync=sync, shared_region=str(tmp_path / "region.mmap"), turns=True)
    assert out["workers"] == 2 and out["jobs_left"] == 0
    assert all(out["stored"]) and sum(out["stored"]) == out["bytes"], out


def test_round_trip_on_the_cuda_backend():
    try:
        out = rt.roundtrip("cuda")
    except rt.Unavailable as e:
        pytest.skip(f"not run: no CUDA device here ({e})")
    except RuntimeError as e:
        if "driver" in str(e).lower() or "device" in str(e).lower():
            pytest.skip(f"not run: no CUDA device here ({e})")
        raise
    assert out["backend"] == "cuda"
    assert out["jobs_left"] == 0
