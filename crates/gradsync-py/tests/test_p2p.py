"""send and recv: blocking, and matched in order between two ranks (as the README says)."""

import re

from spawn_ranks import run_ranks


def test_send_waits_for_a_late_receiver_only_when_large_and_order_matters():
    r0, r1 = run_ranks(2, "rank_programs:p2p_semantics", timeout=60,
                       env={"GRADSYNC_TIMEOUT": "20"})
    assert r1["small"] and r1["large"], r1
    # 4 KiB fits the receive slots: the send returns before rank 1 calls recv ...
    assert r0["small"] < 0.5, r0
    # ... 8 MiB does not: the send returns only once rank 1 (a second late) receives it
    assert r0["large"] > 0.8, r0
    # both sending first: each recv (the pair's call k + 1) meets the peer's send (call k), at
    # once: GradsyncError on both ranks
    for r in (r0, r1):
        e = r["both_send_first"]
        m = re.search(r"runs send_recv seq (\d+) .* but rank \d sent send_recv seq (\d+)", e or "")
        assert m and int(m.group(1)) == int(m.group(2)) + 1, r
