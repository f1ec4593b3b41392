"""Byte corpora: file splits, windows inside one file, determinism, evaluation windows, errors."""

import os
import platform
import signal
import sysconfig
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.data import SPLITS, load_corpus, make_dataset
from kvlab.data.text import decode_bytes, split_bytes, split_files

NUM_FILES = 12
# File i holds only bytes [16 i, 16 i + 16), so a window across two files is in neither.
ALPHABET = 16


def text_config(path, seq_len=16):
    cfg = kvlab.base_config("tiny")
    cfg.data.source = "text"
    cfg.data.path = str(path)
    cfg.train.seq_len = seq_len
    return cfg


def write(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """NUM_FILES files of different lengths with disjoint byte alphabets, some in subfolders,
    plus an empty file and hidden files (bytes 240..255) that must be skipped."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    contents = {}
    for i in range(NUM_FILES):
        name = f"sub{i % 3}/file{i}.txt" if i % 2 else f"file{i}.txt"
        content = rng.integers(ALPHABET * i, ALPHABET * (i + 1), 40 + 30 * i, np.uint8).tobytes()
        write(root / name, content)
        contents[name] = content
    write(root / "empty.txt", b"")
    write(root / ".hidden.txt", bytes(range(240, 256)) * 8)
    write(root / ".git" / "objects.txt", bytes(range(240, 256)) * 8)
    return root, contents


def owner(window: np.ndarray, contents: dict) -> str:
    """The one file whose bytes contain `window` (a window across two files is in none)."""
    (name,) = [
        name for name, content in contents.items() if window.astype(np.uint8).tobytes() in content
    ]
    return name


def split_of(name: str, root) -> str:
    corpus = load_corpus("text", os.path.abspath(root))
    (split,) = [split for split in SPLITS if name in corpus[split].names]
    return split


def full_windows(batch: dict) -> np.ndarray:
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)  # [B, T + 1]


# ---------------------------------------------------------------------------
# Splits


def test_folder_splits_are_disjoint_cover_every_visible_file_and_hold_five_percent(folder):
    root, contents = folder
    corpus = load_corpus("text", os.path.abspath(root))
    names = {split: set(corpus[split].names) for split in SPLITS}
    assert not names["train"] & names["validation"]
    assert not names["train"] & names["test"]
    assert not names["validation"] & names["test"]
    assert set().union(*names.values()) == set(contents)  # no empty or hidden file
    held_out = max(1, round(0.05 * NUM_FILES))
    assert len(names["test"]) == len(names["validation"]) == held_out
    for split in SPLITS:
        split_bytes_ = corpus[split]
        assert split_bytes_.tokens.tobytes() == b"".join(contents[n] for n in split_bytes_.names)
        assert not split_bytes_.tokens.flags.writeable


def test_split_assignment_depends_only_on_the_names():
    names = [f"dir/{i}.py" for i in range(100)]
    splits = split_files(names)
    assert split_files(names[::-1]) == splits
    assert [len(splits[s]) for s in ("test", "validation", "train")] == [5, 5, 90]
    # Adding files keeps the order of the old ones, so few of them change split.
    grown = split_files(names + [f"new/{i}.py" for i in range(10)])
    moved = [n for n in names if not any(n in grown[s] and n in splits[s] for s in SPLITS)]
    assert len(moved) <= 2


def test_stdlib_is_split_by_file_without_installed_packages():
    data = kvlab.base_config("tiny").data
    corpus = load_corpus("stdlib", "")
    names = [set(corpus[split].names) for split in SPLITS]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    every = set().union(*names)
    assert all(n.endswith(".py") for n in every)
    assert not any({"site-packages", "dist-packages"} & set(n.split("/")) for n in every)
    assert "os.py" in every
    facts = make_dataset(data, "validation", 128).describe()
    assert facts["python"] == platform.python_version()
    assert facts["path"] == sysconfig.get_paths()["stdlib"]
    assert facts["num_files"] == len(corpus["validation"].names)
    assert load_corpus("stdlib", "") is corpus  # read once per process


def test_single_file_is_split_by_byte_ranges(tmp_path):
    content = np.random.default_rng(2).integers(0, 256, 2048, np.uint8).tobytes()
    write(tmp_path / "book.txt", content)
    cfg = text_config(tmp_path / "book.txt", seq_len=8)
    corpus = load_corpus("text", os.path.abspath(tmp_path / "book.txt"))
    ranges = split_bytes(len(content))
    assert ranges == {"train": (0, 1843), "validation": (1843, 1945), "test": (1945, 2048)}
    for split, (start, end) in ranges.items():
        assert corpus[split].tokens.tobytes() == content[start:end]
        dataset = make_dataset(cfg.data, split, 8)
        for batch in [dataset.batch(0, 32, 0), *dataset.eval_batches(4, 2)]:
            for window in full_windows(batch).astype(np.uint8):
                assert window.tobytes() in content[start:end]
    assert make_dataset(cfg.data, "test", 8).describe()["single_file"]


# ---------------------------------------------------------------------------
# Training batches


@given(
    seq_len=st.integers(1, 39),  # the shortest file has 40 bytes
    step=st.integers(0, 10**6),
    seed=st.integers(0, 2**31),
    batch_size=st.integers(1, 64),
    split=st.sampled_from(SPLITS),
)
def test_batches_are_windows_inside_one_file_of_their_split(
    folder, seq_len, step, seed, batch_size, split
):
    root, contents = folder
    batch = make_dataset(text_config(root).data, split, seq_len).batch(step, batch_size, seed)
    assert batch["inputs"].shape == batch["targets"].shape == (batch_size, seq_len)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["weights"].dtype == np.float32 and (batch["weights"] == 1).all()
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    for window in full_windows(batch):
        assert split_of(owner(window, contents), root) == split


def test_batch_is_a_pure_function_of_seed_step_and_size(folder):
    root, _ = folder
    dataset = make_dataset(text_config(root).data, "train", 16)
    batch = dataset.batch(7, 8, seed=3)
    again = make_dataset(text_config(root).data, "train", 16).batch(7, 8, seed=3)
    for key in batch:
        np.testing.assert_array_equal(batch[key], again[key])
    assert not np.array_equal(batch["inputs"], dataset.batch(8, 8, seed=3)["inputs"])
    assert not np.array_equal(batch["inputs"], dataset.batch(7, 8, seed=4)["inputs"])


def test_windows_start_anywhere_a_window_fits(tmp_path):
    """Every valid start is drawn: a 10-byte file has windows of 4 bytes at 0..6."""
    for i in range(3):  # one file per split
        write(tmp_path / f"{i}.txt", bytes(range(10 * i, 10 * i + 10)))
    dataset = make_dataset(text_config(tmp_path).data, "train", 3)
    (name,) = load_corpus("text", os.path.abspath(tmp_path))["train"].names
    first = 10 * int(name.removesuffix(".txt"))
    starts = set()
    for step in range(20):
        starts |= set(dataset.batch(step, 16, 0)["inputs"][:, 0].tolist())
    assert starts == set(range(first, first + 7))


# ---------------------------------------------------------------------------
# Evaluation batches


def test_eval_batches_are_deterministic_and_from_their_split(folder):
    root, contents = folder
    for split in ("validation", "test"):
        with pytest.warns(UserWarning, match=r"asks for 12 windows .* evaluating 2 batches"):
            first = make_dataset(text_config(root).data, split, 16).eval_batches(4, 3)
            second = make_dataset(text_config(root).data, split, 16).eval_batches(4, 3)
        assert len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
            np.testing.assert_array_equal(a["targets"][:, :-1], a["inputs"][:, 1:])
            for window in full_windows(a):
                assert split_of(owner(window, contents), root) == split


def test_eval_windows_stride_seq_len_from_each_file_start(folder):
    """With room for all of them, evaluation covers every byte after a file's first once."""
    root, contents = folder
    seq_len = 16
    dataset = make_dataset(text_config(root).data, "train", seq_len)
    with pytest.warns(UserWarning, match=r"holds 128: evaluating 128 batches$"):
        batches = dataset.eval_batches(1, 10**6)
    names = load_corpus("text", os.path.abspath(root))["train"].names
    expected = [
        np.frombuffer(contents[name], np.uint8)[i * seq_len : i * seq_len + seq_len + 1]
        for name in names
        for i in range((len(contents[name]) - 1) // seq_len)
    ]
    assert len(batches) == len(expected)
    for batch, window in zip(batches, expected, strict=True):
        np.testing.assert_array_equal(full_windows(batch)[0], window)


@pytest.mark.parametrize(
    "batch_size, num_batches, sizes, said",
    [
        (2, 3, [2, 2, 2], None),  # more windows than asked for: evenly spaced ones
        (5, 2, [5, 5], None),  # exactly as many
        (4, 5, [4, 4], "evaluating 2 batches, 2 left out to keep batches whole"),  # fewer
        (16, 2, [10], "evaluating 1 batch of 10 windows"),  # fewer than one batch
    ],
)
def test_eval_batch_count_follows_the_windows_available(
    tmp_path, batch_size, num_batches, sizes, said
):
    rng = np.random.default_rng(1)
    for i in range(3):  # one file per split, each with 10 evaluation windows of 8 + 1 bytes
        write(tmp_path / f"{i}.txt", rng.integers(0, 256, 8 * 10 + 1, np.uint8).tobytes())
    dataset = make_dataset(text_config(tmp_path).data, "validation", 8)
    everything = full_windows(dataset.eval_batches(10, 1)[0])  # [10, 9], in file order
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = dataset.eval_batches(batch_size, num_batches)
    # Fewer than asked for is said, with the counts; as many or more is not.
    assert (
        [str(w.message) for w in caught] == []
        if said is None
        else [
            f"eval.num_batches={num_batches} x eval.batch_size={batch_size} asks for "
            f"{batch_size * num_batches} windows of 8 bytes, but the validation split of "
            f"{str(tmp_path)!r} holds 10: {said}"
        ]
    )
    assert [len(batch["inputs"]) for batch in batches] == sizes
    chosen = np.concatenate([full_windows(batch) for batch in batches])
    rows = [int(np.flatnonzero((everything == window).all(axis=1))[0]) for window in chosen]
    assert rows[0] == 0 and rows == sorted(set(rows))  # distinct, in order, from the first


# ---------------------------------------------------------------------------
# Errors


THREE_FILES = {"a.txt": 20, "b.txt": 20, "c.txt": 20}


@pytest.mark.parametrize(
    "files, path, split, seq_len, match",
    [
        # (files to write {name: bytes}, data.path in the folder or None for '', ...)
        pytest.param({}, None, "train", 16, r"data\.path='' is empty", id="empty path"),
        pytest.param({}, "gone.txt", "train", 16, r"data\.path=.*does not exist", id="missing"),
        pytest.param({}, ".", "train", 16, r"data\.path=.*no bytes \(no files\)", id="no files"),
        pytest.param(
            {"a.txt": 0, "b.txt": 0}, ".", "train", 16, r"data\.path=.*all empty", id="all empty"
        ),
        pytest.param(
            {"a.txt": 50, "b.txt": 50, "c.txt": 0},
            ".",
            "train",
            16,
            r"data\.path=.* 2 non-empty files.*add files, or point data\.path at a single file",
            id="two files",
        ),
        pytest.param({"a.txt": 0}, "a.txt", "train", 4, r"data\.path=.*empty file", id="empty"),
        pytest.param(
            THREE_FILES,
            ".",
            "test",
            20,
            r"train\.seq_len=20 .* longest test file .* 20 bytes: set train\.seq_len <= 19",
            id="seq_len over every file",
        ),
        pytest.param(
            {"a.txt": 100},
            "a.txt",
            "validation",
            16,
            r"train\.seq_len=16 .* longest validation file .* 5 bytes",
            id="seq_len over a single file's range",
        ),
        pytest.param(THREE_FILES, ".", "tests", 4, r"split='tests'", id="unknown split"),
    ],
)
def test_bad_data_raises_naming_the_field(tmp_path, files, path, split, seq_len, match):
    for name, size in files.items():
        write(tmp_path / name, b"x" * size)
    cfg = text_config("" if path is None else tmp_path / path)
    with pytest.raises(ValueError, match=match):
        make_dataset(cfg.data, split, seq_len)


def test_unknown_source_and_bad_seq_len_raise_naming_the_field():
    cfg = kvlab.base_config("tiny")
    with pytest.raises(ValueError, match=r"train\.seq_len=0 is below 1"):
        make_dataset(cfg.data, "train", 0)
    with pytest.raises(ValueError, match=r"train\.seq_len=16.0 is not an integer"):
        make_dataset(cfg.data, "train", 16.0)
    assert make_dataset(cfg.data, "train", np.int64(16)).seq_len == 16
    cfg.data.source = "wiki"
    with pytest.raises(ValueError, match=r"data\.source='wiki' is not supported"):
        make_dataset(cfg.data, "train", 16)


@pytest.fixture
def no_hang():
    """Fails a test that blocks (a FIFO opened for reading waits for a writer)."""

    def stuck(signum, frame):
        raise TimeoutError("reading the data blocked")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_as_data_path_is_refused(tmp_path, no_hang):
    os.mkfifo(tmp_path / "pipe")
    cfg = text_config(tmp_path / "pipe")
    with pytest.raises(ValueError, match=r"data\.path='.*pipe' is a FIFO, not a regular file"):
        make_dataset(cfg.data, "train", 16)


def test_a_fifo_or_broken_link_inside_the_data_folder_is_refused(tmp_path, no_hang):
    for name in THREE_FILES:
        write(tmp_path / "corpus" / name, b"x" * 100)
    (tmp_path / "corpus" / "sub").mkdir()
    os.mkfifo(tmp_path / "corpus" / "sub" / "pipe")
    cfg = text_config(tmp_path / "corpus")
    with pytest.raises(ValueError, match=r"sub/pipe' in data\.path=.* is a FIFO.*remove it"):
        make_dataset(cfg.data, "train", 16)
    os.remove(tmp_path / "corpus" / "sub" / "pipe")
    os.symlink(tmp_path / "nowhere", tmp_path / "corpus" / "sub" / "link")
    cfg = text_config(tmp_path / "corpus")
    with pytest.raises(ValueError, match=r"sub/link' in data\.path=.* is a broken link"):
        make_dataset(cfg.data, "train", 16)
    os.remove(tmp_path / "corpus" / "sub" / "link")
    os.mkfifo(tmp_path / "corpus" / "sub" / ".pipe")  # hidden files are skipped
    assert make_dataset(text_config(tmp_path / "corpus").data, "train", 16).seq_len == 16


@given(st.lists(st.integers(0, 600), max_size=40))
def test_decode_bytes_shows_every_id_past_the_bytes(tokens):
    text = decode_bytes(tokens)
    assert text.count("<") >= sum(t >= 256 for t in tokens)
    if all(t < 256 for t in tokens):
        assert text == bytes(tokens).decode(errors="replace")
    assert decode_bytes([104, 105, 300, 33]) == "hi<300>!"
