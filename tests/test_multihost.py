"""Several hosts (kvlab/sharding.py `initialize_distributed`, kvlab/train/loop.py
`host_batch`, kvlab/eval/ and kvlab/sweep/ on a mesh spanning processes).

The test that matters runs a real two-process job on localhost: two Python
processes of 4 forced host CPU devices each join through `jax.distributed`
(the coordinator on a free local port, gloo collectives between them, jax's
CPU default) into one (data=8) mesh, train a one-layer model three steps,
resume from step 2 and run step 3 again; a third process runs the same on
8 devices alone. The two must log the same losses (<= 1e-5: gloo sums in
another order) and leave checkpoints holding the same weights; process 1
writes no config, metrics or wandb files of its own. Each then runs a sweep
over the trained model through two caches (evaluation on the same mesh, each
host feeding its rows) and evaluates weights read by load_params: the rows
equal the single process's within 1e-5 and process 1 writes no sweep file.
All three start at once
and compile with XLA's optimisation lowered, as tests/test_sharding.py's
child does.

The rest run in this process, on its one device, compiling nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

import kvlab
from kvlab import sharding, train
from kvlab.data import make_dataset
from kvlab.sweep import RESULT_COLUMNS
from tests.helpers import ROOT, flags_with_devices, run_config, write_corpus

TOLERANCE = 1e-5  # float32: gloo's all-reduce sums the hosts' gradients in another order


def multihost_config(corpus: str):
    """The run every process of the job trains: one layer, 8 rows over (data=8)."""
    cfg = run_config(corpus, steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=3)
    cfg.train.update(checkpoint_every=2, lr=1e-4)  # lr: see tests/test_sharding.py
    cfg.model.update(num_layers=1, embed_dim=32, mlp_dim=64, num_kv_heads=2)
    cfg.mesh.data = 8
    cfg.wandb.mode = "offline"  # to see that only process 0 writes it
    return kvlab.validate_config(cfg)


def sweep_config(corpus: str):
    """(config, grid) of a sweep over the trained model (<sweep>/models/model, so
    train() finds it finished) through a 16-bit and an 8/4-bit cache, evaluated
    on (data=8) with 8 rows per batch, so each host scores its 4."""
    cfg = multihost_config(corpus)
    cfg.eval.update(batch_size=8, num_batches=1)
    cfg.wandb.mode = "disabled"
    cfg.sweep = ml_collections.ConfigDict(dict(name="multihost"))
    k8v4 = {"cache.k_bits": 8, "cache.v_bits": 4, "cache.residual": 0}
    return cfg, {"models": {"model": {}}, "caches": {"16bit": {}, "k8v4": k8v4}}


# Each process of the job: train (train() joins the hosts the environment names)
# the sweep's model, drop the last checkpoint, train again from step 2, run the
# sweep over it (recording the files it writes), report as one JSON line.
CHILD = """
import json, os, shutil, sys
import jax
from jax.experimental import multihost_utils
from kvlab import files, sharding, train
from kvlab.sweep import grid, plot, run, tables
from tests.test_multihost import multihost_config, sweep_config

corpus, sweep_dir = sys.argv[1:]
workdir = os.path.join(sweep_dir, "models", "model")
cfg = multihost_config(corpus)
_, first = train.train(cfg, workdir, progress=False)
if sharding.is_primary():
    shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))
if jax.process_count() > 1:
    multihost_utils.sync_global_devices("step 3 dropped")
state, again = train.train(cfg, workdir, progress=False)
placed = sharding.batch_sharding(sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh))
written = []
def recorded(write):
    def write_and_record(path, *args, **kwargs):
        written.append(os.path.relpath(path, sweep_dir))
        return write(path, *args, **kwargs)
    return write_and_record
for module in (files, grid, plot, run, tables):  # every writer of the sweep's files
    module.write_atomic = recorded(module.write_atomic)
rows = run.run_sweep(*sweep_config(corpus), sweep_dir, progress=False)
# scripts/eval.py's way in: weights read onto one device of each host, then spread.
from kvlab.data import make_dataset
from kvlab.eval import evaluate
batches = make_dataset(cfg.data, "validation", 16).eval_batches(8, 1)
mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)
loaded = evaluate(cfg.model, cfg.cache, train.load_params(workdir)[1], batches, chunk=8,
                  mesh=mesh, rules=rules)
