"""Long-context recall tasks, generated offline: needle in a haystack and RULER's retrievals.

Needle in a haystack (pass-key retrieval, as RULER, arXiv:2404.06654, runs it),
RULER's multi-key and multi-value retrieval and variable tracking, all over the
held-out text kvlab already reads (kvlab/data/text.py: bytes, or data.tokenizer's
ids), plus MQAR (kvlab/data/mqar.py, arXiv:2312.04927) at any length. A text
task's sequence of T + 1 tokens is a window of the split's text (the haystack)
with short statements inserted at depths in [0, 1], then a question and its answer:

    haystack[:p1] statement_1 haystack[p1:p2] ... statement_k haystack[pk:] question answer

A statement at depth d starts at haystack token p = round(d x H), H the
haystack's length, so depth 0 is the first token of the sequence and depth 1
ends right before the question. The tasks (eval.task_params sizes them):

    needle      "\nThe pass key for <word> is <digits>.\n" at one depth (a dataset
                per depth: kvlab.eval.tasks runs eval.depths), then the question
                "\nWhat is the pass key for <word>? The pass key for <word> is "
                and the answer <digits>
    multikey    num_keys such needles under distinct words at random depths; one asked
    multivalue  num_values needles under one word; the question "\nWhat are all the
                pass keys for <word>? The pass keys for <word> are " and the answer
                every value, in the order the context holds them, joined by ", "
    vartrack    num_chains chains of num_hops assignments "\nVAR ABCDE = <digits>.\n",
                "\nVAR FGHIJ = VAR ABCDE.\n", ... at random depths, each chain in
                order, the chains interleaved; the question "\nWhat is the value of
                VAR <name>? VAR <name> = " asks the value of the first chain's last
                variable (RULER also asks the other way round, which variables hold
                a value; kvlab asks for the value, so every task is scored on a
                value's digits)
    mqar        MqarDataset(data.mqar, split, T): the pairs and their queries at length T

Batches are kvlab's (kvlab/data/__init__.py):

    inputs   int32[B, T]    sequence[:-1]
    targets  int32[B, T]    sequence[1:]
    weights  float32[B, T]  1 where the target is a token of an asked value's digits, else 0

so `kvlab.eval.evaluate`'s accuracy is the share of the answers' tokens the
model predicts (argmax, the true tokens before each given: teacher forcing).
Each text piece (the words before a value, the digits, the words after) is
encoded on its own and the pieces concatenated, so a value has the same tokens
in its statement and in its answer and the weighted targets are exactly its
digits' tokens; with a tokenizer the sequence may differ from the tokenization
of the whole text at the pieces' seams.

Determinism: `eval_batches(batch_size, num_batches)` draws batch i from a
generator seeded by (split, i, evaluation stream, task): the same sequences on
every call, different per split and per task. A needle dataset's depth does not
enter the seed, so the depths of a grid ask the same word and value in the
same haystack, only the placement moves. `batch(step, batch_size, seed)` draws
from (seed, step, split, task), as the other datasets do.

The haystack comes from data.source's corpus ('stdlib' or 'text' with its
path, through data.tokenizer when set); under data.source='mqar' the text
tasks read the 'stdlib' bytes. A row's haystack is a window of the split's files
one after another (a haystack may cross a file boundary: it is only filler).

`check_tasks(cfg)` refuses, naming the field, a config whose eval.tasks'
samples do not fit their lengths or whose model cannot read their tokens
(kvlab.validate_config runs it). Evaluation through a cache at several lengths
is kvlab/eval/tasks.py's (`evaluate_tasks`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvlab.config import BYTE_VOCAB_SIZE, EVAL_TASKS, check_count, eval_seq_len
from kvlab.data.mqar import EVAL_STREAM, MqarDataset
from kvlab.data.text import SPLITS, Batch, load_corpus
from kvlab.data.tokenizer import load_tokenizer, tokenized_split

TASKS = EVAL_TASKS
TEXT_TASKS = ("needle", "multikey", "multivalue", "vartrack")

# Keys of the pass-key needles: short, common, one word each.
WORDS = (
    "apple", "river", "candle", "forest", "mirror", "garden", "pencil", "window",
    "castle", "island", "rocket", "violin", "harbor", "lantern", "meadow", "pepper",
    "saddle", "tunnel", "velvet", "walnut", "anchor", "basket", "copper", "dragon",
    "engine", "falcon", "glacier", "hammer", "jacket", "kettle", "ladder", "marble",
    "needle", "orange", "parrot", "quartz", "rabbit", "silver", "ticket", "umbrella",
    "valley", "wizard", "yellow", "zipper", "bridge", "canyon", "desert", "feather",
)  # fmt: skip
NAME_LETTERS = 5  # vartrack: letters of each variable's name (A-Z)

# Text pieces. A value piece is its digits alone; the others surround it.
NEEDLE = "\nThe pass key for {key} is "
QUESTION = "\nWhat is the pass key for {key}? The pass key for {key} is "
QUESTION_ALL = "\nWhat are all the pass keys for {key}? The pass keys for {key} are "
ASSIGN = "\nVAR {name} = "
ASSIGN_VARIABLE = "\nVAR {name} = VAR {source}.\n"
QUESTION_VARIABLE = "\nWhat is the value of VAR {name}? VAR {name} = "
SEPARATOR = ", "  # multivalue: between the listed values
END = ".\n"

# A sample before encoding: statements (depth, pieces) and the tail (question
# and answer) as pieces (text, scored); scored pieces are the asked values.
Pieces = list[tuple[str, bool]]
Sample = tuple[list[tuple[float, Pieces]], Pieces]


# ---------------------------------------------------------------------------
# Samples: what each task says, before encoding


def _value(rng: np.random.Generator, digits: int) -> str:
    return "".join(map(str, rng.integers(0, 10, digits)))


def _needle(key: str, value: str) -> Pieces:
    return [(NEEDLE.format(key=key), False), (value, False), (END, False)]


def _depths(rng: np.random.Generator, count: int) -> list[float]:
    return sorted(rng.random(count).tolist())


def _names(rng: np.random.Generator, count: int) -> list[str]:
    """`count` distinct upper-case names of NAME_LETTERS letters."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(chr(65 + i) for i in rng.integers(0, 26, NAME_LETTERS))
        if name not in names:
            names.append(name)
    return names


