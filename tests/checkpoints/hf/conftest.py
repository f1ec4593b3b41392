"""The fixture the tests of kvlab/checkpoints/hf/ share: each checkpoint loaded once."""

import pytest

import kvlab
from tests.checkpoints.hf.helpers import FIXTURES


@pytest.fixture(scope="module")
def loaded():
    """load_hf of each fixture, once per module (lazily)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = kvlab.load_hf(FIXTURES / name)
        return cache[name]

    return get
