"""RULER's tasks in kvpress's schema: what is asked is in the context, each record
fills its length and is a pure function of its seed; kvpress-format files read back."""

from __future__ import annotations

import json
import re

import pytest

from kvlab.data.ruler import RULER_TASKS, read_records, ruler_record, ruler_records, score


def encode(text):
    return list(text.encode())


@pytest.mark.parametrize("task", RULER_TASKS)
def test_a_record_holds_its_answer_and_fills_its_length(task):
    length = 1200
    record = ruler_record(encode, task, length, index=0)
    assert record["task"] == task and record["max_new_tokens"] > 0
    prompt = record["context"] + record["question"] + record["answer_prefix"]
    assert length - 120 <= len(encode(prompt)) <= length  # the last piece that did not fit
    context = record["context"]
    if task.startswith("niah") or task == "vt":
        for answer in record["answer"]:
            assert answer in context
    if task == "vt":  # the chain in order, starting from the asked value
        names = record["answer"]
        found = [context.index(f"VAR {n} =") for n in names]
        assert found == sorted(found)
        assert re.search(rf"VAR {names[0]} = \d+", context)
        assert all(f"VAR {b} = VAR {a}." in context for a, b in zip(names, names[1:], strict=False))
    if task in ("cwe", "fwe"):  # the answer's words are the most frequent in the list
        words = re.findall(r"[a-z]+", context.split("\n", 1)[1])
        counts = {w: words.count(w) for w in set(words)}
        least = min(counts[a] for a in record["answer"])
        others = [c for w, c in counts.items() if w not in record["answer"]]
        assert least > max(others)
    again = ruler_record(encode, task, length, index=0)
    assert again == record
    assert ruler_record(encode, task, length, index=1) != record


def test_the_records_and_their_score():
    records = ruler_records(encode, ("niah_single_1", "cwe"), 300, samples=2, seed=3)
    assert [r["task"] for r in records] == ["niah_single_1"] * 2 + ["cwe"] * 2
    answer = records[0]["answer"]
    assert score(f"It is {answer[0]}.", answer) == 1.0
    assert score("I do not know", answer) == 0.0
    assert score("Apple, PEAR", ["apple", "pear", "plum", "fig"]) == 0.5
    with pytest.raises(ValueError, match="task='niah' is not a RULER task"):
        ruler_record(encode, "niah", 300, 0)


def test_kvpress_files_are_read_and_checked(tmp_path):
    rows = [
        dict(context="c", question="q?", answer_prefix="a:", answer="x", max_new_tokens=4),
        dict(
            context="d",
            question="r?",
            answer_prefix=None,
            answer=["y", "z"],
            max_new_tokens=2,
            task="mine",
        ),
    ]
    listed = tmp_path / "records.json"
    listed.write_text(json.dumps(rows))
    lines = tmp_path / "records.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in rows))
    for path in (listed, lines):
        records = read_records(path)
        assert [r["answer"] for r in records] == [["x"], ["y", "z"]]
        assert [r["task"] for r in records] == ["records", "mine"]
        assert records[1]["answer_prefix"] == ""
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([{"context": "c", "question": "q"}]))
    with pytest.raises(ValueError, match=r"record 0 .* has no field\(s\) \['answer_prefix'"):
        read_records(broken)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{**rows[0], "max_new_tokens": 0}]))
    with pytest.raises(ValueError, match="max_new_tokens=0: pass a positive integer"):
        read_records(bad)
    with pytest.raises(ValueError, match="is not a file"):
        read_records(tmp_path / "missing.json")
