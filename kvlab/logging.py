"""Experiment logging to Weights & Biases, and reading offline runs back.

    with Run(cfg.wandb, name="mha", config=cfg.to_dict(), workdir="runs/mha") as run:
        run.log({"train/loss": 1.2, "train/tokens_per_s": 1e4}, step=10)
        run.summary({"eval/ppl": 12.3})
        run.table("results", columns=["bits", "ppl"], rows=[[16, 12.3], [4, 12.9]])
        run.image("pareto", "runs/mha/pareto.png")
    logged = read_offline_run(run.dir)  # what the offline run wrote, no network

`cfg.wandb` (kvlab/config.py) picks the mode: 'offline' writes the run under
`workdir/wandb/offline-run-<time>-<id>/` for a later `wandb sync`, 'online'
streams it to the W&B server, and 'disabled' makes every method a no-op that
never imports wandb, so kvlab imports and runs without it.

An offline run keeps everything it logged in one file, `run-<id>.wandb`: a
LevelDB-log-format stream of `wandb_internal_pb2.Record` protobufs. wandb 0.31
ships no Python reader for it (its reader lives in the Go `wandb-core`), so
`read_offline_run` decodes it here with wandb's own protobuf classes. Offline,
wandb writes no `config.yaml` or `wandb-summary.json`; only logged media
(`files/media/table/*.table.json`, `files/media/images/*.png`) sit beside it.
wandb also stages a copy of each logged table for `wandb sync` under
`$WANDB_DATA_DIR/artifacts/staging` (default ~/.local/share/wandb), outside workdir.
"""

from __future__ import annotations

import json
import os
import struct
import time
import warnings
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvlab.config import WANDB_MODES

# Settings that keep wandb's console output out of training progress bars.
# `silent` still prints warnings (e.g. a dropped out-of-order step); online runs
# stay `quiet` instead so the run's URL is printed once.
_QUIET = {"offline": dict(silent=True, console="off"), "online": dict(quiet=True, console="off")}
# An offline run is for checking results locally, so it skips what only the W&B
# web page shows: system-metric sampling (a `wandb-symon` process per run), git,
# machine and pip-freeze metadata. This cuts a later run's init from ~0.1 s to ~15 ms.
_OFFLINE_LEAN = dict(
    x_disable_stats=True,
    x_disable_meta=True,
    x_disable_machine_info=True,
    x_save_requirements=False,
    disable_git=True,
)


