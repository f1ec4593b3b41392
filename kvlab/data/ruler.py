"""RULER's synthetic tasks (arXiv:2404.06654) in kvpress's dataset schema, generated offline.

    records = ruler_records(encode, tasks=RULER_TASKS, length=1024, samples=4, seed=0)
    records = read_records("ruler.parquet")        # a kvpress-format file a user brings

A record is one question about one context, as kvpress's evaluation reads them:

    task            the RULER task's name (niah_single_1, ..., fwe)
    context         the haystack text with what is asked hidden in it; ends with the
                    instruction's last line, as RULER's templates do
    question        the question, asked after the (compressed) context
    answer_prefix   what the answer starts with, fed before generation
    answer          list[str]: every string the generation must contain
    max_new_tokens  tokens generated for it

Contexts are sized in tokens of the model's own tokenizer (`encode`): filler is
added sentence by sentence (or line by line) until the context holds `length`
tokens less the question's, so a length is what the model reads. Scoring is
RULER's `string_match_all` (`score`): the share of the answer's strings found,
case-insensitively, in the generated text.

Tasks (RULER's names, its synthetic categories; the essays of niah_single_2 and
the multi-needle tasks are the standard library's held-out files, not Paul
Graham's: no PyPI package this project may depend on ships them):

    niah_single_1    one 7-digit number under a key, in repeated noise sentences
    niah_single_2    one 7-digit number under a key, in text
    niah_multikey_1  four keys, one asked
    niah_multivalue  four numbers under one key, all asked
    niah_multiquery  four keys, all asked
    vt               variable tracking: one chain of five assignments in noise, which
                     variables hold the value
    cwe              common words extraction: the 10 words repeated most in a list
    fwe              frequent words extraction: the 3 most frequent coded words of a
                     Zipf-distributed text

Every record is a pure function of (task, length, index, seed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvlab.data.tasks import WORDS
from kvlab.data.text import decode_bytes, load_corpus

RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
FIELDS = ("context", "question", "answer_prefix", "answer", "max_new_tokens")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "One of the special magic numbers for {key} is: {value}. "
INSTRUCT_NIAH = (
    "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the numbers afterwards.\n"
)
# A few hundred distinct lower-case words for cwe and fwe's vocabularies.
SYLLABLES = ("ka", "lo", "mi", "ne", "po", "ru", "sa", "ti", "vo", "ze", "bu", "da", "fe", "gi")

Record = dict


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _coined(rng: np.random.Generator, syllables: int = 3, seen: set | None = None):
    """Made-up words of `syllables` syllables, each new (also against `seen`)."""
    seen = set() if seen is None else seen
    while True:
        word = "".join(rng.choice(SYLLABLES, syllables))
        if word not in seen:
            seen.add(word)
            yield word


def _take(words, count: int) -> list[str]:
    return [next(words) for _ in range(count)]


class _Filler:
    """Filler text: repeated noise, or the held-out split's files as sentences."""

    def __init__(self, kind: str, rng: np.random.Generator):
        self.kind, self.rng = kind, rng
        if kind == "text":
            split = load_corpus("stdlib", "")["test"]
            start = int(rng.integers(0, max(1, len(split.tokens) - 400_000)))
            text = decode_bytes(split.tokens[start : start + 400_000])
            self.pieces = [line + "\n" for line in text.split("\n") if line.strip()]
            self.next = 0

    def take(self) -> str:
        if self.kind == "noise":
            return NOISE
        piece = self.pieces[self.next % len(self.pieces)]
        self.next += 1
        return piece


def _fill(
    encode: Callable[[str], Sequence[int]],
    budget: int,
    filler: _Filler,
    needles: Sequence[str],
    rng: np.random.Generator,
) -> str:
    """Filler pieces up to `budget` tokens with the needles at random depths
    (sorted, so their order in the text is the order drawn)."""
    pieces: list[str] = []
    used = sum(len(encode(n)) for n in needles)
    while True:
        piece = filler.take()
        cost = len(encode(piece))
        if used + cost > budget:
            break
        pieces.append(piece)
        used += cost
    cuts = sorted(int(c) for c in rng.integers(0, len(pieces) + 1, len(needles)))
    for offset, (cut, needle) in enumerate(zip(cuts, needles, strict=True)):
        pieces.insert(cut + offset, needle)
    return "".join(pieces)


