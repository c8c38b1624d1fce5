"""One rank of the mismatched-collective test: ranks call different collectives (or the same
with different sizes) on gradsync groups and report the exceptions they get.

Prints one JSON line: ``{"rank": r, "<case>": {"type": ..., "message": ...} | null}``. The
default group is Gloo, so that a broken gradsync group cannot stop the report.
"""

import datetime
import json
import os

import torch
import torch.distributed as dist

import gradsync.distributed  # noqa: F401  (registers the backend)


def outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported
        return {"type": type(e).__name__, "module": type(e).__module__, "message": str(e)}
    return None


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group(backend="gradsync") for _ in range(3)]
    report = {"rank": rank}

    # rank 0 all-reduces while the others broadcast from rank 0
    def different_collectives():
        t = torch.ones(8)
        if rank == 0:
            dist.all_reduce(t, group=groups[0])
        else:
            dist.broadcast(t, 0, group=groups[0])

    report["different_collectives"] = outcome(different_collectives)

    # the same all-reduce with a different element count on the last rank
    last = dist.get_world_size() - 1

    def different_counts():
        dist.all_reduce(torch.ones(16 + (rank == last)), group=groups[1])

    report["different_counts"] = outcome(different_counts)

    # asynchronously: the error comes out of the work's future as well
    def through_future():
        t = torch.ones(4)
        op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
        dist.all_reduce(t, op=op, group=groups[2], async_op=True).get_future().wait()

    report["through_future"] = outcome(through_future)

    # Both ranks send 16 MiB before they receive: more than gradsync buffers, so each send
    # waits for the other's receive until the group's timeout (4 s here), then fails.
    timeout_var = os.environ.pop("GRADSYNC_TIMEOUT", None)
    slow = dist.new_group(backend="gradsync", timeout=datetime.timedelta(seconds=4))
    peer = rank ^ 1

    def blocking_large_exchange():
        if peer < dist.get_world_size():
            dist.send(torch.ones(4 << 20), peer, group=slow)
            dist.recv(torch.empty(4 << 20), peer, group=slow)

    report["blocking_large_exchange"] = outcome(blocking_large_exchange)
    if timeout_var is not None:
        os.environ["GRADSYNC_TIMEOUT"] = timeout_var

    dist.barrier()  # Gloo
    print("@@result@@ " + json.dumps(report), flush=True)
    # The gradsync groups are broken; leave without waiting on them.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
