"""The sweep's CSVs (kvlab/sweep/tables.py): names stay text and numbers numbers,
a cell that is not its column's type is refused naming it."""

import math
import os
import tempfile

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlab.sweep import (
    COLUMNS,
    SUMMARY_COLUMNS,
    read_csv,
    write_csv,
)

NAMES = st.text(min_size=1)  # any entry name: digits, "nan", "True", "1e5", quotes, newlines


NUMBERS = st.none() | st.integers() | st.floats(allow_nan=False)


def typed(rows):
    """Rows with each value beside its type: 16 and 16.0 and "16" differ."""
    return [{k: (type(v).__name__, v) for k, v in row.items()} for row in rows]


@settings(max_examples=50, deadline=None)
@given(
    names=st.lists(st.tuples(NAMES, NAMES, NAMES), min_size=1, max_size=4),
    numbers=st.lists(st.tuples(NUMBERS, NUMBERS, st.booleans()), min_size=4, max_size=4),
)
@example(
    names=[
        ("1", "nan", "16"),
        ("True", "1e5", "4"),
        ('a,"b"', "x\ny\r", "K4V4 ü 量"),
        ("-0", " ", "inf"),
    ],
    numbers=[(0, 1.0, True), (None, math.inf, False), (2**70, -0.0, True), (-3, 1e-300, False)],
)
def test_names_stay_text_and_numbers_numbers_through_the_csvs(names, numbers):
    """read_csv types a cell by its column: a name that spells a number, a
    bool or NaN reads back as the text it is; numbers and bools as they were."""
    rows, summary = [], []
    for (sweep, model, cache), (seed, ppl, significant) in zip(
        names, numbers[: len(names)], strict=True
    ):
        text = dict(sweep=sweep, model=model, cache=cache, bits=cache, metric="ppl")
        rows.append(
            dict.fromkeys(COLUMNS)
            | text
            | dict(seed=seed, ppl=ppl, cache_dtype=model, evict_method=cache, task_mqar_32=ppl)
        )
        summary.append(
            dict.fromkeys(SUMMARY_COLUMNS) | text | dict(mean=ppl, significant=significant)
        )
    with tempfile.TemporaryDirectory() as folder:
        write_csv(os.path.join(folder, "results.csv"), rows)
        write_csv(os.path.join(folder, "summary.csv"), summary, SUMMARY_COLUMNS)
        assert typed(read_csv(os.path.join(folder, "results.csv"))) == typed(rows)
        assert typed(read_csv(os.path.join(folder, "summary.csv"), SUMMARY_COLUMNS)) == typed(
            summary
        )


def test_a_cell_that_is_not_its_columns_type_is_refused_naming_it(tmp_path):
    nan = dict.fromkeys(COLUMNS) | dict(model="nan", cache="16", ppl=math.nan, seed=0)
    write_csv(str(tmp_path / "results.csv"), [nan])
    (row,) = read_csv(str(tmp_path / "results.csv"))
    assert (row["model"], row["cache"], row["seed"]) == ("nan", "16", 0)
    assert math.isnan(row["ppl"])  # a number column's NaN is a number
    text = (tmp_path / "results.csv").read_text().replace(",0,", ",zero,")
    (tmp_path / "results.csv").write_text(text)
    with pytest.raises(ValueError, match="row 1, column 'seed': 'zero' is not a number"):
        read_csv(str(tmp_path / "results.csv"))