class Run:
    """One W&B run; a no-op when `wandb_cfg.mode == 'disabled'`.

    Args:
      wandb_cfg: the config's `wandb` section: mode ('offline'|'online'|'disabled'),
        project, group ('' = none) and tags.
      name: the run's display name.
      config: the run's full config (a dict, or a ConfigDict, stored as its dict).
      workdir: the folder wandb writes under (`workdir/wandb/...`); created.
      job_type: what the run does ('train', 'eval', 'sweep', ...).
      group: overrides `wandb_cfg.group` (a sweep groups its runs by sweep name).

    Each Run is its own wandb run (`reinit='create_new'`), so runs made one after
    another in one process never share metrics; finish each (or use `with`).
    `dir` is the local run folder (`workdir/wandb/offline-run-...` offline), or
    None when disabled.
    """

    def __init__(
        self,
        wandb_cfg: Mapping[str, Any],
        name: str,
        config: Mapping[str, Any] | None,
        workdir: str | os.PathLike,
        job_type: str = "train",
        group: str | None = None,
    ):
        mode = wandb_cfg["mode"]
        if mode not in WANDB_MODES:
            raise ValueError(
                f"wandb.mode={mode!r} is not supported: use one of {', '.join(WANDB_MODES)}"
            )
        self.mode = mode
        self.dir: str | None = None
        self._run = None
        self._finished = False
        if mode == "disabled":
            return

        if mode == "offline":
            # wandb-core reports its own crashes to W&B unless told not to; an
            # offline run should send nothing. Read when the service starts.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        if hasattr(config, "to_dict"):  # an ml_collections.ConfigDict
            config = config.to_dict()
        Path(workdir).mkdir(parents=True, exist_ok=True)
        settings = dict(_QUIET[mode], **(_OFFLINE_LEAN if mode == "offline" else {}))
        self._run = wandb.init(
            mode=mode,
            project=wandb_cfg["project"],
            group=group or wandb_cfg["group"] or None,
            tags=list(wandb_cfg["tags"]),
            name=name,
            job_type=job_type,
            config=dict(config or {}),
            dir=str(workdir),
            reinit="create_new",
            settings=wandb.Settings(**settings),
        )
        self.dir = self._run.settings.sync_dir

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Logs one history row; `step` must not decrease between calls."""
        if self._run is not None:
            self._run.log(dict(metrics), step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Sets the run's summary values (its final numbers)."""
        if self._run is not None:
            self._run.summary.update(dict(values))

    def table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Logs a wandb.Table under `key` at the current step.

        That is the row of the last `log(..., step=s)` while it is open; a table or
        image logged there closes it, so the next one lands in row s + 1.
        """
        if self._run is not None:
            import wandb

            table = wandb.Table(columns=list(columns), data=[list(row) for row in rows])
            self._run.log({key: table})

    def image(self, key: str, path: str | os.PathLike) -> None:
        """Logs the image file at `path` (png, jpg, ...) under `key`, at the step `table` would."""
        if self._run is None:
            return
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"image {key!r}: {str(path)!r} is not a file: save the figure before logging it"
            )
        import wandb

        self._run.log({key: wandb.Image(str(path))})

    def finish(self, exit_code: int = 0) -> None:
        """Closes the run; a nonzero `exit_code` marks it failed. Safe to call twice."""
        if self._run is not None and not self._finished:
            self._run.finish(exit_code=exit_code)
            if self.mode == "offline":  # so read_offline_run(run.dir) sees the whole run
                _wait_until_written(Path(self._run.settings.sync_file))
        self._finished = True

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


# ---------------------------------------------------------------------------
# Reading an offline run


def read_offline_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """What an offline run logged, read from its `run-<id>.wandb` file.

    Args:
      run_dir: the run folder (`Run.dir`, `.../wandb/offline-run-...`) or its
        `.wandb` file.

    Returns a dict with
      config: the logged config (without wandb's own `_wandb` entry);
      history: one dict per logged step, with `_step`, `_runtime`, `_timestamp`
        and the metrics (nested dicts as logged; media as wandb's file references);
      summary: the final summary (without `_wandb`);
      tables: key -> {"columns": [...], "data": [[...], ...]}, the last table logged
        under each key, read from the run's `files/media/table/*.table.json`;
      images: [{"key", "step", "path"}, ...], every image logged, oldest first;
      exit_code: 0 for a run that finished cleanly, nonzero for a failed one,
        None when the run never finished (still running, or killed);
      id, name, project, group, job_type, tags.
    """
    path = Path(run_dir)
    if path.is_dir():
        found = sorted(path.glob("run-*.wandb"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"run_dir={str(run_dir)!r} holds {len(found)} run-*.wandb files, not one: "
                f"pass a wandb offline-run-* folder (Run.dir) or the .wandb file itself"
            )
        path = found[0]
    files_dir = path.parent / "files"

    out: dict[str, Any] = dict(
        config={}, history=[], summary={}, tables={}, images=[], exit_code=None
    )
    for record in _read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(
                id=run.run_id,
                name=run.display_name,
                project=run.project,
                group=run.run_group,
                job_type=run.job_type,
                tags=list(run.tags),
            )
            _apply_updates(out["config"], run.config.update, run.config.remove)
        elif kind == "config":
            _apply_updates(out["config"], record.config.update, record.config.remove)
        elif kind == "summary":
            _apply_updates(out["summary"], record.summary.update, record.summary.remove)
        elif kind == "history":
            row: dict[str, Any] = {}
            _apply_updates(row, record.history.item, ())
            out["history"].append(row)
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    out["config"].pop("_wandb", None)
    out["summary"].pop("_wandb", None)

    for row in out["history"]:
        for key, value in row.items():
            media_type = value.get("_type") if isinstance(value, dict) else None
            if media_type == "table-file":
                table = json.loads((files_dir / value["path"]).read_text())
                out["tables"][key] = {"columns": table["columns"], "data": table["data"]}
            elif media_type == "image-file":
                image = {"key": key, "step": row["_step"], "path": str(files_dir / value["path"])}
                out["images"].append(image)
    return out


def _apply_updates(target: dict, updates, removes) -> None:
    """Applies protobuf items (`key` or `nested_key` path, `value_json`) to `target`."""
    for item in updates:
        *parents, leaf = list(item.nested_key) or [item.key]
        node = target
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = json.loads(item.value_json)
    for item in removes:
        *parents, leaf = list(item.nested_key) or [item.key]
        node = target
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)


# The .wandb file: a 7-byte file header (b":W&B", magic 0xBEE1, version 0), then
# LevelDB log blocks of 32 KiB. A record is split into chunks that never cross a
# block; each chunk has a 7-byte header (CRC-32, length, type) and a block with
# fewer than 7 bytes left is zero-padded. wandb's CRC is zlib's CRC-32 over the
# type byte then the payload (LevelDB itself uses a masked CRC-32C).
_FILE_HEADER = struct.Struct("<4sHB")
_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION = b":W&B", 0xBEE1, 0
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK_SIZE = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _read_records(path: Path) -> Iterator[Any]:
    """Yields the `wandb_internal_pb2.Record` messages of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    for payload in _record_payloads(path.read_bytes(), path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _record_payloads(data: bytes, path: Path) -> Iterator[bytes]:
    """Yields each record's bytes, joined from its chunks.

    A chunk cut short at the end of the data (a run still writing, or killed)
    ends the stream; a chunk whose checksum fails raises ValueError.
    """
    header = data[: _FILE_HEADER.size]
    if len(header) < _FILE_HEADER.size or _FILE_HEADER.unpack(header) != (
        _FILE_IDENT,
        _FILE_MAGIC,
        _FILE_VERSION,
    ):
        raise ValueError(f"{str(path)!r} is not a wandb run file (bad header {header!r})")

    position, pending = _FILE_HEADER.size, b""
    while position + _CHUNK_HEADER.size <= len(data):
        left_in_block = _BLOCK_SIZE - position % _BLOCK_SIZE
        if left_in_block < _CHUNK_HEADER.size:  # zero padding up to the next block
            position += left_in_block
            continue
        checksum, length, kind = _CHUNK_HEADER.unpack_from(data, position)
        start = position + _CHUNK_HEADER.size
        payload = data[start : start + length]
        if len(payload) < length:
            return
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != checksum:
            raise ValueError(f"{str(path)!r}: chunk at byte {position} fails its checksum")
        position = start + length

        if kind in (_FULL, _FIRST):
            pending = payload
        elif kind in (_MIDDLE, _LAST):
            pending += payload
        if kind in (_FULL, _LAST):
            yield pending


def _wait_until_written(path: Path, timeout_s: float = 10.0) -> None:
    """Waits until the run's last record, its exit, is in its .wandb file.

    `wandb.Run.finish` returns once wandb-core has handled the exit, but core
    writes the file's buffered tail only when it closes the run's stream, which
    it does after finish returns (it is told to without waiting for a reply).
    Reading the file in that gap, a few ms, misses the run's last records.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size > _FILE_HEADER.size:
            last = deque(_record_payloads(path.read_bytes(), path), maxlen=1)
            record = wandb_internal_pb2.Record()
            record.ParseFromString(last[0] if last else b"")
            if record.HasField("exit"):
                return
        time.sleep(0.005)
    warnings.warn(
        f"{str(path)!r} has no exit record {timeout_s} s after the run finished: "
        f"wandb-core may still be writing it; read it again later",
        stacklevel=3,
    )
