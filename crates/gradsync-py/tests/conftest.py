"""Fixtures shared by the test modules."""

import pytest

import gradsync
from spawn_ranks import free_port

pytest_plugins = ["ci_skips"]


@pytest.fixture(scope="module")
def comm():
    """A one-rank communicator in this process (one per test module)."""
    c = gradsync.Communicator(f"127.0.0.1:{free_port()}", 0, 1, timeout=20)
    yield c
    c.close()
