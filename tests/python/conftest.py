"""Fixtures shared by the Python tests."""
import os

import pytest

from fault_proxy import FaultProxy


@pytest.fixture
def fault_proxy():
    """A fault proxy (no rules yet) in front of the loopback S3 server, stopped after the test."""
    upstream = os.environ.get("HSLAKE_TEST_S3_ENDPOINT")
    if not upstream:
        pytest.skip("HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts a loopback S3 server)")
    with FaultProxy(upstream) as proxy:
        yield proxy
