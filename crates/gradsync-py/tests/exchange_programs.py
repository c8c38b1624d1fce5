"""What each rank runs in ``test_exchange.py``: all-to-all(v), gather, scatter and the in-place
all-gather and reduce-scatter, each checked against numpy on every rank."""

import numpy as np

import gradsync


def val(src, dst, n, dtype):
    """Block that rank ``src`` sends rank ``dst``: ``n`` small integers."""
    return ((np.arange(n) * 3 + src * 31 + dst * 7) % 97).astype(dtype)


def vcount(src, dst, base):
    """Uneven all-to-allv counts, some zero."""
    return (src * 3 + dst * 5 + base) % 7 + (0 if (src + dst) % 3 == 0 else base)


def exchange(rank, world, args):
    import torch

    bad = []
    runs = 0
    with gradsync.Communicator.from_env() as comm:
        for dtype in ["float32", "float64", "float16", "int32", "int64", "uint8"]:
            for n in [0, 1, 5, 1000]:
                runs += 1
                # all_to_all, blocking and async
                inp = np.concatenate([val(rank, d, n, dtype) for d in range(world)])
                out = np.zeros(world * n, dtype=dtype)
                comm.all_to_all(inp, out)
                want = np.concatenate([val(s, rank, n, dtype) for s in range(world)])
                if not np.array_equal(out, want):
                    bad.append(f"all_to_all {dtype} n={n}")
                out2 = np.zeros(world * n, dtype=dtype)
                comm.all_to_all_async(inp, out2).wait()
                if not np.array_equal(out2, want):
                    bad.append(f"all_to_all_async {dtype} n={n}")
                # all_to_allv, uneven
                sc = [vcount(rank, d, n) for d in range(world)]
                rc = [vcount(s, rank, n) for s in range(world)]
                inp = np.concatenate([val(rank, d, sc[d], dtype) for d in range(world)])
                out = np.zeros(sum(rc), dtype=dtype)
                comm.all_to_allv(inp, sc, out, rc)
                want = np.concatenate([val(s, rank, rc[s], dtype) for s in range(world)])
                if not np.array_equal(out, want):
                    bad.append(f"all_to_allv {dtype} n={n} {sc} {rc}")
                # gather and scatter from every root
                for root in range(world):
                    mine = val(rank, 0, n, dtype)
                    out = np.zeros(world * n, dtype=dtype) if rank == root else None
                    comm.gather(mine, out, root)
                    if rank == root:
                        want = np.concatenate([val(s, 0, n, dtype) for s in range(world)])
                        if not np.array_equal(out, want):
                            bad.append(f"gather {dtype} n={n} root {root}")
                    whole = (
                        np.concatenate([val(root, d, n, dtype) for d in range(world)])
                        if rank == root
                        else None
                    )
                    part = np.zeros(n, dtype=dtype)
                    comm.scatter_async(whole, part, root).wait()
                    if not np.array_equal(part, val(root, rank, n, dtype)):
                        bad.append(f"scatter {dtype} n={n} root {root}")
                # in-place all_gather: the input is this rank's block of the output
                buf = np.full(world * n, 99, dtype=dtype)
                buf[rank * n:(rank + 1) * n] = val(rank, 0, n, dtype)
                comm.all_gather(buf[rank * n:(rank + 1) * n], buf)
                want = np.concatenate([val(s, 0, n, dtype) for s in range(world)])
                if not np.array_equal(buf, want):
                    bad.append(f"all_gather in place {dtype} n={n}")
                # in-place reduce_scatter: the output is this rank's block of the input
                orig = np.concatenate([val(rank, d, n, dtype) for d in range(world)])
                buf = orig.copy()
                comm.reduce_scatter(buf, buf[rank * n:(rank + 1) * n], "max")
                want = orig.copy()
                want[rank * n:(rank + 1) * n] = np.max(
                    [val(s, rank, n, dtype) for s in range(world)], axis=0
                ) if n else want[:0]
                if not np.array_equal(buf, want):
                    bad.append(f"reduce_scatter in place {dtype} n={n}")
        # torch bfloat16 in place, as FSDP2 all-gathers (its block of the output as input)
        t = torch.zeros(world * 6, dtype=torch.bfloat16)
        t[rank * 6:(rank + 1) * 6] = float(rank + 1)
        comm.all_gather(t[rank * 6:(rank + 1) * 6], t)
        want = torch.repeat_interleave(torch.arange(1, world + 1, dtype=torch.bfloat16), 6)
        if not torch.equal(t, want):
            bad.append(f"bfloat16 all_gather in place: {t}")
        # any other overlap is refused, saying why
        if world > 1:
            buf = np.zeros(world * 4, dtype=np.float32)
            other = (rank + 1) % world
            for name, call in [
                ("all_gather", lambda: comm.all_gather(buf[other * 4:(other + 1) * 4], buf)),
                ("reduce_scatter", lambda: comm.reduce_scatter(buf, buf[other * 4:(other + 1) * 4])),
                ("all_to_all", lambda: comm.all_to_all(buf, buf)),
            ]:
                try:
                    call()
                    bad.append(f"{name}: an overlap that is not this rank's block was accepted")
                except ValueError as e:
                    if "share memory" not in str(e) or f"rank {rank}" not in str(e):
                        bad.append(f"{name}: unclear error: {e}")
        # counts that do not add up fail the work, naming the call and the sizes
        try:
            comm.all_to_allv(np.zeros(3, dtype=np.float32), [1] * (world + 1), np.zeros(3, dtype=np.float32), [1] * world)
            bad.append("all_to_allv accepted send_counts of the wrong length")
        except gradsync.GradsyncError as e:
            if "send_counts" not in str(e) or "all_to_allv" not in str(e):
                bad.append(f"all_to_allv counts: unclear error: {e}")
        # and the communicator goes on
        x = np.ones(3, dtype=np.float32)
        comm.all_reduce(x)
        if not np.all(x == world):
            bad.append("all_reduce after the refused calls")
    return {"bad": bad, "runs": runs}
