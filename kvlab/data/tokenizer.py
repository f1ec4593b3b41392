"""Text through a real model's tokenizer: HF `tokenizers` reading a tokenizer.json.

    tokenizer = load_tokenizer("path/to/model")   # a folder holding tokenizer.json, or the file
    ids = tokenizer.encode("The KV cache")         # list[int]; no special tokens added
    text = tokenizer.decode(ids)
    tokenizer.vocab_size                           # every id is below it (added tokens included)
    tokenizer.end_token                            # eos / <|endoftext|> id, or None

With `data.tokenizer` set, `make_dataset` gives a `TokenDataset` for the byte
sources 'stdlib' and 'text': the same corpus, the same split by file (or by
byte range of a single file), and windows drawn by the same pure function of
(seed, step) as `ByteDataset` (kvlab/data/text.py), over token ids instead of
bytes. Each file (or byte range) is decoded as UTF-8 with errors='replace' (an
invalid byte becomes U+FFFD) and tokenized whole, without special tokens;
windows never cross a file, so no separator is needed.

A batch carries one more array than a byte batch:

    target_bytes  int32[B, T]  UTF-8 bytes of text each target token adds

so an evaluation reports bits per byte honestly (kvlab/train/loop.py `summarize`).
Token i of a file adds the text from the end of token i - 1 to its own end, by
the character offsets the tokenizer reports (ends kept non-decreasing: two
tokens holding parts of one character give it to the first; the first token
also takes any text before it, the last any text after it, as a normalizer
may drop some). So a file's counts sum to the UTF-8 size of its decoded text,
and a window's to the text between the end of its first token and the end of
its last.

Memory: a split is tokenized once per process, on first use (cached by
source, path, tokenizer and split; tokenizer.json is read again when its
modification time changes), and held as two int32 arrays of its token count,
ids and byte counts: 8 bytes per token, about twice the text for a tokenizer
averaging 4 bytes per token, beside the byte corpus (1 byte per byte). Files
are encoded in groups of about `ENCODE_CHARS` characters, so the tokenizer's
per-token bookkeeping never holds more than one group at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
import tokenizers

from kvlab.data.text import Batch, ByteDataset, SplitBytes, load_corpus, read_regular

TOKENIZER_FILE = "tokenizer.json"
# Names a tokenizer's end-of-text token goes by, tried in order when no
# tokenizer_config.json beside tokenizer.json names its `eos_token`.
END_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
ENCODE_CHARS = 1 << 22  # characters of text per encode_batch call
_FIX = "set data.tokenizer to a folder holding tokenizer.json, or the file itself ('' for bytes)"


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A tokenizer.json loaded by HF `tokenizers`: text to token ids and back."""

    path: str  # the tokenizer.json read (absolute)
    backend: tokenizers.Tokenizer
    vocab_size: int  # every id it produces is below this (added tokens included)
    end_token: int | None  # the id ending a text (eos, <|endoftext|>), None if it defines none

    @classmethod
    def wrap(cls, backend: tokenizers.Tokenizer, path: str, end_token: int | None) -> Tokenizer:
        """A Tokenizer over `backend` built elsewhere (kvlab.load_gguf builds one from a
        GGUF file's metadata; `path` names that file)."""
        vocabulary = backend.get_vocab(with_added_tokens=True)
        return cls(path, backend, max(vocabulary.values(), default=-1) + 1, end_token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (no BOS/EOS added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_file(path: str) -> str:
    """The tokenizer.json `path` names (the file, or a folder holding it), absolute."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"data.tokenizer={path!r} names no tokenizer: {_FIX}")
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.exists(path):
            raise ValueError(
                f"data.tokenizer={os.path.dirname(path)!r} is a folder without "
                f"{TOKENIZER_FILE}: {_FIX}"
            )
    elif not os.path.exists(path):
        raise ValueError(f"data.tokenizer={path!r} does not exist: {_FIX}")
    return os.path.abspath(path)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `path` (data.tokenizer), read once per file version.

    Raises ValueError naming data.tokenizer when the path is missing, is not a
    regular file, or does not hold a tokenizer.json the library reads.
    """
    file = tokenizer_file(path)
    info = os.stat(file)
    return _load(file, info.st_mtime_ns, info.st_size)


def check_vocab_size(cfg: Mapping) -> None:
    """Raises ValueError unless model.vocab_size holds every id of data.tokenizer
    (read here: a missing or unreadable tokenizer is refused, naming data.tokenizer).
    kvlab.validate_config runs it for a config with a tokenizer."""
    needed = load_tokenizer(cfg["data"]["tokenizer"]).vocab_size
    vocab_size = cfg["model"]["vocab_size"]
    if vocab_size < needed:
        raise ValueError(
            f"model.vocab_size={vocab_size!r} is below the {needed} token ids of "
            f"data.tokenizer={cfg['data']['tokenizer']!r}: set model.vocab_size >= {needed}"
        )


@functools.lru_cache(maxsize=4)
def _load(file: str, mtime_ns: int, size: int) -> Tokenizer:
    del mtime_ns, size  # cache keys only: an edited file is read again
    what = f"data.tokenizer={file!r}"
    content = read_regular(file, what, fix=_FIX)
    try:
        backend = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
    except Exception as error:  # the library raises plain Exceptions for malformed files
        raise ValueError(
            f"{what} is not a tokenizer.json the tokenizers library reads ({error}): {_FIX}"
        ) from None
    vocabulary = backend.get_vocab(with_added_tokens=True)
    if not vocabulary:
        raise ValueError(f"{what} has an empty vocabulary: {_FIX}")
    return Tokenizer.wrap(backend, file, _end_token(file, backend))


def _end_token(file: str, backend: tokenizers.Tokenizer) -> int | None:
    """The eos_token of a tokenizer_config.json beside `file`, else the first of END_TOKEN_NAMES
    the vocabulary holds, else None."""
    names = list(END_TOKEN_NAMES)
    config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None  # optional metadata: a broken file leaves the known names
        if isinstance(eos, Mapping):  # {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        token = backend.token_to_id(name)
        if token is not None:
            return token
    return None


# ---------------------------------------------------------------------------
# Tokenized corpora


@dataclasses.dataclass(frozen=True)
class SplitTokens(SplitBytes):
    """One split of a corpus through a tokenizer: its files' tokens one after another.

    tokens       int32[N]    token ids of every file, one after another
    offsets      int64[F+1]  file f is tokens[offsets[f]:offsets[f + 1]]
    names        F strings   each file's path relative to the corpus root
    token_bytes  int32[N]    UTF-8 bytes of text each token adds (module docstring)
    """

    token_bytes: np.ndarray


def utf8_lengths(text: str) -> np.ndarray:
    """int64[len(text)]: the UTF-8 byte count of each character (1 to 4)."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    return 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)


def token_byte_counts(text: str, ends: np.ndarray) -> np.ndarray:
    """int32[n]: the UTF-8 bytes each of n tokens adds, from their character end offsets."""
    if not len(ends):
        return np.zeros(0, np.int32)
    ends = np.maximum.accumulate(ends)  # parts of one character: the first token has it
    ends[-1] = len(text)  # the last token takes any text after it
    char_starts = np.zeros(len(text) + 1, np.int64)  # byte position of each character
    np.cumsum(utf8_lengths(text), out=char_starts[1:])
    return np.diff(char_starts[ends], prepend=0).astype(np.int32)


def tokenize_split(files: SplitBytes, tokenizer: Tokenizer) -> SplitTokens:
    """Each file of `files` decoded as UTF-8 (errors='replace') and tokenized."""
    texts = [
        files.tokens[start:end].tobytes().decode("utf-8", errors="replace")
        for start, end in zip(files.offsets[:-1], files.offsets[1:], strict=True)
    ]
    ids, counts = [], []
    group, group_chars = [], 0
    for index, text in enumerate(texts):
        group.append(text)
        group_chars += len(text)
        if group_chars < ENCODE_CHARS and index + 1 < len(texts):
            continue
        for text_, encoding in zip(
            group, tokenizer.backend.encode_batch(group, add_special_tokens=False), strict=True
        ):
            ends = np.array([end for _, end in encoding.offsets], np.int64)
            ids.append(np.array(encoding.ids, np.int32))
            counts.append(token_byte_counts(text_, ends))
        group, group_chars = [], 0
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum([len(i) for i in ids], out=offsets[1:])
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    token_bytes = np.concatenate(counts) if counts else np.zeros(0, np.int32)
    tokens.flags.writeable = token_bytes.flags.writeable = False  # shared by every dataset
    return SplitTokens(tokens=tokens, offsets=offsets, names=files.names, token_bytes=token_bytes)


@functools.lru_cache(maxsize=8)
def tokenized_split(source: str, path: str, tokenizer: Tokenizer, split: str) -> SplitTokens:
    """One split of the corpus (source, path) through `tokenizer`, tokenized once and shared."""
    return tokenize_split(load_corpus(source, path)[split], tokenizer)


class TokenDataset(ByteDataset):
    """Windows of seq_len + 1 tokens from one split of a corpus through data.tokenizer.

    Drawn exactly as ByteDataset draws byte windows; batches add `target_bytes`.
    """

    unit = "tokens"

    def __init__(self, data: Mapping, split: str, seq_len: int):
        if data["source"] not in ("stdlib", "text"):
            raise ValueError(
                f"data.tokenizer={data['tokenizer']!r} applies to text, but "
                f"data.source={data['source']!r} makes its own token ids: set "
                "data.tokenizer='' or data.source='text' / 'stdlib'"
            )
        self.tokenizer = load_tokenizer(data["tokenizer"])
        self.vocab_size = self.tokenizer.vocab_size
        super().__init__(data, split, seq_len)

    def read_split(self, key: str) -> SplitTokens:
        return tokenized_split(self.source, key, self.tokenizer, self.split)

    def _gather(self, positions: np.ndarray) -> Batch:
        batch = super()._gather(positions)
        batch["target_bytes"] = self.files.token_bytes[positions[:, 1:]]  # [B, T]
        return batch

    def describe(self) -> dict:
        return {
            **super().describe(),
            "tokenizer": self.tokenizer.path,
            "vocab_size": self.vocab_size,
            "tokens": int(self.files.tokens.size),
            "bytes": int(self.files.token_bytes.sum()),
        }
