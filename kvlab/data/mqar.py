"""Multi-query associative recall (MQAR), generated: Zoology, arXiv:2312.04927.

The model reads key-value pairs, then must recall each key's value when the key
comes back later as a query. With V = data.mqar.vocab_size:

    id 0              filler
    ids 1 .. V/2-1    keys
    ids V/2 .. V-1    values

A sequence holds T + 1 tokens (P = data.mqar.num_pairs):

    k1 v1 k2 v2 ... kP vP | 0 0 kj vj 0 ... ki vi 0 0 ...
    context: 2P tokens    | queries: every key once more, followed by its value

Keys are distinct within a sequence, values drawn independently (two keys may
share a value). The region after the context is cut into (T + 1 - 2P) // 2
slots of two tokens; slot j (j = 0, 1, ...) is at gap j + 1 from the context
end. P distinct slots are drawn with p(gap) ~ gap ** (power - 1) (power =
data.mqar.power; small powers put most queries near the context), and the keys
are placed into them in a random order. Every other token is the filler 0, so
a sequence needs 4P <= T + 1.

    inputs   int32[B, T]    sequence[:-1]
    targets  int32[B, T]    sequence[1:]
    weights  float32[B, T]  1 where the input is a query key (the target is
                            its value), else 0: each row sums to P

The metric is the accuracy on the weighted targets. `batch(step, batch_size,
seed, rows=None)` draws from a generator seeded by (seed, step, split), and
keeps `rows` of the batch when given; `eval_batches`
from a fixed generator per split and batch index, so every call returns the
same sequences and the splits differ.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvlab.config import check_count
from kvlab.data.text import SPLITS, Batch

# The last word of every evaluation seed; training seeds end in a split index
# (0, 1, 2), so no training batch shares a generator with an evaluation batch.
EVAL_STREAM = 2**32 - 1


def num_keys(vocab_size: int) -> int:
    """How many distinct keys a vocabulary of `vocab_size` ids holds (ids 1 .. V/2-1)."""
    return vocab_size // 2 - 1


def mqar_batch(
    rng: np.random.Generator,
    batch_size: int,
    seq_len: int,
    num_pairs: int,
    vocab_size: int,
    power: float,
) -> Batch:
    """A batch of MQAR sequences of seq_len + 1 tokens (see the module docstring)."""
    B, P, L = batch_size, num_pairs, seq_len + 1
    num_slots = (L - 2 * P) // 2
    rows = np.arange(B)[:, None]

    # Distinct keys per row: the first P of a random permutation of the key ids.
    keys = rng.random((B, num_keys(vocab_size))).argsort(axis=1)[:, :P] + 1  # [B, P]
    values = rng.integers(vocab_size // 2, vocab_size, (B, P))  # [B, P]

    # P distinct query slots per row, drawn without replacement with weights
    # gap ** (power - 1): the P largest of log-weight + Gumbel noise (Gumbel top-k).
    log_weights = (power - 1) * np.log(np.arange(1, num_slots + 1))  # [S]
    scores = log_weights + rng.gumbel(size=(B, num_slots))  # [B, S]
    slots = np.argpartition(-scores, P - 1, axis=1)[:, :P]  # [B, P]
    slots = rng.permuted(slots, axis=1)  # key i goes to a random one of the drawn slots
    query_positions = 2 * P + 2 * slots  # [B, P]

    sequence = np.zeros((B, L), np.int32)
    sequence[:, 0 : 2 * P : 2] = keys
    sequence[:, 1 : 2 * P : 2] = values
    sequence[rows, query_positions] = keys
    sequence[rows, query_positions + 1] = values

    weights = np.zeros((B, seq_len), np.float32)
    weights[rows, query_positions] = 1.0  # input = query key, target = its value
    return dict(inputs=sequence[:, :-1], targets=sequence[:, 1:], weights=weights)


def _fail(field: str, value, problem: str, fix: str) -> None:
    raise ValueError(f"{field}={value!r} {problem}: {fix}")


class MqarDataset:
    """MQAR sequences for one split, generated on demand (see the module docstring)."""

    metric = "accuracy"

    def __init__(self, mqar: Mapping, split: str, seq_len: int):
        self.split, self.seq_len = split, seq_len
        self.vocab_size = check_count("data.mqar.vocab_size", mqar["vocab_size"], minimum=4)
        self.num_pairs = check_count("data.mqar.num_pairs", mqar["num_pairs"])
        self.power = mqar["power"]
        keys = num_keys(self.vocab_size)
        if self.num_pairs > keys:
            _fail(
                "data.mqar.num_pairs",
                self.num_pairs,
                f"exceeds the {keys} keys data.mqar.vocab_size={self.vocab_size} holds",
                f"set data.mqar.num_pairs in 1..{keys} or raise data.mqar.vocab_size",
            )
        if 4 * self.num_pairs > seq_len + 1:
            _fail(
                "data.mqar.num_pairs",
                self.num_pairs,
                f"needs {4 * self.num_pairs} tokens but train.seq_len={seq_len} holds "
                f"{seq_len + 1} per sequence",
                f"set data.mqar.num_pairs <= {(seq_len + 1) // 4} or raise train.seq_len",
            )
        if not self.power > 0:
            _fail("data.mqar.power", self.power, "is not positive", "set a number > 0")

    def _generate(self, rng: np.random.Generator, batch_size: int) -> Batch:
        return mqar_batch(
            rng, batch_size, self.seq_len, self.num_pairs, self.vocab_size, self.power
        )

    def batch(self, step: int, batch_size: int, seed: int, rows: np.ndarray | None = None) -> Batch:
        """A batch of fresh sequences, a pure function of (seed, step, batch_size).

        With `rows` (indices into the batch), only those rows of it, in that
        order: one host's part of a multi-host batch. The generator draws whole
        batches, so every host generates all rows and keeps its own."""
        rng = np.random.default_rng([seed, step, SPLITS.index(self.split)])
        batch = self._generate(rng, batch_size)
        return batch if rows is None else {name: array[rows] for name, array in batch.items()}

    def eval_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """num_batches batches of the split's fixed evaluation sequences."""
        split_index = SPLITS.index(self.split)
        return [
            self._generate(np.random.default_rng([split_index, i, EVAL_STREAM]), batch_size)
            for i in range(num_batches)
        ]

    def describe(self) -> dict:
        return dict(
            source="mqar",
            split=self.split,
            seq_len=self.seq_len,
            num_pairs=self.num_pairs,
            vocab_size=self.vocab_size,
            power=self.power,
        )
