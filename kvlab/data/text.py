"""Byte corpora: the Python standard library's sources ('stdlib') or local files ('text').

Tokens are raw bytes (vocab 256) unless data.tokenizer names a real model's
tokenizer (kvlab/data/tokenizer.py: the same files, splits and draws over its
token ids). A sample is a window of T + 1
consecutive bytes inside one file, never across a file boundary:

    inputs  = window[:-1]   int32[B, T]
    targets = window[1:]    int32[B, T]    targets[:, t] follows inputs[:, t]
    weights = 1.0           float32[B, T]  every target counts

Sources. 'stdlib' is every `*.py` file under `sysconfig.get_paths()["stdlib"]`
(recursive, outside any site-packages / dist-packages folder), so its content
depends on the Python version (`describe()` records it). 'text' is
`data.path`: one file, or a folder of which every file counts (recursive,
skipping hidden files and folders, names starting with '.'). Empty files are
ignored; anything else that is not a regular file (a FIFO, socket, device or
broken link), as data.path or inside its folder, is refused, since reading it
could block forever.

Splits. A folder is split by file, so no file is in two splits: files are
ordered by the sha1 hex digest of their path relative to the root (ties by
path), the first max(1, round(5% of n)) are 'test', the next as many
'validation', the rest 'train'. The order does not depend on which other files
exist, so adding files moves few of the old ones between splits. A folder needs
at least 3 non-empty files. A single file is split by contiguous byte ranges
instead: the first 90% is 'train', the next 5% 'validation', the last 5%
'test' (each range is then treated as a file of its own).

Sampling. `batch(step, batch_size, seed)` draws window starts uniformly over
every valid start of the split (a file of length n >= T + 1 has n - T of them),
from a generator seeded by (seed, step, split): the same arguments always give
the same batch, so a resumed run sees the batches an uninterrupted run saw.
`batch(..., rows=)` gives only some rows of that batch, reading only their
windows: each host of a multi-host run reads the rows its devices hold
(kvlab/train/loop.py `host_batch`).
`eval_batches(batch_size, num_batches)` takes the split's windows at stride T
from the start of each file, in file order (consecutive windows share one byte,
so each byte after a file's first is a target exactly once; a tail shorter
than T + 1 bytes is dropped). With more windows than batch_size * num_batches
it keeps that many evenly spaced ones; with fewer it returns as many full
batches as there are, or one smaller batch when there are fewer than
batch_size windows, and warns with the counts.

Each corpus is read once per process (cached by source and path; edits to the
files after that are not seen) and its splits are held as one uint8 array each,
from which batches are gathered by indexing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import stat
import sysconfig
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from kvlab.config import BYTE_VOCAB_SIZE

SPLITS = ("train", "validation", "test")
HELD_OUT_FRACTION = 0.05  # of the files (folder) or bytes (single file) in each of test, validation
MIN_FOLDER_FILES = 3  # one file per split at least

# A batch: inputs int32[B, T], targets int32[B, T], weights float32[B, T].
Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class SplitBytes:
    """One split of a corpus: its files concatenated into one array.

    tokens   uint8[N]    the bytes of every file, one after another
    offsets  int64[F+1]  file f is tokens[offsets[f]:offsets[f + 1]]
    names    F strings   each file's path relative to the corpus root
    """

    tokens: np.ndarray
    offsets: np.ndarray
    names: tuple[str, ...]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def batch_from_windows(windows: np.ndarray) -> Batch:
    """inputs, targets and unit weights from token windows of shape [B, T + 1]."""
    windows = windows.astype(np.int32)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    return dict(inputs=inputs, targets=targets, weights=np.ones(inputs.shape, np.float32))


def decode_bytes(tokens: Sequence[int]) -> str:
    """Byte tokens as UTF-8 text (errors='replace'); an id past the byte values (a
    model whose vocabulary is larger than BYTE_VOCAB_SIZE reading bytes) has no
    text and is shown as <id>, so nothing is dropped."""
    text, run = [], bytearray()
    for token in tokens:
        if 0 <= token < BYTE_VOCAB_SIZE:
            run.append(token)
            continue
        text.append(run.decode(errors="replace") + f"<{token}>")
        run = bytearray()
    return "".join(text) + run.decode(errors="replace")


# ---------------------------------------------------------------------------
# Finding and splitting the files


def _walk(root: str, skip_dir, keep_file) -> list[str]:
    """Paths relative to `root` (with '/') of the files kept, in no particular order.

    Every directory entry that is not a folder counts as a file here, links
    and FIFOs included: `read_regular` refuses what is not a regular file.
    """
    found = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]  # os.walk then skips them
        for name in filenames:
            if keep_file(name):
                path = os.path.join(folder, name)
                found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return found


def stdlib_files(root: str) -> list[str]:
    """Every *.py regular file under the stdlib folder `root`, outside installed packages."""
    names = _walk(
        root,
        skip_dir=lambda name: name in ("site-packages", "dist-packages"),
        keep_file=lambda name: name.endswith(".py"),
    )
    return [name for name in names if os.path.isfile(os.path.join(root, name))]


def folder_files(root: str) -> list[str]:
    """Every file under `root` (regular or not: reading refuses the others),
    skipping hidden files and folders."""
    hidden = lambda name: name.startswith(".")
    return _walk(root, skip_dir=hidden, keep_file=lambda name: not hidden(name))


def split_files(names: list[str]) -> dict[str, list[str]]:
    """Assigns files to splits by the sha1 of their relative path (see the module docstring)."""
    digest = lambda name: hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()
    ordered = sorted(names, key=lambda name: (digest(name), name))
    held_out = max(1, round(HELD_OUT_FRACTION * len(ordered)))
    return {
        "test": ordered[:held_out],
        "validation": ordered[held_out : 2 * held_out],
        "train": ordered[2 * held_out :],
    }


def split_bytes(length: int) -> dict[str, tuple[int, int]]:
    """The [start, end) byte range of each split of a single file of `length` bytes."""
    train_end = int(length * (1 - 2 * HELD_OUT_FRACTION))
    validation_end = int(length * (1 - HELD_OUT_FRACTION))
    return {
        "train": (0, train_end),
        "validation": (train_end, validation_end),
        "test": (validation_end, length),
    }


def _concatenate(contents: list[bytes], names: list[str]) -> SplitBytes:
    offsets = np.zeros(len(contents) + 1, np.int64)
    np.cumsum([len(c) for c in contents], out=offsets[1:])
    tokens = np.frombuffer(b"".join(contents), np.uint8)  # read-only: nothing may edit the corpus
    return SplitBytes(tokens=tokens, offsets=offsets, names=tuple(names))


_NOT_REGULAR = {
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISDIR: "a folder",
}


def read_regular(path: str, what: str, fix: str) -> bytes:
    """The bytes of the regular file at `path`; ValueError for anything else.

    Opened without blocking and checked on the open descriptor, so a FIFO
    (whose read would wait for a writer) is refused, not read, even when it
    replaced a regular file after the folder was listed. `what` names the path
    in the error ("data.path='corpus/x'") and `fix` says what to do.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ValueError(f"{what} is a broken link or vanished while reading: {fix}") from None
    with os.fdopen(descriptor, "rb") as file:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _NOT_REGULAR.items() if test(mode)), "not a file")
            raise ValueError(f"{what} is {kind}, not a regular file: {fix}")
        return file.read()


