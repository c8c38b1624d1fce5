"""A pytest plugin: under CI (``GRADSYNC_CI=1``, set by ``.ci/run``) a skipped test fails the run.

Elsewhere a skip only prints its reason (``-rs``). Loaded by ``conftest.py``.
"""

import os


def _in_ci():
    return os.environ.get("GRADSYNC_CI") == "1"


def pytest_configure(config):
    # Show every skip and its reason in the summary.
    chars = config.option.reportchars or ""
    if "s" not in chars and "a" not in chars and "A" not in chars:
        config.option.reportchars = chars + "s"


def pytest_sessionfinish(session, exitstatus):
    if not _in_ci():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        for rep in skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr
            reporter.write_line(f"GRADSYNC_CI=1: {rep.nodeid} was skipped: {reason}", red=True)
        reporter.write_line(f"GRADSYNC_CI=1: {len(skipped)} skipped test(s) fail this run", red=True)
        session.exitstatus = 1
