"""Generic checks of one config field (each raises ValueError naming the field, its
value and the fix), frozen copies of sections, and importing a config file."""

from __future__ import annotations

import importlib.util
import math
import operator
import os
from collections.abc import Mapping
from typing import Any

import ml_collections


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """`value` as a Python int if it is an integer >= `minimum`, else a ValueError.

    The one check of a count or size given to kvlab (config fields, function
    arguments): Python and numpy integers pass; bools, floats, strings and
    anything below `minimum` are refused with the field's name and the fix.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name}={value!r} is not an integer: pass an integer >= {minimum}")
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"{name}={value!r} is below {minimum}: pass an integer >= {minimum}")
    return number


def fail(field: str, value: Any, problem: str, fix: str) -> None:
    """Raises ValueError "<field>=<value> <problem>: <fix>", kvlab's form of a config error."""
    raise ValueError(f"{field}={value!r} {problem}: {fix}")


def check_known_fields(section: str, given: Mapping, schema: Mapping) -> None:
    """Refuses a field of `given` the schema lacks, and one of the schema `given` lacks."""
    for key in given:
        if key not in schema:
            raise ValueError(
                f"{section}.{key} is not a kvlab config field: remove it or use one of "
                f"{', '.join(sorted(schema))}"
            )
    for key in schema:
        if key not in given:
            raise ValueError(
                f"{section}.{key} is missing: validate the whole config with "
                "kvlab.validate_config (it fills omitted fields from base_config), or start "
                "it from kvlab.config.base_config(variant)"
            )


def check_int(section: str, cfg: Mapping, name: str, minimum: int = 1) -> None:
    """A plain Python int >= `minimum` (bools and numpy ints are refused)."""
    value = cfg[name]
    if not isinstance(value, int):  # a config stores plain ints (numpy ints do not serialise)
        fail(f"{section}.{name}", value, "is not an integer", f"set an integer >= {minimum}")
    check_count(f"{section}.{name}", value, minimum)


def check_number(section: str, cfg: Mapping, name: str, zero_allowed: bool = False) -> None:
    """A finite real number > 0 (>= 0 with `zero_allowed`): NaN and infinity are refused,
    as they would turn every weight or every loss into NaN."""
    value = cfg[name]
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        bound = ">= 0" if zero_allowed else "> 0"
        fail(f"{section}.{name}", value, f"is not a finite number {bound}", f"set one {bound}")


def check_choice(section: str, cfg: Mapping, name: str, choices: tuple) -> None:
    """One of `choices`, of the same type (True is not 1)."""
    value = cfg[name]
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        listed = ", ".join(repr(c) for c in choices)
        fail(f"{section}.{name}", value, "is not supported", f"use one of {listed}")


def frozen(section: Mapping) -> ml_collections.FrozenConfigDict:
    """An immutable, hashable copy of a config section (modules hold these)."""
    if isinstance(section, ml_collections.FrozenConfigDict):
        return section
    return ml_collections.FrozenConfigDict(section)


def import_config_file(path: str):
    """The config file as a module: its `get_config(arg)`, and for sweeps `get_grid(cfg)`."""
    if not os.path.isfile(path):
        raise ValueError(
            f"config file {path!r} does not exist: give a path such as configs/gqa.py:tiny"
        )
    name = "kvlab_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} has no get_config(arg) function: add one")
    return module