def _read(root: str, names: list[str], what: str) -> dict[str, bytes]:
    """Each file's bytes; `what` names the folder in errors."""
    contents = {}
    for name in names:
        path = os.path.join(root, name)
        contents[name] = read_regular(
            path,
            f"{path!r} in {what}",
            fix="remove it from the folder, or hide it (names starting with '.' are skipped)",
        )
    return contents


@functools.lru_cache(maxsize=8)
def load_corpus(source: str, path: str) -> dict[str, SplitBytes]:
    """The three splits of a byte corpus, read once per (source, path) and shared."""
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return _load_folder(
            root,
            stdlib_files(root),
            what=f"data.source='stdlib' (the *.py files under {root!r})",
            fix="use data.source='text' with data.path set to local files",
        )
    if not path:
        raise ValueError(
            "data.path='' is empty but data.source='text' reads a local file: "
            "set data.path to a text file or a folder of text files"
        )
    if not os.path.exists(path):
        raise ValueError(
            f"data.path={path!r} does not exist: set data.path to an existing file or folder"
        )
    if os.path.isdir(path):
        return _load_folder(
            path,
            folder_files(path),
            what=f"data.path={path!r}",
            fix="put text files in it, or point data.path at a single non-empty file",
        )
    content = read_regular(
        path, f"data.path={path!r}", fix="point data.path at a text file or a folder of them"
    )
    if not content:
        raise ValueError(
            f"data.path={path!r} is an empty file: point data.path at a file with text in it"
        )
    name = os.path.basename(path)
    return {
        split: _concatenate([content[start:end]], [name])
        for split, (start, end) in split_bytes(len(content)).items()
    }


def _load_folder(root: str, names: list[str], what: str, fix: str) -> dict[str, SplitBytes]:
    """Splits a folder by file; `what` names it and `fix` says what to do if it is empty."""
    contents = {name: content for name, content in _read(root, names, what).items() if content}
    if not contents:
        found = f"{len(names)} files, all empty" if names else "no files"
        raise ValueError(f"{what} holds no bytes ({found}): {fix}")
    if len(contents) < MIN_FOLDER_FILES:
        raise ValueError(
            f"{what} holds {len(contents)} non-empty files, but a folder is split by file into "
            f"train/validation/test and needs at least {MIN_FOLDER_FILES}: add files, or point "
            "data.path at a single file (split by byte ranges)"
        )
    return {
        split: _concatenate([contents[name] for name in split_names], split_names)
        for split, split_names in split_files(list(contents)).items()
    }


# ---------------------------------------------------------------------------
# The dataset


