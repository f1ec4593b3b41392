"""Files kvlab writes for a later run to read, replaced whole or not at all.

    write_atomic("runs/gqa/metrics.jsonl", text)   # readers see the old file or the new one
    store_json("runs/gqa/config.json", config, fixed=("model", "data"), owner="a run")

`write_atomic` writes into a temporary file beside the target, flushes and
fsyncs it, renames it over the target (`os.replace`, atomic on POSIX) and
fsyncs the folder, so a run killed mid-write or a full disk leaves the old file
as it was; the temporary file is removed when anything fails. When the OS
refuses (disk full, a file-size limit, no permission, no folder) it raises
`WriteError`, an OSError whose message is one line naming the file, the OS's
reason and what to do (kvlab.cli prints it alone, exit status 74). `store_json`
is how a working directory remembers what it holds (a training run's config,
a sweep's grid): it refuses a different one, naming the section that differs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


class WriteError(OSError):
    """The OS refused a file kvlab writes: the disk is full, a file-size limit or
    the permissions forbid it, the folder is missing.

    `errno` and `strerror` are the OS's, `filename` the file kvlab was writing
    (the target, not a temporary file beside it); str() is one line naming the
    file, the reason and what to do. An OSError, so code that catches one still does.
    """

    def __init__(self, code: int | None, reason: str, filename: str, message: str):
        super().__init__(code, reason, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # pickled (multiprocessing) with the message, not OSError's args
        return type(self), (self.errno, self.strerror, self.filename, self.message)


def write_error(path: str | os.PathLike, error: OSError, outcome: str) -> WriteError:
    """The WriteError for `error`, met writing the file at `path`: '<path> was not
    written (<the OS's reason>): <what to do>, then run again; <outcome>', where
    `outcome` says what is kept (e.g. 'the file is as it was')."""
    path = os.path.abspath(os.fspath(path))
    reason = error.strerror or str(error) or type(error).__name__
    return WriteError(
        error.errno,
        reason,
        path,
        f"{path} was not written ({reason}): {remedy(error.errno, os.path.dirname(path))}, "
        f"then run again; {outcome}",
    )


# Out of space: on the disk, or in the user's quota (no EDQUOT on some platforms).
_NO_SPACE = tuple(getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name))


def remedy(code: int | None, folder: str) -> str:
    """What to do when the OS refuses, with error number `code`, a write into `folder`."""
    if code in _NO_SPACE:
        return f"free space on the disk holding {folder}"
    if code == errno.EFBIG:  # the process's file-size limit, or the file system's
        return f"free space on the disk holding {folder} or raise the file-size limit (ulimit -f)"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"make {folder} writable"
    if code == errno.ENOENT:
        return f"create the folder {folder}"
    return f"check the disk holding {folder} and its permissions"


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replaces the file at `path` with `data` (text is written as UTF-8), atomically.

    When the OS refuses to create, write, sync or rename the temporary file,
    raises WriteError naming `path`; the file at `path` is as it was."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"write_atomic writes str or bytes, not {type(data).__name__}")
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    # Hidden and unique, so neither a reader globbing the folder nor a second
    # writer sees it; created with the umask's permissions, as open() would.
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # never created, or the folder refuses this too
            os.unlink(temporary)
        if isinstance(error, OSError):
            outcome = "the file is as it was and finished work is kept"
            raise write_error(path, error, outcome) from error
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Makes the rename durable; skipped where folders cannot be opened (Windows)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def read_arrays(path: str) -> dict[str, np.ndarray] | str:
    """The arrays (as float32) of the .npz file at `path`, read once per version of
    the file (an artefact a run computed offline: codebooks, scales, filters), or
    the reason it cannot be read as such, for the caller's message."""
    try:
        info = os.stat(path)
    except OSError as error:
        return error.strerror or str(error)
    return _read_arrays(path, info.st_mtime_ns, info.st_size)


@functools.lru_cache(maxsize=16)
def _read_arrays(path: str, modified: int, size: int) -> dict[str, np.ndarray] | str:
    try:
        with np.load(path) as stored:
            return {name: np.asarray(stored[name], np.float32) for name in stored.files}
    except (OSError, ValueError, KeyError, AttributeError) as error:
        return str(error)


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value stored at `path`; ValueError naming the file when it does not parse."""
    with open(path) as file:
        text = file.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{os.fspath(path)!r} is not valid JSON ({error}): it was damaged or written by "
            "another program; restore it from a copy or start in a fresh directory"
        ) from None


def store_json(
    path: str | os.PathLike,
    value: Mapping[str, Any],
    *,
    fixed: Sequence[str],
    owner: str,
    normalize: Callable[[dict], dict] | None = None,
    write: bool = True,
) -> bool:
    """Records `value` (a dict of sections) at `path`; returns whether the file was written.

    A file already there must agree with `value` on every section named in
    `fixed`, else ValueError naming the folder, the section and the fix; its
    other sections are updated. An identical file is left untouched (its
    mtime and inode stay). `normalize` brings a stored value up to date before
    comparing (e.g. fields added to the schema since it was written); `owner`
    says what the folder holds ("a run", "a sweep"). With `write=False` it only
    checks (the hosts of a multi-host run other than the first, which writes).
    """
    value = json.loads(json.dumps(value))  # tuples as lists, as the file holds them
    if os.path.exists(path):
        stored = read_json(path)
        if normalize is not None:
            stored = normalize(stored)
        folder = os.path.dirname(os.path.abspath(path))
        for section in fixed:
            if stored.get(section) != value.get(section):
                raise ValueError(
                    f"{folder!r} holds {owner} with another {section} section (see {path}): "
                    f"use a fresh directory, or keep the {section} section stored there"
                )
        if stored == value:
            return False
    if not write:
        return False
    write_atomic(path, json.dumps(value, indent=2) + "\n")
    return True