def needle_sample(rng: np.random.Generator, params: Mapping, depth: float | None) -> Sample:
    """One pass key at `depth` (None: a uniform draw), asked back."""
    key, value = str(rng.choice(WORDS)), _value(rng, params["value_digits"])
    depth = float(rng.random()) if depth is None else depth
    return [(depth, _needle(key, value))], [(QUESTION.format(key=key), False), (value, True)]


def multikey_sample(rng: np.random.Generator, params: Mapping) -> Sample:
    """num_keys pass keys under distinct words at random depths; one asked."""
    count = params["num_keys"]
    keys = [str(k) for k in rng.choice(WORDS, count, replace=False)]
    values = [_value(rng, params["value_digits"]) for _ in keys]
    asked = int(rng.integers(count))
    statements = [
        (d, _needle(k, v)) for d, k, v in zip(_depths(rng, count), keys, values, strict=True)
    ]
    return statements, [(QUESTION.format(key=keys[asked]), False), (values[asked], True)]


def multivalue_sample(rng: np.random.Generator, params: Mapping) -> Sample:
    """num_values pass keys under one word; all asked, in the order the context holds them."""
    key = str(rng.choice(WORDS))
    values = [_value(rng, params["value_digits"]) for _ in range(params["num_values"])]
    statements = [
        (d, _needle(key, v)) for d, v in zip(_depths(rng, len(values)), values, strict=True)
    ]
    tail: Pieces = [(QUESTION_ALL.format(key=key), False)]
    for i, value in enumerate(values):
        tail += ([(SEPARATOR, False)] if i else []) + [(value, True)]
    return statements, tail