class ByteDataset:
    """Windows of seq_len + 1 bytes from one split of a byte corpus (see the module docstring).

    `files` is the split (a SplitBytes); `read_split` and `_gather` are what a
    dataset over other tokens of the same corpus changes (kvlab/data/tokenizer.py).
    """

    metric = "ppl"
    vocab_size = BYTE_VOCAB_SIZE
    unit = "bytes"  # what a token is, for messages

    def __init__(self, data: Mapping, split: str, seq_len: int):
        self.source, self.path = data["source"], data.get("path", "")
        self.split, self.seq_len = split, seq_len
        # Keyed by the absolute path, so a later change of directory cannot mix up corpora.
        key = os.path.abspath(self.path) if self.source == "text" and self.path else ""
        self.corpus = load_corpus(self.source, key)
        self.files = self.read_split(key)
        lengths = self.files.lengths
        longest = int(lengths.max(initial=0))
        if longest < seq_len + 1:
            fix = f"set train.seq_len <= {longest - 1}" if longest >= 2 else "use longer files"
            raise ValueError(
                f"train.seq_len={seq_len} needs windows of {seq_len + 1} {self.unit} inside one "
                f"file, but the longest {split} file of data.source={self.source!r} has "
                f"{longest} {self.unit}: {fix}"
            )
        # Valid window starts: file f has max(0, length - T) of them.
        self._starts_per_file = np.maximum(lengths - seq_len, 0)
        self._cumulative_starts = np.cumsum(self._starts_per_file)

    def read_split(self, key: str) -> SplitBytes:
        """This dataset's split of the corpus (`key`: the corpus path load_corpus was given)."""
        return self.corpus[self.split]

    def _gather(self, positions: np.ndarray) -> Batch:
        """The batch of the windows at corpus positions [B, T + 1]."""
        return batch_from_windows(self.files.tokens[positions])

    def _windows(self, starts: np.ndarray) -> Batch:
        # [B, T + 1] corpus positions, gathered in one indexing op
        return self._gather(starts[:, None] + np.arange(self.seq_len + 1))

    def batch(self, step: int, batch_size: int, seed: int, rows: np.ndarray | None = None) -> Batch:
        """A batch of uniformly drawn windows, a pure function of (seed, step, batch_size).

        With `rows` (indices into the batch), only those rows of it, in that
        order, gathering only their windows: one host's part of a multi-host batch."""
        rng = np.random.default_rng([seed, step, SPLITS.index(self.split)])
        draws = rng.integers(0, self._cumulative_starts[-1], batch_size)  # [B] over all starts
        if rows is not None:
            draws = draws[rows]
        files = np.searchsorted(self._cumulative_starts, draws, side="right")
        first_draw_of_file = self._cumulative_starts[files] - self._starts_per_file[files]
        return self._windows(self.files.offsets[files] + draws - first_draw_of_file)

    def eval_starts(self) -> np.ndarray:
        """Start positions of every evaluation window: stride T from each file's start."""
        windows_per_file = np.maximum(self.files.lengths - 1, 0) // self.seq_len
        files = np.repeat(np.arange(len(windows_per_file)), windows_per_file)
        first_window_of_file = np.cumsum(windows_per_file) - windows_per_file
        index_in_file = np.arange(len(files)) - first_window_of_file[files]
        return self.files.offsets[files] + index_in_file * self.seq_len

    def eval_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """Deterministic held-out batches (how many: see the module docstring); fewer
        windows than asked for are evaluated with a warning that gives the counts."""
        starts = self.eval_starts()
        held, wanted = len(starts), batch_size * num_batches
        if held > wanted:
            starts = starts[np.arange(wanted) * held // wanted]  # evenly spaced
        elif held >= batch_size:
            starts = starts[: held // batch_size * batch_size]  # whole batches only
        batches = [
            self._windows(starts[i : i + batch_size]) for i in range(0, len(starts), batch_size)
        ]
        if len(starts) < wanted:
            rows = "" if len(starts) % batch_size == 0 else f" of {len(starts)} windows"
            left = f", {held - len(starts)} left out to keep batches whole" * (held > len(starts))
            where = "the standard library" if self.source == "stdlib" else repr(self.path)
            warnings.warn(
                f"eval.num_batches={num_batches} x eval.batch_size={batch_size} asks for "
                f"{wanted} windows of {self.seq_len} {self.unit}, but the {self.split} split "
                f"of {where} holds {held}: evaluating {len(batches)} "
                f"batch{'es' * (len(batches) != 1)}{rows}{left}",
                stacklevel=2,
            )
        return batches

    def describe(self) -> dict:
        facts = dict(
            source=self.source,
            split=self.split,
            seq_len=self.seq_len,
            num_files=len(self.files.names),
            bytes=int(self.files.tokens.size),
            window_starts=int(self._cumulative_starts[-1]),  # distinct windows batch() draws from
        )
        if self.source == "stdlib":
            facts.update(python=platform.python_version(), path=sysconfig.get_paths()["stdlib"])
        else:
            facts.update(path=self.path, single_file=os.path.isfile(self.path))
        return facts