report = dict(first=first, again=again, checksum=train.state_checksum(state),
              process=jax.process_index(), processes=jax.process_count(),
              devices=jax.device_count(), rows=sharding.process_rows(placed, 8).tolist(),
              sweep=rows, written=written, loaded=loaded)
print("REPORT " + json.dumps(report), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(corpus, workdir, devices: int, **env) -> subprocess.Popen:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_"))}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(corpus), str(workdir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **inherited,
            "PYTHONPATH": str(ROOT),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": flags_with_devices(devices),
            **env,
        },
    )


def _report(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, out[-3000:] + err[-6000:]
    (line,) = [line for line in out.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def _losses(history: list[dict]) -> dict:
    return {(h["step"], k): v for h in history for k, v in h.items() if k.endswith("/loss")}


def test_two_processes_train_as_one_process_of_eight_devices(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    one_sweep, two_sweep = tmp_path / "one_host", tmp_path / "two_hosts"
    one, two = [folder / "models" / "model" for folder in (one_sweep, two_sweep)]
    job = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2")
    processes = [
        _start(corpus, two_sweep, 4, **job, JAX_PROCESS_ID="0"),
        _start(corpus, two_sweep, 4, **job, JAX_PROCESS_ID="1"),
        _start(corpus, one_sweep, 8),
    ]
    try:
        host0, host1, alone = [_report(process) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()

    assert (alone["processes"], alone["devices"]) == (1, 8)
    assert [(h["process"], h["processes"], h["devices"]) for h in (host0, host1)] == [
        (0, 2, 8),
        (1, 2, 8),
    ]
    # Each host read the rows of the batch its 4 devices hold, and no other.
    assert (host0["rows"], host1["rows"], alone["rows"]) == (
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [*range(8)],
    )
    # The hosts agree with each other exactly (one replicated result), the
    # resumed step equals the uninterrupted one exactly (the same batch rows
    # on the same host), and the job equals one host of 8 devices.
    assert host0["checksum"] == host1["checksum"]
    assert _losses(host0["first"]) == _losses(host1["first"])
    for report in (host0, alone):
        resumed = _losses(report["again"])
        assert resumed and resumed.items() <= _losses(report["first"]).items()
    want, got = _losses(alone["first"]), _losses(host0["first"])
    assert got.keys() == want.keys() and len(got) == 4  # 3 training steps, 1 evaluation
    np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=TOLERANCE)

    # Only process 0 wrote the run's files: the same ones as the single process.
    def files(workdir):
        with open(workdir / "metrics.jsonl") as f:
            steps = [json.loads(line)["step"] for line in f]
        runs = [p for p in os.listdir(workdir / "wandb") if p.startswith("offline-run-")]
        return sorted(os.listdir(workdir)), steps, len(runs)

    assert files(two) == files(one)
    assert files(two)[1:] == ([1, 2, 3, 3], 2)  # one wandb run per train() call
    # The checkpoints both processes wrote (orbax, one shard file per process)
    # restore on this one device to the single process's weights.
    assert sorted(os.listdir(two / "checkpoints" / "2" / "default" / "array_metadatas")) == [
        "process_0",
        "process_1",
    ]
    for step in (2, 3):
        (_, got), (_, want) = train.load_params(str(two), step), train.load_params(str(one), step)
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE),
            got,
            want,
        )

    # The sweep over that model on (data=8): each host fed its 4 rows of every
    # evaluation batch, both report the same rows, equal to one host's within
    # 1e-5; process 0 alone wrote sweep.json, the slice, results.csv, pareto.png.
    assert host0["sweep"] == host1["sweep"]
    assert [r["cache"] for r in host0["sweep"]] == ["16bit", "k8v4"]
    for got, want in zip(host0["sweep"], alone["sweep"], strict=True):
        assert got.keys() == want.keys()
        # Differences of near-equal numbers round on their operands' scale: KL on the
        # float32 log-probabilities' (about log 256 = 5.5, so ~7e-7; 3e-9 seen), the
        # perplexity change on the perplexities'.
        atol = dict(kl_mean=1e-6, kl_p99=1e-6, delta_ppl=TOLERANCE * want["ppl"])
        for column in RESULT_COLUMNS:
            np.testing.assert_allclose(
                got[column], want[column], rtol=TOLERANCE, atol=atol.get(column, 0), err_msg=column
            )
    assert host1["written"] == [] and host0["written"] == alone["written"]
    assert host0["written"].count("results.csv") == 1
    assert sorted(os.listdir(two_sweep)) == sorted(os.listdir(one_sweep))
    assert os.listdir(two_sweep / "slices") == ["0-of-1.csv"]
    # Weights read onto one device per host (scripts/eval.py) evaluate as the sweep's.
    assert host0["loaded"] == host1["loaded"]
    np.testing.assert_allclose(host0["loaded"]["ppl"], host0["sweep"][0]["ppl"], rtol=TOLERANCE)


# ---------------------------------------------------------------------------
# This process: the environment, rows per host


def test_one_process_joins_nothing_unless_asked():
    cfg = kvlab.base_config("tiny")
    assert sharding.initialize_distributed(cfg.mesh, environ={}) is False
    assert sharding.initialize_distributed(None, environ={"JAX_PLATFORMS": "cpu"}) is False
    assert sharding.is_primary() and not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"JAX_NUM_PROCESSES": "2"}, r"JAX_NUM_PROCESSES=2 is set but JAX_PROCESS_ID is not"),
        ({"JAX_PROCESS_ID": "1"}, r"JAX_PROCESS_ID=1 is set but JAX_NUM_PROCESSES is not"),
        (
            {"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            r"JAX_NUM_PROCESSES='two' is not an integer >= 1",
        ),
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"},
            r"JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2: number the processes 0..1",
        ),
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            r"JAX_COORDINATOR_ADDRESS is not: set it to process 0's host:port",
        ),
    ],
)
def test_half_set_environments_name_what_is_missing(environ, message):
    with pytest.raises(ValueError, match=message):
        sharding.initialize_distributed(None, environ=environ)


