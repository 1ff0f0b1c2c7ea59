"""Fixtures of the replay tests."""

import pytest


@pytest.fixture
def closing():
    """Register things (sockets, publishers, subscribers) to close when the test ends, last first."""
    things = []
    yield things.append
    for thing in reversed(things):
        thing.close()
