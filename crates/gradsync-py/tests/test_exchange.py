"""All-to-all(v), native gather and scatter, and the in-place all-gather and reduce-scatter,
on 1 to 4 ranks (separate processes)."""

import pytest

from spawn_ranks import run_ranks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_gather_scatter_and_in_place(world):
    results = run_ranks(world, "exchange_programs:exchange", timeout=240)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        assert r["runs"] == 6 * 4