def test_what_jax_is_given_and_its_refusals(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    environ = dict(JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES="4")
    assert sharding.initialize_distributed(None, environ={**environ, "JAX_PROCESS_ID": "3"})
    cfg = kvlab.base_config("tiny")
    cfg.mesh.distributed = True  # nothing set: jax detects SLURM, a TPU pod, ...
    assert sharding.initialize_distributed(kvlab.validate_config(cfg).mesh, environ={})
    assert calls == [
        dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3),
        dict(coordinator_address=None, num_processes=None, process_id=None),
    ]

    def found_nothing(**kw):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", found_nothing)
    with pytest.raises(ValueError, match=r"mesh.distributed=True asks for several hosts, but jax"):
        sharding.initialize_distributed(cfg.mesh, environ={})
    monkeypatch.undo()
    jax.devices()  # this process's backend is up: too late to join
    with pytest.raises(RuntimeError, match=r"JAX_COORDINATOR_ADDRESS=h:1 asks .* must be called"):
        sharding.initialize_distributed(None, environ={"JAX_COORDINATOR_ADDRESS": "h:1"})


@pytest.mark.parametrize("source", ["text", "mqar"])
def test_rows_of_a_batch_are_those_rows_of_the_whole_batch(tmp_path, source):
    corpus = write_corpus(tmp_path / "corpus", files=4)
    cfg = run_config(corpus, source=source, seq_len=32)
    data = make_dataset(cfg.data, "train", 32)
    whole = data.batch(5, 8, seed=3)
    for rows in (np.arange(4), np.arange(4, 8), np.array([1, 6])):
        part = data.batch(5, 8, seed=3, rows=rows)
        assert part.keys() == whole.keys()
        for name in whole:
            np.testing.assert_array_equal(part[name], whole[name][rows])


def test_one_process_reads_every_row_of_the_batch(tmp_path):
    cfg = run_config(write_corpus(tmp_path / "corpus", files=4), batch_size=4, seq_len=16)
    mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)
    placed = sharding.batch_sharding(mesh, rules)
    np.testing.assert_array_equal(sharding.process_rows(placed, 4), np.arange(4))
    data = make_dataset(cfg.data, "train", 16)
    batch = train.host_batch(data, 2, 4, 0, placed)
    for name, array in data.batch(2, 4, 0).items():
        assert batch[name].sharding == placed
        np.testing.assert_array_equal(np.asarray(batch[name]), array)
