import os

import pytest
from hypothesis import settings

# Model tests compile a fresh program per example, so keep example counts small;
# KVLAB_HYPOTHESIS_EXAMPLES raises them for a longer local run.
settings.register_profile(
    "kvlab",
    deadline=None,
    max_examples=int(os.environ.get("KVLAB_HYPOTHESIS_EXAMPLES", "8")),
    print_blob=True,
)
settings.load_profile("kvlab")


@pytest.fixture(autouse=True)
def _wandb_files_stay_in_tmp(tmp_path_factory, monkeypatch):
    """wandb stages logged tables for `wandb sync` under WANDB_DATA_DIR (default
    in the home directory); tests keep them in their temporary directory."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path_factory.getbasetemp() / "wandb-data"))
