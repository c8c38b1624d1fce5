"""Under CI (``GRADSYNC_CI=1``) a skipped test fails the pytest run; elsewhere it passes. The one
exception: a test marked ``requires_gpu`` that skips for want of a GPU."""

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


ONE_SKIP = """
import pytest

def test_runs():
    pass

def test_cannot_run_here():
    pytest.skip("no such device here")
"""


def _run(tmp_path, ci, source=ONE_SKIP):
    (tmp_path / "test_one_skip.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GRADSYNC_CI", None)
    if ci:
        env["GRADSYNC_CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "ci_skips", "-p", "no:cacheprovider",
         str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )


def test_a_skip_prints_why_and_passes_outside_ci(tmp_path):
    r = _run(tmp_path, ci=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no such device here" in r.stdout, r.stdout


def test_a_skip_fails_the_run_in_ci(tmp_path):
    r = _run(tmp_path, ci=True)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "test_cannot_run_here was skipped: " in r.stdout, r.stdout
    assert "no such device here" in r.stdout, r.stdout


GPU_SKIPS = """
import pytest
from ci_skips import NO_GPU

@pytest.mark.requires_gpu
def test_needs_a_gpu():
    pytest.skip(NO_GPU + " here")
{more}
"""


def test_a_gpu_test_skipped_for_want_of_a_gpu_is_allowed_in_ci(tmp_path):
    r = _run(tmp_path, ci=True, source=GPU_SKIPS.format(more=""))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_needs_a_gpu was skipped, allowed (requires_gpu): no CUDA GPU here" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "more",
    [
        # marked, but skipped for another reason
        "@pytest.mark.requires_gpu\ndef test_other_reason():\n    pytest.skip('no dataset')\n",
        # the reason, without the mark
        "def test_unmarked():\n    pytest.skip(NO_GPU + ' here')\n",
    ],
    ids=["marked-other-reason", "unmarked-no-gpu"],
)
def test_other_skips_still_fail_in_ci(tmp_path, more):
    r = _run(tmp_path, ci=True, source=GPU_SKIPS.format(more=more))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "1 skipped test(s) fail this run" in r.stdout, r.stdout
