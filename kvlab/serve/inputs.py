"""What a caller gives the engine and the scheduler, checked before anything runs:
token ids, one prompt, a list of prompts.

    check_requests([[1, 2, 3], np.array([4, 5])], vocab_size=256) -> [[1, 2, 3], [4, 5]]

Each returns plain Python ints or raises a ValueError naming the argument, the
value and the fix: ids are never rounded (3.0 is refused), bools and strings
are not ids, an array must have the rank asked for and an integer dtype.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

MAX_TOKEN_ID = 2**31 - 1  # token ids are fed as int32


def check_token_id(name: str, value: object, vocab_size: int | None = None) -> int:
    """`value` as a Python int if it is an integer token id, else a ValueError.

    Python and numpy integers pass; bools, floats (even 3.0: an id is never
    rounded), strings and lists are refused, and so is an id outside
    0..vocab_size-1 (0..2**31-1 without a vocabulary).
    """
    token = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            token = operator.index(value)
        except TypeError:
            pass
    if token is None:
        raise ValueError(
            f"{name}={value!r} is not an integer token id: pass ints or a numpy integer array "
            "(token ids are never rounded)"
        )
    top = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    if not 0 <= token <= top:
        raise ValueError(f"{name}={token} is outside the vocabulary: pass ids in 0..{top}")
    return token


def check_tokens(name: str, tokens: object, vocab_size: int | None = None) -> list[int]:
    """A prompt (a sequence of token ids or a 1-D integer array) as Python ints.

    A ValueError names `name` and the fix for anything else: an empty prompt, a
    float, bool or string id, a nested list, an array of another rank or dtype.
    """
    if hasattr(tokens, "__array__"):
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(
                f"{name} has shape {array.shape}: pass one prompt as a 1-D array of token ids"
            )
        if array.dtype.kind not in "iu":
            raise ValueError(
                f"{name} has dtype {array.dtype}: pass an integer array of token ids "
                "(token ids are never rounded)"
            )
        tokens = array.tolist()
    elif isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(
            f"{name}={tokens!r} is not a list of token ids: pass each prompt as a list of ints "
            "or a 1-D integer array ([prompt] for a single prompt)"
        )
    if len(tokens) == 0:
        raise ValueError(f"{name} is empty: every request needs at least one prompt token")
    return [check_token_id(f"{name}[{j}]", t, vocab_size) for j, t in enumerate(tokens)]


def check_requests(requests: object, vocab_size: int | None = None) -> list[list[int]]:
    """Prompts (a sequence of prompts, or a 2-D integer array with one per row)
    as lists of Python ints; a ValueError naming requests[i] for a bad one."""
    if hasattr(requests, "__array__"):
        array = np.asarray(requests)
        if array.ndim != 2:
            raise ValueError(
                f"requests has shape {array.shape}: pass a 2-D array [requests, prompt tokens] "
                "or a list of prompts ([prompt] for a single prompt)"
            )
        requests = list(array)
    elif isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise ValueError(
            f"requests={requests!r} is not a list of prompts: pass a list of token lists "
            "or a 2-D integer array"
        )
    if len(requests) == 0:
        raise ValueError("requests is empty: pass a list of token lists")
    return [check_tokens(f"requests[{i}]", r, vocab_size) for i, r in enumerate(requests)]
