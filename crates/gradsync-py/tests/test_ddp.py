"""An unmodified DistributedDataParallel model trained on the "gradsync" backend (and on Gloo with
gradsync's communication hook) follows single-process full-batch training: examples/ddp_train.py,
20 steps, on 2 and 4 processes, every rank's parameters identical and within 1e-5 of the
reference (losses too); runs with a tiny DDP bucket, so that several gradient all-reduces are in
flight at once; and the issue's acceptance test, the example under torchrun on gradsync and on
Gloo giving the same losses."""

import importlib.util
import json
import os
import re
import shutil
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gradsync.distributed")

from ddp_helpers import launch  # noqa: E402

EXAMPLE = launch.EXAMPLES / "ddp_train.py"
STEPS, SEED, BATCH, LR = 20, 0, 32, 0.05
ARGS = ["--steps", STEPS, "--seed", SEED, "--batch", BATCH, "--lr", LR]
# DDP's buckets of 0.0001 MiB (104 bytes): the model's six parameter tensors (1732 float32) go in
# five buckets, all-reduced as their gradients become ready.
SMALL_BUCKETS = ["--bucket-cap-mb", 0.0001]
TOL = 1e-5
STEP_LINE = re.compile(r"^(?:\[0\] )?step (\d+) loss (\S+)$")


def load_example():
    spec = importlib.util.spec_from_file_location("ddp_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EX = load_example()


def losses_of(stdout):
    """The per-step losses rank 0 printed."""
    found = [STEP_LINE.match(line.strip()) for line in stdout.splitlines()]
    steps = [(int(m.group(1)), float(m.group(2))) for m in found if m]
    assert [s for s, _ in steps] == list(range(STEPS)), stdout
    return [loss for _, loss in steps]


def runs_of(out, world):
    """Every rank's JSON of a run written with ``--out out``, by rank."""
    runs = []
    for rank in range(world):
        path = EX.rank_out(out, rank)
        assert os.path.exists(path), f"rank {rank} wrote no {path}"
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def max_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    """One process, full batches."""
    torch.set_num_threads(1)
    return EX.train_reference(STEPS, SEED, BATCH, LR)


def direct(tmp_path, world, *extra):
    """The example on ``world`` processes started directly; rank 0's losses and every rank's
    JSON."""
    out = tmp_path / f"run{world}.json"
    outs = launch.run_ranks(EXAMPLE, world, [*ARGS, *extra, "--out", out], timeout=150)
    return losses_of(outs[0]), runs_of(out, world)


@pytest.fixture(scope="module")
def torchrun4(tmp_path_factory):
    """``torchrun --nproc-per-node 4 examples/ddp_train.py --backend B`` for gradsync and gloo."""
    runs = {}
    for backend in ("gradsync", "gloo"):
        out = tmp_path_factory.mktemp(backend) / "run.json"
        args = ["--backend", backend, *ARGS, "--out", out]
        try:
            stdout = launch.run_torchrun(EXAMPLE, 4, args, timeout=180)
        except AssertionError as e:
            # Gloo's own run (gradsync is not imported) now and then aborts in its teardown,
            # after the job printed everything: "terminate called without an active
            # exception" from a rank's exit. That says nothing of gradsync: run the reference
            # again, once, and say so. gradsync's run gets no second try.
            if backend != "gloo" or GLOO_EXIT_ABORT not in str(e) or " steps in " not in str(e):
                raise
            warnings.warn(f"Gloo's reference run aborted at exit; running it again: {GLOO_EXIT_ABORT}")
            stdout = launch.run_torchrun(EXAMPLE, 4, args, timeout=180)
        runs[backend] = (losses_of(stdout), runs_of(out, 4))
    return runs


# What a Gloo rank prints when it aborts at exit (std::terminate).
GLOO_EXIT_ABORT = "terminate called without an active exception"


def assert_matches_reference(losses, runs, reference, world):
    """Rank 0's printed losses and every rank's run against the reference; every rank ends with
    the same parameters."""
    assert len(runs) == world
    for rank, run in enumerate(runs):
        assert (run["rank"], run["world_size"]) == (rank, world), (run["rank"], run["world_size"])
        assert max_diff(run["losses"], reference["losses"]) <= TOL, (rank, run["losses"])
        assert max_diff(run["params"], reference["params"]) <= TOL, f"rank {rank}'s parameters"
        assert run["params"] == runs[0]["params"], f"rank {rank}'s parameters differ from rank 0's"
    assert max_diff(losses, reference["losses"]) <= TOL, (losses, reference["losses"])
    # the model did learn something, so the comparison is not between two idle models
    assert reference["losses"][-1] < reference["losses"][0] - 0.2, reference["losses"]


def assert_several_buckets(runs):
    for rank, run in enumerate(runs):
        assert len(run["buckets"]) >= 3, f"rank {rank}: DDP's buckets {run['buckets']}"


def test_two_ranks_match_single_process_training(tmp_path, reference):
    losses, runs = direct(tmp_path, 2, "--backend", "gradsync")
    assert runs[0]["backend"] == "gradsync"
    assert_matches_reference(losses, runs, reference, 2)


def test_four_ranks_with_small_buckets_match_single_process_training(tmp_path, reference):
    """Several gradient buckets: several all-reduces queued during backward."""
    losses, runs = direct(tmp_path, 4, "--backend", "gradsync", *SMALL_BUCKETS)
    assert runs[0]["backend"] == "gradsync"
    assert_several_buckets(runs)
    assert_matches_reference(losses, runs, reference, 4)


def test_four_ranks_under_torchrun_match_single_process_training(torchrun4, reference):
    losses, runs = torchrun4["gradsync"]
    assert runs[0]["backend"] == "gradsync"
    assert_matches_reference(losses, runs, reference, 4)


def test_torchrun_example_gives_the_same_losses_on_gradsync_and_gloo(torchrun4, reference):
    """The acceptance test of the issue."""
    (g_losses, g_runs), (l_losses, l_runs) = torchrun4["gradsync"], torchrun4["gloo"]
    assert l_runs[0]["backend"] == "gloo"
    assert max_diff(g_losses, l_losses) <= TOL, (g_losses, l_losses)
    assert max_diff(g_runs[0]["params"], l_runs[0]["params"]) <= TOL
    assert_matches_reference(l_losses, l_runs, reference, 4)


def test_gloo_group_with_gradsync_hook_matches_single_process_training(tmp_path, reference):
    losses, runs = direct(tmp_path, 2, "--hook", *SMALL_BUCKETS)
    assert runs[0]["backend"] == "gloo+hook"
    assert_several_buckets(runs)
    assert_matches_reference(losses, runs, reference, 2)


def gradsync_cli():
    """The repository's gradsync binary (release, then debug build), else one on PATH."""
    for profile in ("release", "debug"):
        exe = launch.REPO / "target" / profile / "gradsync"
        if exe.exists():
            return str(exe)
    return shutil.which("gradsync")


def test_example_under_gradsync_launch(tmp_path, reference):
    exe = gradsync_cli()
    if exe is None:
        pytest.skip("no gradsync binary (cargo build --release -p gradsync-cli)")
    import subprocess
    import sys

    out = tmp_path / "launch.json"
    cmd = [exe, "launch", "--nproc", "2", "--", sys.executable, str(EXAMPLE), "--backend", "gradsync"]
    cmd += [*map(str, ARGS), "--out", str(out)]
    env = launch.job_env()
    env.pop("GRADSYNC_TOKEN")  # the launcher makes one
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150, cwd=os.getcwd())
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    assert_matches_reference(losses_of(p.stdout), runs_of(out, 2), reference, 2)
