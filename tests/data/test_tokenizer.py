"""Text through a real tokenizer.json: loading, token windows, byte counts, refusals, generate.py.

The tokenizer is a small byte-level BPE trained here by the tokenizers library
on the test's own words, so nothing is downloaded.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

import kvlab
from kvlab.data import SPLITS, load_corpus, load_tokenizer, make_dataset
from kvlab.data.tokenizer import token_byte_counts, tokenized_split
from kvlab.train import evaluate_forward, summarize, target_bytes
from tests.data.test_text import full_windows, write
from tests.test_scripts import run_script, user_error

WORDS = "the cat sat on a mat héllo wörld naïve café € 日本 def return import cache key value"
VOCAB_SIZE = 300  # 256 byte symbols, <|endoftext|> and merges
NUM_FILES = 6


def sentences(rng: np.random.Generator, count: int) -> str:
    words = WORDS.split()
    lines = [" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(count)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A folder holding tokenizer.json: byte-level BPE, lossless on any text."""
    folder = tmp_path_factory.mktemp("tokenizer")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([sentences(np.random.default_rng(0), 50)], trainer)
    backend.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """NUM_FILES text files of sentences (one in a subfolder); returns (root, {name: text})."""
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(1)
    texts = {}
    for i in range(NUM_FILES):
        name = f"sub/file{i}.txt" if i == 3 else f"file{i}.txt"
        texts[name] = sentences(rng, 20 + 5 * i)
        write(root / name, texts[name].encode())
    return root, texts


def token_config(path, tokenizer, seq_len=16, vocab_size=VOCAB_SIZE):
    cfg = kvlab.base_config("tiny")
    cfg.data.source = "text"
    cfg.data.path = str(path)
    cfg.data.tokenizer = str(tokenizer)
    cfg.model.vocab_size = vocab_size
    cfg.train.seq_len = seq_len
    return cfg


def contains(tokens: np.ndarray, window: np.ndarray) -> bool:
    """Whether `window` is a contiguous run of `tokens`."""
    if len(tokens) < len(window):
        return False
    runs = np.lib.stride_tricks.sliding_window_view(tokens, len(window))
    return bool((runs == window).all(axis=1).any())


# ---------------------------------------------------------------------------
# The tokenizer


def test_load_encodes_and_decodes_text_round_trip(tokenizer_dir):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    assert load_tokenizer(str(tokenizer_dir / "tokenizer.json")) is tokenizer  # read once
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.end_token == tokenizer.backend.token_to_id("<|endoftext|>")
    for text in ["the cat sat", "  héllo\n\nwörld 日本 €", "unseen: zebra 🦓!", ""]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("the cat sat on a mat")) < len("the cat sat on a mat")  # merges