def _niah(encode, length, rng, kind: str, keys: int, values: int, asked: int) -> Record:
    names = [str(w) for w in rng.choice(WORDS, keys, replace=False)]
    numbers = {k: [_number(rng) for _ in range(values)] for k in names}
    needles = [NEEDLE.format(key=k, value=v) for k in names for v in numbers[k]]
    order = rng.permutation(len(needles))
    needles = [needles[i] for i in order]
    queried = names[:asked]
    subject = ", ".join(queried[:-1]) + (" and " if asked > 1 else "") + queried[-1]
    plural = values > 1 or asked > 1
    question = (
        f"What are all the special magic numbers for {subject} mentioned in the provided text?"
        if plural
        else f"What is the special magic number for {subject} mentioned in the provided text?"
    )
    prefix = (
        f"The special magic numbers for {subject} mentioned in the provided text are"
        if plural
        else f"The special magic number for {subject} mentioned in the provided text is"
    )
    answer = [v for k in queried for v in numbers[k]]
    tail = "\n" + question + " " + prefix
    body = _fill(
        encode, length - len(encode(INSTRUCT_NIAH + tail)), _Filler(kind, rng), needles, rng
    )
    return dict(
        context=INSTRUCT_NIAH + body,
        question="\n" + question,
        answer_prefix=" " + prefix,
        answer=answer,
        max_new_tokens=16 * len(answer),
    )


def _vt(encode, length, rng) -> Record:
    names = ["".join(chr(65 + i) for i in rng.integers(0, 26, 5)) for _ in range(5)]
    value = str(int(rng.integers(10_000, 100_000)))
    needles = [f"VAR {names[0]} = {value}. "]
    needles += [f"VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, 5)]
    instruct = (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
    )
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, "
        f"5 variables are assigned the value {value}, they are:"
    )
    tail = "\n" + question + " " + prefix
    filler = _Filler("noise", rng)
    # The chain in order: the cuts are sorted and the needles kept in their order.
    body = _fill(encode, length - len(encode(instruct + tail)), filler, needles, rng)
    return dict(
        context=instruct + body,
        question="\n" + question,
        answer_prefix=" " + prefix,
        answer=names,
        max_new_tokens=30,
    )


def _listed(encode, budget: int, cycle, rng, numbered: bool) -> list[str]:
    """Words drawn a cycle at a time (`cycle(i)`: the i-th cycle's words) while their
    tokens fit `budget`, then shuffled: each word's count is set by the cycles,
    so the most frequent ones are never tied with the others."""
    words: list[str] = []
    used, i = 0, 0
    while True:
        added, cost = [], 0
        for word in cycle(i):
            n = len(words) + len(added) + 1
            cost += len(encode(f"{n}. {word} " if numbered else word + " "))
            if used + cost > budget:
                break
            added.append(word)
        else:
            words += added
            used += cost
            i += 1
            continue
        words += added  # the part of the last cycle that fits
        break
    order = rng.permutation(len(words))
    return [words[j] for j in order]


def _cwe(encode, length, rng) -> Record:
    seen: set = set()
    common = _take(_coined(rng, 3, seen), 10)
    instruct = (
        "Below is a numbered list of words. In these words, some appear more often than others.\n"
    )
    question = "What are the 10 most common words in the above list?"
    prefix = "Answer: The top 10 words that appear most often in the list are:"
    tail = "\n" + question + " " + prefix
    budget = length - len(encode(instruct + tail))
    # A cycle: the common words once each, then five words seen nowhere else. The
    # last cycle may be cut short, so the full ones are counted: each common word
    # is in every full cycle (at least two) and each rare word in one.
    rare = _coined(rng, 4, seen)
    words = _listed(encode, budget, lambda i: common + _take(rare, 5), rng, True)
    return dict(
        context=instruct + "".join(f"{n}. {w} " for n, w in enumerate(words, 1)),
        question="\n" + question,
        answer_prefix=" " + prefix,
        answer=_most_common(words, 10),
        max_new_tokens=120,
    )


