"""Errors arrive as Python exceptions that name the operation, the rank and the sizes."""

import numpy as np
import pytest

import gradsync
from spawn_ranks import free_port, run_ranks


@pytest.mark.parametrize("kind", ["count", "collective"])
def test_mismatched_collective_raises_gradsync_error_naming_both_ranks(kind):
    # rank 0 all_reduce of 10 elements vs rank 1 of 11; or all_reduce vs broadcast
    results = run_ranks(2, "rank_programs:mismatch", {"kind": kind}, timeout=60,
                        env={"GRADSYNC_TIMEOUT": "10"})
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} raised nothing"
        assert r["type"] == "GradsyncError" and r["runtime"], r
    # the rank that detects the mismatch names both ranks and both calls
    both = [r["error"] for r in results if "rank 0" in r["error"] and "rank 1" in r["error"]]
    assert both, [r["error"] for r in results]
    if kind == "collective":
        assert any("broadcast" in m and "all_reduce" in m for m in both), both


def test_one_rank_collectives_in_process(comm):
    a = np.arange(5, dtype=np.float32)
    comm.all_reduce(a, op="avg")
    assert np.array_equal(a, np.arange(5))
    out = np.zeros(5, dtype=np.float32)
    comm.all_gather(a, out)
    assert np.array_equal(out, a)
    assert comm.world_size == 1 and comm.rank == 0 and isinstance(comm.transport, str)


@pytest.mark.parametrize("dtype", ["int16", "int8", "uint16", "complex64", "bool", "object", ">f4"])
def test_unsupported_dtype_is_a_type_error(comm, dtype):
    a = np.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match=r"rank 0: all_reduce: buf: dtype .* is not supported"):
        comm.all_reduce(a)


def test_not_an_array(comm):
    for obj in ([1.0, 2.0], None, 3.0, b"abcd"):
        with pytest.raises(TypeError, match="expected a numpy array or a CPU torch tensor"):
            comm.all_reduce(obj)


def test_non_contiguous_is_a_value_error(comm):
    a = np.zeros((4, 6), dtype=np.float32)
    with pytest.raises(ValueError, match=r"all_reduce: buf: .*not C-contiguous"):
        comm.all_reduce(a[:, ::2])
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce(a.T)
    with pytest.raises(ValueError, match=r"all_gather: input: .*not C-contiguous"):
        comm.all_gather(a[::2, 0], np.zeros(2, dtype=np.float32))


def test_read_only_output_is_a_value_error(comm):
    a = np.zeros(4, dtype=np.float32)
    a.flags.writeable = False
    with pytest.raises(ValueError, match=r"rank 0: all_reduce: buf: .*read-only"):
        comm.all_reduce(a)
    with pytest.raises(ValueError, match=r"broadcast: buf: .*read-only"):
        comm.broadcast(a)
    with pytest.raises(ValueError, match=r"all_gather: output: .*read-only"):
        comm.all_gather(np.zeros(4, dtype=np.float32), a)
    # a read-only input is fine
    out = np.zeros(4, dtype=np.float32)
    comm.all_gather(a, out)
    comm.reduce(a, out, op="max", root=0)


def test_wrong_sizes_and_types_name_the_sizes(comm):
    f = np.zeros(6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"rank 0: reduce_scatter: input has 6 elements but must have world size 1 x output's 4 = 4"):
        comm.reduce_scatter(f, np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"rank 0: all_gather: output has 5 elements but must have world size 1 x input's 6 = 6"):
        comm.all_gather(f, np.zeros(5, dtype=np.float32))
    with pytest.raises(TypeError, match=r"rank 0: all_gather: input is float32 but output is float64"):
        comm.all_gather(f, np.zeros(6, dtype=np.float64))
    with pytest.raises(ValueError, match=r"rank 0: reduce: input has 6 elements but the root's output has 3"):
        comm.reduce(f, np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"reduce: the root \(rank 0\) needs an output"):
        comm.reduce(f, None)
    with pytest.raises(ValueError, match="share memory, but the input is not block 0 of the output"):
        comm.all_gather(f[1:], f[:5])  # overlapping, shifted: not the in-place form


def test_bad_op_root_peer(comm):
    a = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match=r"rank 0: all_reduce: unknown op \"median\" \(expected one of sum, prod, min, max, avg, band, bor, bxor\)"):
        comm.all_reduce(a, op="median")
    with pytest.raises(ValueError, match="root 1 is not a rank of world size 1"):
        comm.broadcast(a, root=1)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        comm.send(a, 0)
    with pytest.raises(OverflowError):
        comm.broadcast(a, root=-1)
    with pytest.raises(ValueError, match="non-negative"):
        comm.all_reduce_async(a).wait(timeout=-1)


def test_torch_tensor_errors(comm):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"all_reduce: buf: tensor of shape .* is not contiguous"):
        comm.all_reduce(torch.zeros(4, 6).t())
    with pytest.raises(TypeError, match=r"tensor is on device meta; gradsync works on CPU tensors"):
        comm.all_reduce(torch.zeros(4, device="meta"))
    with pytest.raises(TypeError, match=r"dtype .*int16.* is not supported"):
        comm.all_reduce(torch.zeros(4, dtype=torch.int16))
    with pytest.raises(TypeError, match="is not supported"):
        comm.all_reduce(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"input is bfloat16 but output is float16"):
        comm.all_gather(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16))
    # numpy and torch buffers mix when the types agree
    out = np.zeros(3, dtype=np.float32)
    comm.all_gather(torch.arange(3, dtype=torch.float32), out)
    assert np.array_equal(out, [0, 1, 2])


def test_closed_communicator_raises():
    c = gradsync.Communicator(f"127.0.0.1:{free_port()}", 0, 1)
    with c:
        c.barrier()
    assert c.closed
    with pytest.raises(gradsync.GradsyncError, match="rank 0: barrier: the communicator is closed"):
        c.barrier()
    with pytest.raises(gradsync.GradsyncError, match="closed"):
        c.all_reduce_async(np.zeros(2, dtype=np.float32))
    c.close()


def test_from_env_without_a_launcher(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(gradsync.GradsyncError, match="no launcher environment"):
        gradsync.Communicator.from_env()


def test_constructor_arguments():
    with pytest.raises(ValueError, match="rank 2 is not within world size 2"):
        gradsync.Communicator("127.0.0.1:1", 2, 2)
    with pytest.raises(ValueError, match="timeout"):
        gradsync.Communicator("127.0.0.1:1", 0, 1, timeout=0)
    with pytest.raises(TypeError):
        gradsync.Communicator("127.0.0.1:1", 0, 1, True)  # host_store is keyword-only
