import atexit
import gc
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

# The tests compile many tiny programs and run each briefly: compiling is the
# time, so LLVM optimizes less and fusions are emitted by XLA:CPU's older
# elemental emitters, which compile a tiny model's step in 0.7-1.1 s against
# 1.1-1.7 s (XLA's HLO passes, fusion included, are the same; the subprocess
# tests have done this all along). Read at the backend's start, which comes
# after this file. KVLAB_TEST_XLA_FLAGS='' tests fully optimized code.
os.environ["XLA_FLAGS"] = " ".join(
    filter(
        None,
        [
            os.environ.get("XLA_FLAGS", ""),
            os.environ.get(
                "KVLAB_TEST_XLA_FLAGS",
                "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                " --xla_cpu_use_fusion_emitters=false",
            ),
        ],
    )
)

# Many tests, in both xdist workers and in the scripts' subprocesses, compile the
# same tiny models: one compilation cache for this run (JAX's persistent cache,
# every program kept) lets each be compiled once. The process that creates it
# removes it at exit; a run started with JAX_COMPILATION_CACHE_DIR set uses that.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="kvlab-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Model tests compile a fresh program per example, so keep example counts small;
# KVLAB_HYPOTHESIS_EXAMPLES raises them for a longer local run.
settings.register_profile(
    "kvlab",
    deadline=None,
    max_examples=int(os.environ.get("KVLAB_HYPOTHESIS_EXAMPLES", "8")),
    print_blob=True,
)
settings.load_profile("kvlab")


# The slowest tests (15-50 s each on 2 cores: subprocesses of 8 devices and of two
# hosts, whole sweeps and experiments) start first, so that neither of the two
# xdist workers is left running one of them alone at the end of the run.
SLOWEST_FIRST = (
    "test_eight_host_devices_in_a_subprocess",
    "test_two_processes_train_as_one_process_of_eight_devices",
    "test_sliced_sweep_merges_into_table_plot_and_wandb",
    "test_a_slice_of_the_experiment_runs_end_to_end",
    "test_panel_projections_compute_the_same_model",
    "test_sweep_slices_then_merge",
    "test_train_then_eval_through_another_cache",
    "test_uptrain_experiment",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in SLOWEST_FIRST)


@pytest.fixture(autouse=True)
def _wandb_files_stay_in_tmp(tmp_path_factory, monkeypatch):
    """wandb stages logged tables for `wandb sync` under WANDB_DATA_DIR (default
    in the home directory); tests keep them in their temporary directory."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path_factory.getbasetemp() / "wandb-data"))


def _mappings() -> int:
    """The memory mappings this process holds (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_are_freed_after_each_module():
    """Every compiled XLA:CPU program holds memory mappings while JAX's caches
    keep it; a whole run would keep thousands and reach the kernel's
    vm.max_map_count (65,530 here), where a compile's mmap fails and XLA
    crashes. After a test module that leaves more than 20,000 of them
    (KVLAB_TEST_CLEAR_MAPPINGS), JAX's caches are cleared; below that, later
    modules reuse the compiled programs."""
    yield
    if _mappings() > int(os.environ.get("KVLAB_TEST_CLEAR_MAPPINGS", "20000")):
        import jax  # noqa: PLC0415 (XLA_FLAGS above is read when the backend starts)

        jax.clear_caches()
        gc.collect()
