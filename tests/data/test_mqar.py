"""MQAR: sequence layout, recall targets, weights, query gaps, determinism and errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.data import make_dataset, mqar_batch
from kvlab.data.mqar import num_keys


def mqar_config(num_pairs=8, vocab_size=256, power=0.01, seq_len=128):
    cfg = kvlab.base_config("tiny")
    cfg.data.source = "mqar"
    cfg.data.mqar.update(num_pairs=num_pairs, vocab_size=vocab_size, power=power)
    cfg.train.seq_len = seq_len
    return cfg


@st.composite
def settings(draw):
    """(vocab_size, num_pairs, seq_len) that fit: num_pairs <= keys and 4 num_pairs <= T + 1."""
    vocab_size = draw(st.integers(4, 600))
    seq_len = draw(st.integers(3, 300))
    num_pairs = draw(st.integers(1, min(num_keys(vocab_size), (seq_len + 1) // 4)))
    return vocab_size, num_pairs, seq_len


@given(
    setting=settings(),
    power=st.sampled_from([0.01, 0.5, 1.0, 2.0]),
    batch_size=st.integers(1, 16),
    seed=st.integers(0, 2**31),
)
def test_sequences_pair_keys_with_values_then_query_every_key(setting, power, batch_size, seed):
    vocab_size, num_pairs, seq_len = setting
    P, half = num_pairs, vocab_size // 2
    batch = mqar_batch(
        np.random.default_rng(seed), batch_size, seq_len, num_pairs, vocab_size, power
    )
    inputs, targets, weights = batch["inputs"], batch["targets"], batch["weights"]
    assert inputs.shape == targets.shape == weights.shape == (batch_size, seq_len)
    assert inputs.dtype == targets.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])  # next-token targets
    sequences = np.concatenate([inputs, targets[:, -1:]], axis=1)  # [B, T + 1]
    np.testing.assert_array_equal(weights.sum(axis=1), P)
    assert set(np.unique(weights)) <= {0.0, 1.0}
    for sequence, row_weights in zip(sequences, weights, strict=True):
        keys, values = sequence[0 : 2 * P : 2], sequence[1 : 2 * P : 2]  # the context comes first
        assert len(set(keys.tolist())) == P
        assert ((keys >= 1) & (keys < half)).all()
        assert ((values >= half) & (values < vocab_size)).all()
        value_of = dict(zip(keys.tolist(), values.tolist(), strict=True))

        queries = np.flatnonzero(row_weights)  # positions whose input is a query key
        assert queries.min() >= 2 * P
        assert sorted(sequence[queries].tolist()) == sorted(keys.tolist())  # each key once
        for position in queries:
            assert sequence[position + 1] == value_of[int(sequence[position])]
        filler = np.ones(seq_len + 1, bool)
        filler[: 2 * P] = False
        filler[queries] = filler[queries + 1] = False
        assert (sequence[filler] == 0).all()


def test_small_powers_put_queries_near_the_context():
    """p(gap) ~ gap ** (power - 1): uniform over the slots at power 1, near the context below."""

    def mean_gap(power):
        batch = mqar_batch(np.random.default_rng(0), 512, 255, 4, 64, power)
        queries = np.nonzero(batch["weights"])[1]
        return ((queries - 2 * 4) // 2 + 1).mean()  # gap in slots from the context end

    slots = (256 - 8) // 2
    assert abs(mean_gap(1.0) - (slots + 1) / 2) < 3  # uniform: mean gap of 1..slots
    assert mean_gap(0.01) < 0.5 * mean_gap(1.0)


def test_batch_is_a_pure_function_of_seed_and_step():
    dataset = make_dataset(mqar_config().data, "train", 128)
    batch = dataset.batch(5, 16, seed=1)
    again = make_dataset(mqar_config().data, "train", 128).batch(5, 16, seed=1)
    for key in batch:
        np.testing.assert_array_equal(batch[key], again[key])
    assert not np.array_equal(batch["inputs"], dataset.batch(6, 16, seed=1)["inputs"])
    assert not np.array_equal(batch["inputs"], dataset.batch(5, 16, seed=2)["inputs"])


def test_eval_batches_are_fixed_per_split_and_differ_between_splits():
    data = mqar_config().data
    validation = make_dataset(data, "validation", 128).eval_batches(8, 3)
    assert len(validation) == 3 and validation[0]["inputs"].shape == (8, 128)
    again = make_dataset(data, "validation", 128).eval_batches(8, 3)
    for a, b in zip(validation, again, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    test = make_dataset(data, "test", 128).eval_batches(8, 3)
    train = make_dataset(data, "train", 128).eval_batches(8, 3)
    assert not np.array_equal(validation[0]["inputs"], test[0]["inputs"])
    assert not np.array_equal(validation[0]["inputs"], train[0]["inputs"])
    assert not np.array_equal(validation[0]["inputs"], validation[1]["inputs"])


def test_dataset_facts():
    dataset = make_dataset(mqar_config(num_pairs=4, vocab_size=64).data, "test", 32)
    assert (dataset.metric, dataset.vocab_size, dataset.seq_len) == ("accuracy", 64, 32)
    assert dataset.describe() == dict(
        source="mqar", split="test", seq_len=32, num_pairs=4, vocab_size=64, power=0.01
    )


@pytest.mark.parametrize(
    "fields, seq_len, match",
    [
        (
            dict(num_pairs=9),
            32,
            r"data\.mqar\.num_pairs=9 needs 36 tokens but train\.seq_len=32 holds 33",
        ),
        (dict(num_pairs=4, vocab_size=8), 64, r"data\.mqar\.num_pairs=4 .* the 3 keys"),
        (dict(vocab_size=3), 64, r"data\.mqar\.vocab_size=3 is below 4"),
        (dict(power=0.0), 64, r"data\.mqar\.power=0\.0 is not positive"),
    ],
)
def test_bad_settings_raise_naming_the_field(fields, seq_len, match):
    cfg = mqar_config()
    cfg.data.mqar.update(fields)
    with pytest.raises(ValueError, match=match):
        make_dataset(cfg.data, "train", seq_len)
