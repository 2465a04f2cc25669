"""Mesh tests run real worlds inside a testbed of network namespaces (plait.tools.testbed). They need root
and `ip netns`; elsewhere they are skipped with the reason."""

import pytest

from plait.tools import testbed

REASON = testbed.check_can_build()
PREFIX = "pltest"


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"mesh testbed unavailable: {REASON}")
    for item in items:
        if "tests/mesh/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def ours():
    return [ns for ns in testbed.existing_namespaces() if ns.startswith(PREFIX)]


@pytest.fixture(autouse=True)
def no_namespace_left():
    """Every test must leave no namespace of ours behind, whatever happened."""
    if REASON is None:
        stale = ours()
        for name in {ns.rsplit("-", 1)[0] for ns in stale}:
            testbed.down(name, force=True)
    yield
    if REASON is None:
        left = ours()
        for name in {ns.rsplit("-", 1)[0] for ns in left}:
            testbed.down(name, force=True)
        assert not left, f"namespaces left behind: {left}"