def _fwe(encode, length, rng) -> Record:
    seen: set = set()
    vocab = _take(_coined(rng, 3, seen), 3)
    instruct = (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words.\n... "
    )
    question = "What are the three most frequently appeared words in the above coded text?"
    prefix = (
        "Answer: According to the coded text above, the three most frequently appeared words are:"
    )
    tail = "...\n" + question + " " + prefix
    budget = length - len(encode(instruct + tail))
    # Zipf-like counts per cycle, 16 : 4 : 2 for the three, 1 for ten words used once.
    rest = _coined(rng, 4, seen)
    cycle = lambda i: [vocab[0]] * 16 + [vocab[1]] * 4 + [vocab[2]] * 2 + _take(rest, 10)  # noqa: E731
    words = _listed(encode, budget, cycle, rng, False)
    return dict(
        context=instruct + "".join(w + " " for w in words) + "...",
        question="\n" + question,
        answer_prefix=" " + prefix,
        answer=_most_common(words, 3),
        max_new_tokens=50,
    )


def _most_common(words: Sequence[str], count: int) -> list[str]:
    """The `count` most frequent words (by first appearance among equals)."""
    counts: dict[str, int] = {}
    for word in words:
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts, key=lambda w: -counts[w])[:count]


def ruler_record(
    encode: Callable[[str], Sequence[int]], task: str, length: int, index: int, seed: int = 0
) -> Record:
    """Record `index` of `task` with a context of about `length` tokens (module docstring)."""
    if task not in RULER_TASKS:
        raise ValueError(f"task={task!r} is not a RULER task here: choose from {RULER_TASKS}")
    key = [seed, RULER_TASKS.index(task), length, index]
    rng = np.random.default_rng(key)
    if task == "vt":
        record = _vt(encode, length, rng)
    elif task == "cwe":
        record = _cwe(encode, length, rng)
    elif task == "fwe":
        record = _fwe(encode, length, rng)
    else:
        shape = {
            "niah_single_1": ("noise", 1, 1, 1),
            "niah_single_2": ("text", 1, 1, 1),
            "niah_multikey_1": ("text", 4, 1, 1),
            "niah_multivalue": ("text", 1, 4, 1),
            "niah_multiquery": ("text", 4, 1, 4),
        }[task]
        record = _niah(encode, length, rng, *shape)
    return dict(task=task, **record)


def ruler_records(
    encode: Callable[[str], Sequence[int]],
    tasks: Sequence[str] = RULER_TASKS,
    length: int = 1024,
    samples: int = 4,
    seed: int = 0,
) -> list[Record]:
    """`samples` records of each task at `length` tokens."""
    return [ruler_record(encode, t, length, i, seed) for t in tasks for i in range(samples)]


def score(prediction: str, answer: Sequence[str]) -> float:
    """RULER's string_match_all of one record: the share of `answer` found in `prediction`."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answer) / len(answer)


def read_records(path: str | os.PathLike) -> list[Record]:
    """Records from a kvpress-format file a user brings: JSON (a list of records, or
    JSON lines) or parquet (through pandas: the extra `parquet`); each needs
    the FIELDS, `task` is optional. `answer` may be one string or a list."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path={path!r} is not a file: pass a .json, .jsonl or .parquet file")
    if path.endswith(".parquet"):
        try:
            import pandas  # an optional extra: only a user's parquet file needs it
        except ImportError:
            raise ValueError(
                f"reading {path!r} needs pandas and pyarrow: pip install -e '.[parquet]', "
                "or bring the records as JSON"
            ) from None
        rows = pandas.read_parquet(path).to_dict("records")
    else:
        with open(path, encoding="utf-8") as file:
            text = file.read()
        try:
            loaded = json.loads(text)
            rows = loaded if isinstance(loaded, list) else [loaded]
        except json.JSONDecodeError:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [_checked(row, i, path) for i, row in enumerate(rows)]


def _checked(row: Mapping, index: int, path: str) -> Record:
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise ValueError(
            f"record {index} of {path!r} has no field(s) {missing}: kvpress's schema has "
            f"{list(FIELDS)}"
        )
    answer = row["answer"]
    answer = [answer] if isinstance(answer, str) else [str(a) for a in answer]
    count = row["max_new_tokens"]
    if not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(
            f"record {index} of {path!r} has max_new_tokens={count!r}: pass a positive integer"
        )
    return dict(
        task=str(row.get("task", "records")),
        context=str(row["context"]),
        question=str(row["question"]),
        answer_prefix=str(row["answer_prefix"] or ""),
        answer=answer,
        max_new_tokens=int(count),
    )
