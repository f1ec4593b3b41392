"""The checks of what a caller gives the engine and the scheduler
(kvlab/serve/inputs.py): token ids, prompts, lists of prompts."""

import numpy as np
import pytest

from kvlab.serve.inputs import check_requests, check_tokens


@pytest.mark.parametrize(
    "tokens",
    [[3, 1], (3, 1), [np.int64(3), np.uint8(1)], np.array([3, 1]), np.array([3, 1], np.uint16)],
    ids=["list", "tuple", "numpy_ints", "int_array", "uint16_array"],
)
def test_integer_prompts_pass_as_python_ints(tokens):
    checked = check_tokens("prompt", tokens, vocab_size=4)
    assert checked == [3, 1] and all(type(t) is int for t in checked)


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([3.0], r"prompt\[0\]=3.0 is not an integer token id"),
        ([3.7], r"prompt\[0\]=3.7 is not an integer token id"),
        (["3"], r"prompt\[0\]='3' is not an integer token id"),
        ([True], r"prompt\[0\]=True is not an integer token id"),
        ([np.True_], r"prompt\[0\]=np.True_ is not an integer token id"),
        ([[1, 2]], r"prompt\[0\]=\[1, 2\] is not an integer token id"),
        ([np.array([1, 2])], r"prompt\[0\]=array\(\[1, 2\]\) is not an integer token id"),
        (np.array([1.0, 2.0]), "prompt has dtype float64: pass an integer array"),
        (np.array([True]), "prompt has dtype bool"),
        (np.array([[1, 2]]), r"prompt has shape \(1, 2\)"),
        ([], "prompt is empty"),
        ("abc", "prompt='abc' is not a list of token ids"),
        (3, "prompt=3 is not a list of token ids"),
        ([1, 4], r"prompt\[1\]=4 is outside the vocabulary: pass ids in 0..3"),
        ([-1], r"prompt\[0\]=-1 is outside the vocabulary"),
    ],
)
def test_bad_prompts_are_refused_never_rounded(tokens, message):
    with pytest.raises(ValueError, match=message):
        check_tokens("prompt", tokens, vocab_size=4)


def test_requests_as_a_2d_array_or_a_list_of_arrays():
    expected = [[1, 2], [3, 0]]
    assert check_requests(np.array(expected, np.int32), 4) == expected
    assert check_requests([np.array(row) for row in expected], 4) == expected
    for bad, message in [
        (np.array([1, 2]), r"requests has shape \(2,\)"),
        ([1, 2], r"requests\[0\]=1 is not a list of token ids: .*\[prompt\] for a single prompt"),
        ([], "requests is empty"),
        (np.zeros((0, 3), np.int32), "requests is empty"),
        ("ab", "requests='ab' is not a list of prompts"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_requests(bad, 4)
