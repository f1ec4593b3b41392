import os

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
