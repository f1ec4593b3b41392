"""Experiment logging to Weights & Biases, and reading offline runs back.

    with Run(cfg.wandb, name="mha", config=cfg.to_dict(), workdir="runs/mha") as run:
        run.log({"train/loss": 1.2, "train/tokens_per_s": 1e4}, step=10)
        run.summary({"eval/ppl": 12.3})
        run.table("results", columns=["bits", "ppl"], rows=[[16, 12.3], [4, 12.9]])
        run.image("pareto", "runs/mha/pareto.png")
    logged = read_offline_run(run.dir)  # what the offline run wrote, no network

`cfg.wandb` (kvlab/config/schema.py) picks the mode: 'offline' writes the run under
`workdir/wandb/offline-run-<time>-<id>/` for a later `wandb sync`, 'online'
streams it to the W&B server, and 'disabled' makes every method a no-op that
never imports wandb, prints nothing and creates no folder, so kvlab runs without it.
On several hosts (jax.distributed) only process 0 logs: every other process's
Run is disabled, whatever the mode (`kvlab.sharding.is_primary`).

`Run(..., run_id=run.id)` resumes a run (wandb's `resume="allow"`). Online, the
new process appends to that run on the server. Offline (wandb 0.31), each Run
writes its own folder, `offline-run-<time>-<id>[-<n>]`, holding only what it
logged and marked as a resume of that id; `wandb sync` uploads a run id's
folders one after another, in order of start time, into one W&B run. Either
way, log explicit steps that continue from the last one the run logged.

An offline run keeps everything it logged in one file, `run-<id>.wandb`, which
`read_offline_run` reads with wandb's own reader, `wandb leet inspect --json`
(in wandb-core; wandb ships no Python reader). wandb-core writes a run's last
records only when it closes the run's stream, after `wandb.Run.finish` returns,
so `Run.finish` also shuts wandb-core down (`wandb.teardown`, which waits for it)
once no other Run is open; the next Run starts a fresh one. Offline, wandb
writes no `config.yaml` or `wandb-summary.json`; only logged media
(`files/media/table/*.table.json`, `files/media/images/*.png`) sit beside the
file. wandb also stages a copy of each logged table for `wandb sync` under
`$WANDB_DATA_DIR/artifacts/staging` (default ~/.local/share/wandb), outside workdir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvlab.config import WANDB_MODES
from kvlab.sharding import is_primary

# Settings that keep wandb's console output out of training progress bars.
# `silent` still prints warnings (e.g. a dropped out-of-order step); online runs
# stay `quiet` instead so the run's URL is printed once.
_QUIET = {"offline": dict(silent=True, console="off"), "online": dict(quiet=True, console="off")}
# An offline run is for checking results locally, so it skips what only the W&B
# web page shows: system-metric sampling (a `wandb-symon` process per run), git,
# machine and pip-freeze metadata. This cuts a run's init (wandb-core's start
# included) from ~0.33 s to ~0.23 s.
_OFFLINE_LEAN = dict(
    x_disable_stats=True,
    x_disable_meta=True,
    x_disable_machine_info=True,
    x_save_requirements=False,
    disable_git=True,
)

# Runs started and not yet finished; wandb-core shuts down when the last one finishes.
_open_runs: set[Run] = set()


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
      run_id: the id of a run to resume (a restarted training run passes the
        `id` of the run it continues); None starts a new run with a fresh id.

    Each Run is its own wandb run (`reinit='create_new'`), so runs made one after
    another in one process never share metrics; finish each (or use `with`).
    `dir` is the local run folder (`workdir/wandb/offline-run-...` offline), or
    None when disabled; `id` is the wandb run id, None when disabled.
    """

    def __init__(
        self,
        wandb_cfg: Mapping[str, Any],
        name: str,
        config: Mapping[str, Any] | None,
        workdir: str | os.PathLike,
        job_type: str = "train",
        group: str | None = None,
        run_id: str | None = None,
    ):
        mode = wandb_cfg["mode"]
        if mode not in WANDB_MODES:
            raise ValueError(
                f"wandb.mode={mode!r} is not supported: use one of {', '.join(WANDB_MODES)}"
            )
        if mode != "disabled" and not is_primary():  # several hosts: only process 0 logs
            mode = "disabled"
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
            id=run_id,
            resume="allow" if run_id is not None else None,
            reinit="create_new",
            settings=wandb.Settings(**settings),
        )
        _open_runs.add(self)
        self.dir = self._run.settings.sync_dir

    @property
    def id(self) -> str | None:
        """The wandb run id (pass it as `run_id` to resume this run); None when disabled."""
        return None if self._run is None else self._run.id

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
        """Closes the run; a nonzero `exit_code` marks it failed. Safe to call twice.

        When no other Run is open it shuts wandb-core down (finishing any wandb
        run opened outside kvlab) and so returns with the run's files complete;
        with another Run open, core writes its last records a moment after it returns.
        """
        if self._run is not None and not self._finished:
            self._run.finish(exit_code=exit_code)
            _open_runs.discard(self)
            if not _open_runs:
                import wandb

                wandb.teardown()
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
      resume: whether the run was started to resume run `id` (`run_id` given);
      id, name, project, group, job_type, tags.

    wandb's reader prints a nested key as its parts joined by '.', so a history or
    summary key that itself contains '.' comes back nested too. It prints NaN and
    ±inf as the strings 'NaN', 'Infinity' and '-Infinity', which come back as
    floats (wandb itself stores a NaN summary value as null: it comes back None).
    Whatever the reader reports about the file (the end of an incomplete file,
    corrupt data it skipped) is raised as a warning, and the rest is read.
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
        config={}, history=[], summary={}, tables={}, images=[], exit_code=None, resume=False
    )
    for record in _inspect(path):
        kind = record["type"]
        body = record.get(kind, {})
        if kind == "run":
            out.update(
                id=body["run_id"],
                name=body.get("display_name", ""),
                project=body.get("project", ""),
                group=body.get("run_group", ""),
                job_type=body.get("job_type", ""),
                tags=body.get("tags", []),
                resume=body.get("resume", False),
            )
            _apply(out["config"], body.get("config", {}), split_keys=False)
        elif kind == "config":
            _apply(out["config"], body, split_keys=False)
        elif kind == "summary":
            _apply(out["summary"], body)
        elif kind == "history":
            row: dict[str, Any] = {}
            _apply(row, {"update": body.get("item", {})})
            out["history"].append(row)
        elif kind == "exit":
            out["exit_code"] = body.get("exit_code", 0)
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


