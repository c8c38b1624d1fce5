"""A pytest plugin: under CI (``GRADSYNC_CI=1``, set by ``.ci/run``) a skipped test fails the run.

Elsewhere a skip only prints its reason (``-rs``). Loaded by ``conftest.py``.

One exception, because CI machines have no GPU: a test marked ``requires_gpu`` that skips with
a reason starting with :data:`NO_GPU` (what :func:`skip_without_gpu` says) does not fail the
run; the summary lists it as allowed. Such tests run where there is a GPU (and
``scripts/gpu-check.sh`` runs the same checks there). Any other skip of such a test, and a
"no GPU" skip of a test without the mark, still fails a CI run.
"""

import os

import pytest

#: The start of the reason of an allowed skip of a ``requires_gpu`` test.
NO_GPU = "no CUDA GPU"


def _in_ci():
    return os.environ.get("GRADSYNC_CI") == "1"


def skip_without_gpu():
    """Skips the calling test when torch sees no CUDA GPU (with the allowed reason)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{NO_GPU} here (torch.cuda.is_available() is False)")


def _reason(rep):
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    return reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason


def _allowed(rep):
    return "requires_gpu" in rep.keywords and _reason(rep).startswith(NO_GPU)


def pytest_configure(config):
    # Show every skip and its reason in the summary.
    chars = config.option.reportchars or ""
    if "s" not in chars and "a" not in chars and "A" not in chars:
        config.option.reportchars = chars + "s"
    config.addinivalue_line(
        "markers",
        f"requires_gpu: needs a CUDA GPU; under GRADSYNC_CI=1 its skip with a reason starting "
        f"with {NO_GPU!r} is allowed",
    )


def pytest_sessionfinish(session, exitstatus):
    if not _in_ci():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    allowed = [rep for rep in skipped if _allowed(rep)]
    failing = [rep for rep in skipped if not _allowed(rep)]
    if skipped:
        reporter.write_line("")
    for rep in allowed:
        reporter.write_line(f"GRADSYNC_CI=1: {rep.nodeid} was skipped, allowed (requires_gpu): {_reason(rep)}")
    if failing:
        for rep in failing:
            reporter.write_line(f"GRADSYNC_CI=1: {rep.nodeid} was skipped: {_reason(rep)}", red=True)
        reporter.write_line(f"GRADSYNC_CI=1: {len(failing)} skipped test(s) fail this run", red=True)
        session.exitstatus = 1
