"""torch.distributed on gradsync against Gloo, in the same processes: DDP, FSDP2 (``fully_shard``
per layer and at the root, AdamW, also with bfloat16 parameters), HSDP on a 2x2 DeviceMesh,
ZeroRedundancyOptimizer with ``consolidate_state_dict``, the object collectives, subgroups of 2
of 3 ranks, all-to-all (even, uneven, MoE routing, tensor lists), ``batch_isend_irecv``,
reduce-scatter and all-gather into tensors in bfloat16 in place and not, gather, scatter, the
bitwise reductions, the staging pipeline of CUDA tensors run on CPU tensors, and clear errors for
misuse. Each check compares gradsync's results with Gloo's within 1e-5 (see
ddp_helpers/matrix_worker.py); one job per world size runs every check of that size."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("gradsync.distributed")

from ddp_helpers import launch  # noqa: E402
from ddp_helpers.matrix_worker import CHECKS  # noqa: E402

MARK = "@@result@@ "


def results_of(outs):
    res = []
    for r, out in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        assert lines, f"rank {r} printed no result:\n{out}"
        res.append(json.loads(lines[-1][len(MARK) :]))
    return res


@pytest.fixture(scope="module")
def jobs():
    """Runs every check of matrix_worker.py for a world size, in one job per size, when first
    asked. Staged operations run in chunks of 64 bytes, 2 at a time, so that small tensors take
    many chunks."""
    done = {}

    def results(world):
        if world not in done:
            env = {"GRADSYNC_TIMEOUT": "30", "GRADSYNC_STAGING_CHUNK": "64", "GRADSYNC_STAGING_DEPTH": "2"}
            outs = launch.run_ranks(launch.HERE / "matrix_worker.py", world, timeout=400, env=env)
            done[world] = results_of(outs)
        return done[world]

    return results


CASES = sorted(((w, name) for name, (_, worlds) in CHECKS.items() for w in worlds), key=lambda c: c[0])


@pytest.mark.parametrize("world,check", CASES, ids=[f"{w}ranks-{c}" for w, c in CASES])
def test_gradsync_matches_gloo(jobs, world, check):
    results = jobs(world)
    assert len(results) == world
    for rank, res in enumerate(results):
        assert check in res["results"], f"rank {rank} did not run {check}"
        assert res["results"][check] == "ok", f"rank {rank}:\n{res['results'][check]}"
    # every rank compared something (a check that compared nothing proves nothing)
    assert all(res["compared"][check] > 0 for res in results), [res["compared"][check] for res in results]