def _inspect(path: Path) -> list[dict[str, Any]]:
    """The records of a .wandb file, one dict each, as `wandb leet inspect --json` prints them."""
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        # The reader, like a run, reports its own crashes to W&B unless told not to.
        env={**os.environ, "WANDB_ERROR_REPORTING": "false"},
    )
    if result.returncode != 0:
        raise ValueError(
            f"wandb leet inspect could not read {str(path)!r} (exit {result.returncode}): "
            f"{result.stderr.strip()}"
        )
    for line in result.stderr.splitlines():
        if line.strip():
            warnings.warn(f"{str(path)!r}: {line.strip()}", stacklevel=3)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


# How wandb's reader prints the floats JSON has no number for.
_NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _apply(target: dict, change: Mapping[str, Any], split_keys: bool = True) -> None:
    """Applies a printed config/summary change (`update` map, `remove` list) to `target`.

    With `split_keys`, an update's key is a nested key's parts joined by '.'
    (history and summary); config keys are top-level keys whose values are whole.
    """
    for key, value in change.get("update", {}).items():
        *parents, leaf = key.split(".") if split_keys else [key]
        node = target
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = _NON_FINITE.get(value, value) if isinstance(value, str) else value
    for item in change.get("remove", []):
        *parents, leaf = item.get("nested_key") or [item["key"]]
        node = target
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)
