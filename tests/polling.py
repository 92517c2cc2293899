"""Waiting, in a test, for another thread to reach a state."""

import time


def wait_until(cond, timeout: float = 5.0) -> None:
    """Poll `cond` every millisecond until it holds; fail the test if it does not within `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cond()