def vartrack_sample(rng: np.random.Generator, params: Mapping) -> Sample:
    """num_chains chains of num_hops assignments; the value of chain 0's last variable asked."""
    chains, hops = params["num_chains"], params["num_hops"]
    names = np.array(_names(rng, chains * hops)).reshape(chains, hops)
    values = [_value(rng, params["value_digits"]) for _ in range(chains)]
    # Slots in depth order; each chain takes its slots in order (chains interleave).
    owner = rng.permutation(np.repeat(np.arange(chains), hops))
    depths = _depths(rng, chains * hops)
    next_hop = [0] * chains
    statements = []
    for depth, chain in zip(depths, owner, strict=True):
        hop = next_hop[chain]
        next_hop[chain] += 1
        name = names[chain, hop]
        if hop == 0:
            pieces = [(ASSIGN.format(name=name), False), (values[chain], False), (END, False)]
        else:
            pieces = [(ASSIGN_VARIABLE.format(name=name, source=names[chain, hop - 1]), False)]
        statements.append((depth, pieces))
    last = names[0, -1]
    return statements, [(QUESTION_VARIABLE.format(name=last), False), (values[0], True)]


def draw_sample(
    task: str, rng: np.random.Generator, params: Mapping, depth: float | None = None
) -> Sample:
    """One sample of a text task (TEXT_TASKS); `depth` places the needle task's statement."""
    if task == "needle":
        return needle_sample(rng, params, depth)
    return {"multikey": multikey_sample, "multivalue": multivalue_sample}.get(
        task, vartrack_sample
    )(rng, params)


def longest_sample_bytes(task: str, params: Mapping) -> int:
    """UTF-8 bytes of the longest sample of a text task (statements, question, answer):
    the longest word, names and values at full width. A tokenizer gives at most one
    token per byte of this ASCII text, so a sequence of this many tokens holds any
    sample."""
    word, name = max(WORDS, key=len), "X" * NAME_LETTERS
    value = params["value_digits"]
    needle = len(NEEDLE.format(key=word)) + value + len(END)
    question = len(QUESTION.format(key=word)) + value
    if task == "needle":
        return needle + question
    if task == "multikey":
        return params["num_keys"] * needle + question
    if task == "multivalue":
        count = params["num_values"]
        answer = count * value + (count - 1) * len(SEPARATOR)
        return count * needle + len(QUESTION_ALL.format(key=word)) + answer
    chains, hops = params["num_chains"], params["num_hops"]
    first = len(ASSIGN.format(name=name)) + value + len(END)
    link = len(ASSIGN_VARIABLE.format(name=name, source=name))
    return chains * (first + (hops - 1) * link) + len(QUESTION_VARIABLE.format(name=name)) + value


def check_tasks(cfg: Mapping) -> None:
    """Raises ValueError naming the field when eval.tasks' lengths (eval.task_lengths, or
    the evaluation window) cannot hold their samples, or the model cannot read their
    tokens: multikey's keys are distinct WORDS, MQAR's ids must be model ids, and the
    text tasks' bytes need a model reading bytes. `cfg` has passed
    kvlab.config.validate_sections."""
    ev = cfg["eval"]
    model, mqar = cfg["model"], cfg["data"]["mqar"]
    if not ev["tasks"]:
        return
    num_keys = ev["task_params"]["num_keys"]
    if "multikey" in ev["tasks"] and num_keys > len(WORDS):
        raise ValueError(
            f"eval.task_params.num_keys={num_keys!r} exceeds the {len(WORDS)} distinct words "
            f"multikey draws its keys from: set eval.task_params.num_keys <= {len(WORDS)}"
        )
    if ev["task_lengths"]:
        field, value, lengths = "eval.task_lengths", tuple(ev["task_lengths"]), ev["task_lengths"]
    else:  # the tasks run at the evaluation window
        field, value, lengths = "eval.seq_len", ev["seq_len"], (eval_seq_len(cfg),)
    for task in ev["tasks"]:
        if task == "mqar":
            needed = 4 * mqar["num_pairs"] - 1
            if mqar["vocab_size"] > model["vocab_size"]:
                raise ValueError(
                    f"data.mqar.vocab_size={mqar['vocab_size']!r} exceeds model.vocab_size="
                    f"{model['vocab_size']} (eval.tasks holds 'mqar'): set data.mqar.vocab_size "
                    f"<= {model['vocab_size']}"
                )
        else:
            needed = longest_sample_bytes(task, ev["task_params"]) - 1
            if cfg["data"]["source"] == "mqar" and model["vocab_size"] < BYTE_VOCAB_SIZE:
                raise ValueError(
                    f"eval.tasks={tuple(ev['tasks'])!r} holds {task!r}, which reads stdlib "
                    f"bytes, but model.vocab_size={model['vocab_size']} is below "
                    f"{BYTE_VOCAB_SIZE}: keep only 'mqar' in eval.tasks for this model"
                )
        short = [length for length in lengths if length < needed]
        if short:
            raise ValueError(
                f"{field}={value!r} gives {task!r} {short[0]} tokens, but its samples need up to "
                f"{needed} (statements, question and answer): give lengths >= {needed} in "
                "eval.task_lengths, or shrink eval.task_params"
            )


