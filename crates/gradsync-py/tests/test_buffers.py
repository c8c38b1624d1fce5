"""What gradsync accepts as a buffer, and what writing a torch tensor tells autograd."""

import numpy as np
import pytest


class BorrowedInterface:
    """Exposes the array interface of a temporary array that nothing keeps alive."""

    @property
    def __array_interface__(self):
        return np.ones(65536).__array_interface__


class OverridingSubclass(np.ndarray):
    """An ndarray whose ``__array_interface__`` describes another (temporary) array."""

    @property
    def __array_interface__(self):
        return np.ones(len(self), dtype=self.dtype).__array_interface__


def test_an_object_with_only_an_array_interface_is_refused(comm):
    obj = BorrowedInterface()
    for call in (lambda: comm.all_reduce(obj), lambda: comm.all_reduce_async(obj),
                 lambda: comm.broadcast(obj)):
        with pytest.raises(TypeError, match=r"^rank 0: \w+: buf: expected a numpy array or a "
                                            r"CPU torch tensor, got BorrowedInterface$"):
            call()
    with pytest.raises(TypeError, match=r"rank 0: all_gather: output: .*got BorrowedInterface"):
        comm.all_gather(np.ones(65536), obj)


def test_an_ndarray_subclass_is_used_through_its_own_memory(comm):
    out = np.zeros(4, dtype=np.float64).view(OverridingSubclass)
    comm.all_gather(np.arange(4, dtype=np.float64), out)
    assert np.array_equal(np.asarray(out.view(np.ndarray)), [0, 1, 2, 3])


def test_masked_arrays_are_refused(comm):
    m = np.ma.array(np.ones(4, dtype=np.float32), mask=[0, 1, 0, 0])
    with pytest.raises(TypeError, match=r"rank 0: all_reduce: buf: masked arrays are not supported"):
        comm.all_reduce(m)


def test_writes_bump_the_version_of_written_tensors_only(comm):
    torch = pytest.importorskip("torch")
    x = torch.ones(4)
    v = x._version
    comm.all_reduce(x)
    assert x._version > v
    v = x._version
    comm.all_reduce_async(x).wait()
    assert x._version > v
    v = x._version
    comm.broadcast(x)
    assert x._version > v
    inp, out = torch.ones(4), torch.zeros(4)
    vi, vo = inp._version, out._version
    comm.all_gather(inp, out)
    assert inp._version == vi and out._version > vo
    vi, vo = inp._version, out._version
    comm.reduce_scatter(inp, out)
    assert inp._version == vi and out._version > vo
    vi, vo = inp._version, out._version
    comm.reduce(inp, out)
    assert inp._version == vi and out._version > vo
    # bfloat16 (used as int16) and parameters too
    b = torch.ones(3, dtype=torch.bfloat16)
    v = b._version
    comm.all_reduce(b)
    assert b._version > v
    p = torch.nn.Parameter(torch.ones(3))
    v = p._version
    comm.all_reduce(p)
    assert p._version > v
    # a refused call does not bump
    v = x._version
    with pytest.raises(ValueError):
        comm.all_reduce(x, op="median")
    assert x._version == v


def test_autograd_notices_a_saved_tensor_that_was_written(comm):
    torch = pytest.importorskip("torch")
    a = torch.ones(3, requires_grad=True)
    b = a * 2
    loss = (b * b).sum()  # saves b for backward
    comm.all_reduce(b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inference_tensors_are_written_without_a_version(comm):
    torch = pytest.importorskip("torch")
    with torch.inference_mode():
        t = torch.ones(3)
    comm.all_reduce(t, op="avg")
    assert torch.equal(t, torch.ones(3))
