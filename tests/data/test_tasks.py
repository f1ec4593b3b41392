"""Long-context tasks: deterministic, exact lengths, answers where the weights are, depths."""

import re

import numpy as np
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

import kvlab
from kvlab.data import make_task
from kvlab.data.tasks import (
    TEXT_TASKS,
    longest_sample_bytes,
)

PARAMS = dict(value_digits=5, num_keys=3, num_values=3, num_chains=2, num_hops=3)


def config(**eval_fields):
    cfg = kvlab.base_config("tiny")
    cfg.eval.task_params.update(PARAMS)
    cfg.eval.update(eval_fields)
    return kvlab.validate_config(cfg)


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")


def answer_of(text: str, task: str) -> list[str]:
    """The values the question asks, read back from the decoded context alone."""
    if task in ("needle", "multikey"):
        key = re.search(r"\nWhat is the pass key for (\w+)\? The pass key for \1 is $", text)
        return re.findall(rf"\nThe pass key for {key.group(1)} is (\d+)\.\n", text)
    if task == "multivalue":
        key = re.search(r"The pass keys for (\w+) are $", text).group(1)
        return re.findall(rf"\nThe pass key for {key} is (\d+)\.\n", text)
    name = re.search(r"\nWhat is the value of VAR ([A-Z]+)\? VAR \1 = $", text).group(1)
    while True:  # follow the chain back to its value
        source = re.search(rf"\nVAR {name} = (VAR ([A-Z]+)|(\d+))\.\n", text)
        if source.group(3):
            return [source.group(3)]
        name = source.group(2)


def check_answers(batch, task):
    """The weighted targets are exactly the asked values' digits, in order."""
    for inputs, targets, weights in zip(
        batch["inputs"], batch["targets"], batch["weights"], strict=True
    ):
        first = int(np.argmax(weights > 0))
        asked = answer_of(decode(inputs[: first + 1]), task)
        expected = "".join(asked)
        assert decode(targets[weights > 0]) == expected
        assert weights.sum() == len(expected) and set(np.unique(weights)) <= {0.0, 1.0}
        if task != "multivalue":  # one value; a multivalue row lists them with ", " between
            assert len(asked) == 1 and weights[first:].all()
        assert weights[-1] == 1  # the sequence ends on the answer


@pytest.mark.parametrize("task", TEXT_TASKS)
def test_tasks_are_deterministic_per_split_and_seed_with_answers_at_the_weights(task):
    cfg = config()
    data = make_task(task, cfg, "validation", 256, depth=0.5 if task == "needle" else None)
    batches = data.eval_batches(3, 2)
    again = make_task(task, cfg, "validation", 256, depth=0.5).eval_batches(3, 2)
    for one, two in zip(batches, again, strict=True):
        for name in ("inputs", "targets", "weights"):
            np.testing.assert_array_equal(one[name], two[name])
        assert one["inputs"].shape == one["weights"].shape == (3, 256)
        np.testing.assert_array_equal(one["inputs"][:, 1:], one["targets"][:, :-1])
        check_answers(one, task)
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])
    test = make_task(task, cfg, "test", 256, depth=0.5).eval_batches(3, 2)
    assert not np.array_equal(batches[0]["inputs"], test[0]["inputs"])
    drawn = data.batch(step=4, batch_size=3, seed=1)
    np.testing.assert_array_equal(drawn["inputs"], data.batch(4, 3, 1)["inputs"])
    assert not np.array_equal(drawn["inputs"], data.batch(4, 3, 2)["inputs"])
    np.testing.assert_array_equal(
        data.batch(4, 3, 1, rows=[2, 0])["inputs"], drawn["inputs"][[2, 0]]
    )
    check_answers(drawn, task)


def test_tasks_differ_from_each_other():
    cfg = config()
    firsts = {t: make_task(t, cfg, "validation", 300).eval_batches(2, 1)[0] for t in TEXT_TASKS}
    texts = {t: decode(b["inputs"][0]) for t, b in firsts.items()}
    assert len(set(texts.values())) == len(TEXT_TASKS)


@given(
    task=st.sampled_from(TEXT_TASKS),
    extra=st.integers(0, 400),
    digits=st.integers(1, 8),
    count=st.integers(1, 4),
    depth=st.floats(0, 1),
)
def test_any_length_and_size_is_exact_with_answers_at_the_weights(
    task, extra, digits, count, depth
):
    params = dict(value_digits=digits, num_keys=count, num_values=count, num_chains=count)
    cfg = config(task_params={**PARAMS, **params})
    length = longest_sample_bytes(task, cfg.eval.task_params) - 1 + extra  # the shortest allowed
    batch = make_task(task, cfg, "validation", length, depth).eval_batches(2, 1)[0]
    assert batch["inputs"].shape == batch["targets"].shape == (2, length)
    check_answers(batch, task)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_the_needle_sits_at_its_depth(depth):
    cfg = config()
    length = 1000
    batch = make_task("needle", cfg, "validation", length, depth).eval_batches(4, 1)[0]
    for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
        sequence = bytes(np.append(inputs, targets[-1]).astype(np.uint8))  # T + 1 tokens
        start = sequence.index(b"\nThe pass key for ")
        end = sequence.index(b".\n", start) + 2
        question = sequence.index(b"\nWhat is the pass key")
        haystack = length + 1 - (end - start) - (length + 1 - question)
        assert start == round(depth * haystack)
        if depth == 1.0:
            assert end == question  # right before the question


