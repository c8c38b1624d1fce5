"""Under CI (``GRADSYNC_CI=1``) a skipped test fails the pytest run; elsewhere it passes."""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tmp_path, ci):
    (tmp_path / "test_one_skip.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_runs():
                pass

            def test_cannot_run_here():
                pytest.skip("no such device here")
            """
        )
    )
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
