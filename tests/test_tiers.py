"""The fast tier's own machinery (tests/conftest.py): a module whose ``pytestmark`` puts all its tests in a
left-out tier is read, not imported, and only that marker (not a timeout beside it, not a marker of one test)
makes it so."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import module_tiers


@pytest.mark.parametrize(
    ("source", "tiers"),
    [
        ("pytestmark = pytest.mark.e2e\n", {"e2e"}),
        ("pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]\n", {"ray"}),
        ("pytestmark = (pytest.mark.slow, pytest.mark.integration)\n", {"slow", "integration"}),
        ("pytestmark = pytest.mark.timeout(60)\n", set()),
        ("pytestmark = pytest.mark.reference\n", set()),  # a marker, but not a tier
        ("@pytest.mark.slow\ndef test_x():\n    pytestmark = pytest.mark.slow\n", set()),  # one test's: not all
        ("import pytest\n", set()),
    ],
)
def test_a_modules_tier_is_read_from_its_pytestmark(tmp_path, source, tiers):
    path = tmp_path / "test_x.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    assert module_tiers(path) == tiers


def test_the_fast_tier_collects_no_tiered_module(pytestconfig):
    """This run's modules: in the fast tier, none whose every test is tiered was imported."""
    import sys

    from tests.conftest import FAST_TIER

    if not pytestconfig.stash.get(FAST_TIER, False):
        pytest.skip("not the fast tier")
    assert "tests.server.test_schema_fuzz" not in sys.modules and "tests.distributed.test_ray_serve" not in sys.modules
