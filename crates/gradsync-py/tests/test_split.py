"""``Communicator.split`` and ``split_ranks`` from Python, on separate processes."""

from spawn_ranks import run_ranks


def test_split_and_members_only_split_then_the_parent():
    world = 4
    results = run_ranks(world, "split_programs:split_and_use", timeout=120)
    for rank, r in enumerate(results):
        errors = r["errors"]
        assert "color -1 is out of range" in errors["negative color"], errors
        assert f"rank {rank} appears twice" in errors["repeated rank"], errors
        assert f"rank {world} of" in errors["outside"], errors
        assert "only the members call it" in errors["not a member"], errors
        assert "timeout must be positive" in errors["zero timeout"], errors
        if rank == world - 1:
            assert r["child"] is None
        else:
            # color = rank % 2 among ranks 0..2, ordered by key = -rank: [2, 0] and [1]
            members = sorted((q for q in range(world - 1) if q % 2 == rank % 2), reverse=True)
            c = r["child"]
            assert (c["rank"], c["world"]) == (members.index(rank), len(members)), c
            assert c["timeout"] == 12.5
            assert c["sum"] == [float(sum(q + 1 for q in members))] * 5, c
            assert c["gathered"] == members, c
        if rank in (0, world - 1):
            m = r["members_only"]
            assert (m["rank"], m["world"]) == ([world - 1, 0].index(rank), 2), m
            assert m["max"] == [world - 1, 10 * (world - 1)], m
        else:
            assert "members_only" not in r
        assert r["parent"] == [world] * 3


def test_a_rank_that_never_splits_fails_the_others_at_the_timeout():
    results = run_ranks(2, "split_programs:never_calls", timeout=60, env={"GRADSYNC_TIMEOUT": "3"})
    r = results[0]
    assert r["error"] is not None, "the split succeeded without rank 1"
    assert "rank 0: split: " in r["error"] and "timed out" in r["error"], r["error"]
    assert "rank 1" in r["error"], r["error"]
    assert r["timeout"] - 0.2 <= r["took"] < r["timeout"] + 5, r