def test_end_token_follows_tokenizer_config_eos(tmp_path, tokenizer_dir):
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    backend.add_special_tokens(["<stop>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).end_token == backend.token_to_id("<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<stop>"}})
    )
    os.utime(tmp_path / "tokenizer.json", ns=(0, 0))  # a new version: read again
    assert load_tokenizer(str(tmp_path)).end_token == backend.token_to_id("<stop>")


def test_byte_counts_follow_the_character_offsets():
    text = "a€b  "  # € is 3 UTF-8 bytes
    # tokens: 'a', two halves of '€' (same offsets), 'b' (trailing spaces trimmed off)
    ends = np.array([1, 2, 2, 3])
    np.testing.assert_array_equal(token_byte_counts(text, ends), [1, 3, 0, 3])
    assert token_byte_counts("", np.zeros(0, np.int64)).size == 0


# ---------------------------------------------------------------------------
# Token windows


def test_corpus_is_split_by_file_as_bytes_and_tokenized_per_file(corpus, tokenizer_dir):
    root, texts = corpus
    tokenizer = load_tokenizer(str(tokenizer_dir))
    key = os.path.abspath(root)
    names = []
    for split in SPLITS:
        tokens = tokenized_split("text", key, tokenizer, split)
        assert tokens.names == load_corpus("text", key)[split].names  # the byte split
        assert tokenized_split("text", key, tokenizer, split) is tokens  # tokenized once
        assert tokens.tokens.dtype == np.int32 and not tokens.tokens.flags.writeable
        for f, name in enumerate(tokens.names):
            start, end = tokens.offsets[f], tokens.offsets[f + 1]
            assert tokens.tokens[start:end].tolist() == tokenizer.encode(texts[name])
            assert tokens.token_bytes[start:end].sum() == len(texts[name].encode())
        names += tokens.names
    assert sorted(names) == sorted(texts)  # disjoint, and every file in one split


def test_batches_are_token_windows_of_their_split_and_pure_in_seed_and_step(corpus, tokenizer_dir):
    root, texts = corpus
    tokenizer = load_tokenizer(str(tokenizer_dir))
    data = token_config(root, tokenizer_dir).data
    encoded = {name: np.array(tokenizer.encode(text)) for name, text in texts.items()}
    key = os.path.abspath(root)
    for split in SPLITS:
        dataset = make_dataset(data, split, 16)
        assert dataset.vocab_size == VOCAB_SIZE and dataset.metric == "ppl"
        batch = dataset.batch(3, 32, seed=5)
        assert batch["inputs"].shape == batch["target_bytes"].shape == (32, 16)
        assert batch["inputs"].dtype == batch["target_bytes"].dtype == np.int32
        assert (batch["inputs"] >= 0).all() and (batch["inputs"] < VOCAB_SIZE).all()
        np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
        own = tokenized_split("text", key, tokenizer, split).names
        for window in full_windows(batch):
            holders = [name for name in texts if contains(encoded[name], window)]
            assert holders and set(holders) <= set(own)
        again = make_dataset(data, split, 16).batch(3, 32, seed=5)
        for name in batch:
            np.testing.assert_array_equal(batch[name], again[name])
        assert not np.array_equal(batch["inputs"], dataset.batch(4, 32, seed=5)["inputs"])
        assert not np.array_equal(batch["inputs"], dataset.batch(3, 32, seed=6)["inputs"])
    facts = make_dataset(data, "train", 16).describe()
    assert facts["tokenizer"] == str(tokenizer_dir / "tokenizer.json")
    train_names = tokenized_split("text", key, tokenizer, "train").names
    assert facts["bytes"] == sum(len(texts[name].encode()) for name in train_names)


def test_single_file_is_split_by_byte_range_then_tokenized(tmp_path, tokenizer_dir):
    text = sentences(np.random.default_rng(2), 200)
    write(tmp_path / "book.txt", text.encode())
    tokenizer = load_tokenizer(str(tokenizer_dir))
    corpus = load_corpus("text", os.path.abspath(tmp_path / "book.txt"))
    data = token_config(tmp_path / "book.txt", tokenizer_dir).data
    for split in SPLITS:
        part = corpus[split].tokens.tobytes().decode("utf-8", errors="replace")
        ids = np.array(tokenizer.encode(part))
        for window in full_windows(make_dataset(data, split, 8).batch(0, 16, 0)):
            assert contains(ids, window)


def test_bits_per_byte_divide_by_the_bytes_the_targets_cover(corpus, tokenizer_dir):
    root, _ = corpus
    cfg = token_config(root, tokenizer_dir)
    batches = make_dataset(cfg.data, "validation", 16).eval_batches(4, 2)
    covered = sum(float(b["target_bytes"].sum()) for b in batches)
    assert target_bytes(batches) == covered > sum(b["targets"].size for b in batches)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    result = evaluate_forward(kvlab.Transformer(cfg.model), params, batches)
    bits = result["bits_per_token"] * result["targets"]
    assert result["bits_per_byte"] == pytest.approx(bits / covered)
    assert result["bits_per_byte"] < result["bits_per_token"]  # tokens hold several bytes
    # Byte batches carry no counts: each target is one byte.
    plain = summarize({"nll": 8.0, "correct": 1.0, "weight": 4.0})
    assert plain["bits_per_byte"] == plain["bits_per_token"] == pytest.approx(2 / np.log(2))


# ---------------------------------------------------------------------------
# Refusals


def test_validation_refuses_a_vocabulary_smaller_than_the_tokenizer(corpus, tokenizer_dir):
    root, _ = corpus
    cfg = token_config(root, tokenizer_dir, vocab_size=256)
    with pytest.raises(ValueError) as error:
        kvlab.validate_config(cfg)
    message = str(error.value)
    assert message.startswith("model.vocab_size=256 is below the 300 token ids of data.tokenizer=")
    assert message.endswith("set model.vocab_size >= 300")
    kvlab.validate_config(token_config(root, tokenizer_dir))


@pytest.mark.parametrize(
    "contents, path, match",
    [
        # ({file: text} written in tmp_path, data.tokenizer inside tmp_path, message)
        ({}, "gone", r"data\.tokenizer='.*gone' does not exist: set data\.tokenizer to a folder"),
        ({}, ".", r"data\.tokenizer='.*' is a folder without tokenizer\.json"),
        (
            {"tokenizer.json": "{not json"},
            ".",
            r"data\.tokenizer='.*tokenizer\.json' is not a tokenizer\.json the tokenizers library",
        ),
    ],
    ids=["missing", "folder without the file", "unreadable"],
)
def test_a_missing_or_unreadable_tokenizer_is_refused(corpus, tmp_path, contents, path, match):
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    cfg = token_config(corpus[0], tmp_path / path)
    with pytest.raises(ValueError, match=match):
        kvlab.validate_config(cfg)
    with pytest.raises(ValueError, match=match):
        make_dataset(cfg.data, "train", 16)


def test_mqar_with_a_tokenizer_is_refused(tokenizer_dir):
    cfg = kvlab.base_config("tiny")
    cfg.data.source = "mqar"
    cfg.data.tokenizer = str(tokenizer_dir)
    match = r"data\.tokenizer='.*' applies to text, but data\.source='mqar' makes its own token"
    with pytest.raises(ValueError, match=match):
        kvlab.validate_config(cfg)
    with pytest.raises(ValueError, match=match):
        make_dataset(cfg.data, "train", 16)
    cfg.data = ml_collections.ConfigDict({**cfg.data.to_dict(), "tokenizer": None})
    with pytest.raises(ValueError, match=r"data\.tokenizer=None is not a string"):
        kvlab.validate_config(cfg)


# ---------------------------------------------------------------------------
# generate.py


def test_generate_takes_and_prints_text_through_the_tokenizer(tokenizer_dir, tmp_path):
    args = [
        "scripts/generate.py",
        "--config=configs/gqa.py:tiny",
        f"--config.data.tokenizer={tokenizer_dir}",
        "--max_new_tokens=4",
        "--prompt=the café",
        "--prompt=日本",
    ]
    result = run_script(*args, f"--config.model.vocab_size={VOCAB_SIZE}")
    lines = result.stdout.splitlines()
    assert lines[1].startswith("  [0] 'the café' -> '") and lines[2].startswith("  [1] '日本' -> '")
    assert "every token kept: 2 rows x" in result.stdout
    # The model must hold the tokenizer's ids: one line naming both numbers.
    refused = user_error(run_script(*args, check=False))
    assert refused.startswith("model.vocab_size=256 is below the 300 token ids")
