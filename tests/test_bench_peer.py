"""scripts/bench_peer.py refuses bad flags, and a missing torch, before it starts.

The comparison itself needs torch and transformers (the extra 'peer'), which
are never test dependencies: these run the script where they may be absent.
"""

import importlib.util

import pytest

from tests.test_scripts import run_script, user_error


@pytest.mark.parametrize(
    "flag, words",
    [
        ("--shapes=4M,7B", ["--shapes=4M,7B", "'7B'", "4M, 110M, mla"]),
        ("--batch_sizes=1,x", ["--batch_sizes=1,x", "not a list of integers", "1,8"]),
    ],
)
def test_bad_flags_are_refused_naming_the_flag_and_the_fix(flag, words):
    message = user_error(run_script("scripts/bench_peer.py", flag, check=False))
    for word in words:
        assert word in message


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("transformers") is not None,
    reason="torch and transformers are installed",
)
def test_without_torch_it_says_how_to_install_the_peer_extra():
    result = run_script("scripts/bench_peer.py", "--shapes=4M", "--batch_sizes=1", check=False)
    assert "pip install -e '.[peer]'" in user_error(result)
