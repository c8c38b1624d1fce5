"""Every collective x dtype x op on 1 to 4 ranks (separate processes), numpy and torch."""

import pytest

from spawn_ranks import run_ranks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_numpy_reference(world):
    results = run_ranks(world, "rank_programs:collectives", timeout=150)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        # every combination ran: 13 (numpy and torch) dtypes x (5 ops x all_reduce,
        # reduce_scatter, reduce + all_gather + a broadcast per root), then the extra cases
        assert r["count"] == 13 * (5 * 3 + 1 + world) + 3 + (2 if world > 1 else 0)
    assert len({r["count"] for r in results}) == 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_ops_on_integer_arrays(world):
    results = run_ranks(world, "rank_programs:bitwise", timeout=120)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        # 3 integer dtypes x 3 ops x (all_reduce, all_reduce_async, reduce_scatter, reduce)
        assert r["count"] == 3 * 3 * 4
        calls = ["all_reduce", "reduce_scatter", "reduce"]
        assert r["refused"] == [
            f"rank {rank}: {call}: op {op} is bitwise and takes integer buffers only "
            f"(int32, int64, uint8), not {dt}"
            for dt, op in (("float32", "bxor"), ("float64", "band"), ("float16", "bor"))
            for call in calls
        ]


def test_in_place_views_tensors_and_async_in_order():
    results = run_ranks(2, "rank_programs:in_place_and_async", timeout=90)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"


def test_three_ranks_in_place_and_async():
    results = run_ranks(3, "rank_programs:in_place_and_async", timeout=90)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"


def test_gil_is_released_while_a_collective_waits():
    r = run_ranks(2, "rank_programs:gil_released", timeout=60)[0]
    assert r["ok"]
    assert r["waited"] > 0.5, r
    # A thread that could not run while the main thread waits would count nothing; a free one
    # counts millions per second. A generous floor keeps a loaded machine from failing it.
    assert r["ticks"] > 10_000, r