def test_depths_of_a_grid_share_word_value_and_haystack():
    cfg = config()
    rows = [make_task("needle", cfg, "validation", 300, d).eval_batches(2, 1)[0] for d in (0, 1)]
    first, last = (bytes(r["inputs"][0].astype(np.uint8)) for r in rows)
    needle = re.match(rb"\nThe pass key for \w+ is \d+\.\n", first).group(0)
    assert last.index(needle) == last.index(b"\nWhat is") - len(needle)
    assert first[len(needle) :].startswith(last[: last.index(needle)])  # the same haystack


def test_too_short_lengths_and_bad_depths_are_refused():
    cfg = config()
    shortest = longest_sample_bytes("multikey", cfg.eval.task_params) - 1
    make_task("multikey", cfg, "validation", shortest)
    with pytest.raises(ValueError, match=rf"eval.task_lengths holds {shortest - 1}.*>= {shortest}"):
        make_task("multikey", cfg, "validation", shortest - 1)
    with pytest.raises(ValueError, match=r"eval.depths holds 1.5"):
        make_task("needle", cfg, "validation", 300, 1.5)
    with pytest.raises(ValueError, match=r"'mqar'"):
        kvlab.data.TaskDataset("mqar", cfg.data, cfg.eval.task_params, "validation", 300)


def test_the_tasks_are_checked_against_their_lengths_and_the_model():
    """check_tasks, as kvlab.validate_config runs it."""
    cfg = kvlab.validate_config(kvlab.base_config("tiny"))
    cfg.eval.tasks = ("needle", "multikey")  # multikey's 4 pass keys do not fit 128 bytes
    with pytest.raises(ValueError, match=r"^eval.seq_len=0 gives 'multikey' 128 tokens.*up to 2"):
        kvlab.validate_config(cfg)
    cfg.eval.task_lengths = (64, 512)
    with pytest.raises(ValueError, match=r"^eval.task_lengths=\(64, 512\) gives 'needle' 64"):
        kvlab.validate_config(cfg)
    cfg.eval.task_lengths = (512, 1024)
    kvlab.validate_config(cfg)
    cfg.eval.task_params.num_keys = 49  # more than the words keys are drawn from
    cfg.eval.task_lengths = (4096,)
    with pytest.raises(ValueError, match=r"^eval.task_params.num_keys=49 exceeds the 48"):
        kvlab.validate_config(cfg)
    cfg.eval.task_params.num_keys = 4
    cfg.eval.tasks = ("mqar",)
    cfg.data.mqar.vocab_size = 512  # above the model's 256 ids
    with pytest.raises(ValueError, match=r"^data.mqar.vocab_size=512 exceeds model.vocab_size"):
        kvlab.validate_config(cfg)
    # A model trained on MQAR ids below 256 cannot read the text tasks' bytes.
    mqar = kvlab.base_config("tiny")
    mqar.data.source = "mqar"
    mqar.data.mqar.vocab_size = mqar.model.vocab_size = 64
    mqar.eval.tasks, mqar.eval.task_lengths = ("mqar", "needle"), (512,)
    with pytest.raises(ValueError, match=r"^eval.tasks=\('mqar', 'needle'\) holds 'needle'"):
        kvlab.validate_config(mqar)


def test_mqar_runs_longer_than_training():
    cfg = config()
    batch = make_task("mqar", cfg, "validation", 4 * cfg.train.seq_len).eval_batches(2, 1)[0]
    assert batch["inputs"].shape == (2, 4 * cfg.train.seq_len)
    assert (batch["weights"].sum(axis=1) == cfg.data.mqar.num_pairs).all()


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A data section reading a small text file through a byte-level BPE tokenizer."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    words = "the cache holds keys and values of every token seen so far".split()
    text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(3000))
    (folder / "corpus.txt").write_text(text)
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([text, "The pass key for 12345 67890"], trainer)
    backend.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("task", TEXT_TASKS)
def test_tokenized_tasks_weight_the_value_tokens(tokenized, task):
    cfg = kvlab.base_config("tiny")
    cfg.data.update(source="text", path=str(tokenized / "corpus.txt"), tokenizer=str(tokenized))
    cfg.model.vocab_size = 400
    cfg.eval.task_params.update(PARAMS)
    cfg = kvlab.validate_config(cfg)
    data = make_task(task, cfg, "validation", 256, 0.5)
    batch = data.eval_batches(2, 1)[0]
    tokenizer = data.tokenizer
    assert batch["inputs"].shape == (2, 256) and batch["inputs"].max() < tokenizer.vocab_size
    for inputs, targets, weights in zip(
        batch["inputs"], batch["targets"], batch["weights"], strict=True
    ):
        first = int(np.argmax(weights > 0))
        context = tokenizer.decode(inputs[: first + 1])
        asked = "".join(answer_of(context, task))
        assert tokenizer.decode(targets[weights > 0]).replace(", ", "") == asked
        # every weighted token is a digit token of the answer, nothing else
        assert all(tokenizer.decode([t]).isdigit() for t in targets[weights > 0])
