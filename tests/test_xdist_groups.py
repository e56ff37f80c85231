"""The suite's guard for pytest-xdist's `--dist loadgroup` (tests/conftest.py): a test marked ``xdist_group`` whose
node id does not carry its group (pytest-xdist#1386) fails, naming why, instead of running on a second worker."""

from types import SimpleNamespace

import pytest

from tests import conftest


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return self.marks.get(name)


def items_of(loadgroup: bool) -> tuple[SimpleNamespace, list[Item]]:
    config = SimpleNamespace(option=SimpleNamespace(loadgroup=loadgroup), stash=pytest.Stash())
    group = pytest.mark.xdist_group("ray_cluster").mark
    items = [Item(nodeid="t.py::grouped@ray_cluster", marks={"xdist_group": group}, config=config),
             Item(nodeid="t.py::lost_its_group", marks={"xdist_group": group}, config=config),
             Item(nodeid="t.py::plain", marks={}, config=config)]
    conftest.pytest_collection_modifyitems(config, items)
    return config, items


def test_a_grouped_test_without_its_group_fails_naming_the_cause():
    _, (grouped, lost, plain) = items_of(loadgroup=True)
    conftest.pytest_runtest_setup(grouped)
    conftest.pytest_runtest_setup(plain)
    with pytest.raises(pytest.fail.Exception, match=r"did not keep this test's xdist_group on one worker.*#1386"):
        conftest.pytest_runtest_setup(lost)


def test_without_loadgroup_nothing_is_asked():
    _, items = items_of(loadgroup=False)
    for item in items:
        conftest.pytest_runtest_setup(item)