# ---------------------------------------------------------------------------
# Sequences: a sample encoded and placed in a haystack


def compose(
    encode: Callable[[str], Sequence[int]],
    sample: Sample,
    length: int,
    haystack: Callable[[int], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """(sequence int32[length], scored bool[length]) of a sample in a haystack.

    `haystack(n)` returns n filler tokens; statement pieces are encoded with
    `encode` and inserted at round(depth x n) in the order given (ties keep it).
    """
    statements, tail = sample
    encoded = [
        np.asarray([t for text, _ in pieces for t in encode(text)]) for _, pieces in statements
    ]
    tail_tokens = [np.asarray(encode(text)) for text, _ in tail]
    tail_scored = [
        np.full(len(t), scored) for t, (_, scored) in zip(tail_tokens, tail, strict=True)
    ]
    filler = length - sum(map(len, encoded)) - sum(map(len, tail_tokens))
    if filler < 0:
        raise ValueError(
            f"a task sample needs {length - filler} tokens but the sequence holds {length}: "
            "raise the task length (eval.task_lengths / eval.seq_len)"
        )
    hay = haystack(filler)
    cuts = [int(round(depth * filler)) for depth, _ in statements]
    parts, start = [], 0
    for cut, tokens in zip(cuts, encoded, strict=True):
        parts += [hay[start:cut], tokens]
        start = cut
    parts.append(hay[start:])
    body = np.concatenate(
        [p.astype(np.int64) for p in parts] + [t.astype(np.int64) for t in tail_tokens]
    )
    scored = np.concatenate([np.zeros(filler + sum(map(len, encoded)), bool)] + tail_scored)
    return body.astype(np.int32), scored


# ---------------------------------------------------------------------------
# Datasets


class TaskDataset:
    """A text task's sequences of seq_len + 1 tokens for one split (see the module docstring).

    data: a config's data section (the haystack's corpus and tokenizer);
    params: eval.task_params; depth: the needle task's depth (None: drawn per row).
    """

    metric = "accuracy"

    def __init__(
        self,
        task: str,
        data: Mapping,
        params: Mapping,
        split: str,
        seq_len: int,
        depth: float | None = None,
    ):
        if task not in TEXT_TASKS:
            raise ValueError(
                f"eval.tasks holds {task!r}, which is not a text task: use one of "
                f"{', '.join(map(repr, TEXT_TASKS))} (or 'mqar', make_task)"
            )
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not a data split: use one of {SPLITS}")
        self.task, self.split, self.params, self.depth = task, split, params, depth
        self.seq_len = check_count("eval.task_lengths", seq_len)
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"eval.depths holds {depth!r}, outside [0, 1]: give depths in [0, 1]")
        if task == "multikey" and params["num_keys"] > len(WORDS):
            raise ValueError(
                f"eval.task_params.num_keys={params['num_keys']} exceeds the {len(WORDS)} "
                f"words multikey draws from: set eval.task_params.num_keys <= {len(WORDS)}"
            )
        needed = longest_sample_bytes(task, params)
        if needed > seq_len + 1:
            raise ValueError(
                f"eval.task_lengths holds {seq_len}, too short for task {task!r}, whose "
                f"statements and question take up to {needed} tokens: give lengths >= "
                f"{needed - 1} (or fewer keys, values, hops or digits in eval.task_params)"
            )
        self.source = data["source"] if data["source"] in ("stdlib", "text") else "stdlib"
        path = data.get("path", "") if self.source == "text" else ""
        key = os.path.abspath(path) if path else ""
        tokenizer = data.get("tokenizer", "") if self.source == data["source"] else ""
        if tokenizer:
            self.tokenizer = load_tokenizer(tokenizer)
            self.vocab_size = self.tokenizer.vocab_size
            self.tokens = tokenized_split(self.source, key, self.tokenizer, split).tokens
            self.encode = self.tokenizer.encode
        else:
            self.tokenizer = None
            self.vocab_size = BYTE_VOCAB_SIZE
            self.tokens = load_corpus(self.source, key)[split].tokens
            self.encode = lambda text: list(text.encode("utf-8"))
        if self.tokens.size < seq_len + 1:
            raise ValueError(
                f"eval.task_lengths holds {seq_len}, longer than the {self.tokens.size} tokens "
                f"of the {split} split of data.source={self.source!r}: give shorter lengths"
            )

    def _row(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        sample = draw_sample(self.task, rng, self.params, self.depth)

        def haystack(count: int) -> np.ndarray:
            start = int(rng.integers(0, self.tokens.size - count + 1))
            return self.tokens[start : start + count]

        return compose(self.encode, sample, self.seq_len + 1, haystack)

    def _generate(self, rng: np.random.Generator, batch_size: int) -> Batch:
        rows = [self._row(rng) for _ in range(batch_size)]
        sequence = np.stack([s for s, _ in rows])  # [B, T + 1]
        scored = np.stack([w for _, w in rows])  # [B, T + 1]
        return dict(
            inputs=sequence[:, :-1],
            targets=sequence[:, 1:],
            weights=scored[:, 1:].astype(np.float32),
        )

    def batch(self, step: int, batch_size: int, seed: int, rows: np.ndarray | None = None) -> Batch:
        """Fresh sequences, a pure function of (seed, step, batch_size); `rows` keeps some."""
        split, task = SPLITS.index(self.split), TASKS.index(self.task)
        batch = self._generate(np.random.default_rng([seed, step, split, task]), batch_size)
        return batch if rows is None else {name: array[rows] for name, array in batch.items()}

    def eval_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """num_batches batches of the split's fixed sequences (the same on every call)."""
        split, task = SPLITS.index(self.split), TASKS.index(self.task)
        return [
            self._generate(np.random.default_rng([split, i, EVAL_STREAM, task]), batch_size)
            for i in range(num_batches)
        ]

    def describe(self) -> dict:
        return dict(
            source=self.task,
            haystack=self.source,
            split=self.split,
            seq_len=self.seq_len,
            depth=self.depth,
            tokenizer=self.tokenizer.path if self.tokenizer else "",
            **dict(self.params),
        )


def make_task(
    task: str,
    cfg: Mapping,
    split: str,
    seq_len: int,
    depth: float | None = None,
) -> TaskDataset | MqarDataset:
    """The dataset of `task` (TASKS) at length `seq_len` for a validated config `cfg`
    (its data and eval sections); `depth` places the needle task's statement."""
    if task == "mqar":
        return MqarDataset(cfg["data"]["mqar"], split, check_count("eval.task_lengths", seq_len))
    return TaskDataset(task, cfg["data"], cfg["eval"]["task_params"], split, seq_len, depth)


def task_lengths(cfg: Mapping) -> tuple[int, ...]:
    """The lengths a config's tasks run at: eval.task_lengths, or eval.seq_len alone."""
    return tuple(cfg["eval"]["task_lengths"]) or (eval_seq_len(cfg),)
