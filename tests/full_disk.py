"""A full disk, made real: a process that may not grow a file past a size.

Under RLIMIT_FSIZE a write past the limit fails as on a full disk, with
OSError EFBIG ('File too large'), once SIGXFSZ (which would kill the process)
is ignored. Pipes are not files: a child's stdout and stderr still reach us.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys

from tests.helpers import ROOT

# Sets the limit and ignores SIGXFSZ, then becomes the command (both survive exec).
_LAUNCH = (
    "import os, resource, signal, sys; "
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """In this process, for the block: no file grows past `limit` bytes."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def run_python(limit: int, *args: str) -> subprocess.CompletedProcess:
    """`python args...` from the repository root, no file growing past `limit`
    bytes. Without the tests' JAX compilation cache, whose writes would fail
    with a warning of their own."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return subprocess.run(
        [sys.executable, "-c", _LAUNCH, str(limit), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
