"""Test-wide settings.

One intra-op thread: the suite runs thousands of steps on tiny tensors, where torch's CPU kernels (the fused
optimizer kernels above all) can take milliseconds per call when OpenMP threads wait for a busy core, measured at
~21 ms instead of ~3 us on a loaded 2-core machine. Subprocesses started by tests (examples, torchrun) inherit it.

Kernels generated for composed chains are cached in a folder under the system's temporary directory that every
worker shares.
"""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# generated kernels go to one folder that every worker of a run shares (and later runs reuse), not the home directory
os.environ.setdefault("FADAM_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"fadam-test-kernels-{os.getuid()}"))

import torch  # after OMP_NUM_THREADS, which torch reads when it loads

torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import fadam  # noqa: E402
from fadam import _cpu_kernel  # noqa: E402

# The suite's examples are fixed, the same on every machine and run; "explore" draws new ones, many more, and keeps
# the failing ones in hypothesis' database: ``python -m pytest tests/test_composed_chains.py
# --hypothesis-profile=explore``.
_SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]  # kernels compile on first use
settings.register_profile(
    "default", max_examples=20, derandomize=True, database=None, deadline=None, suppress_health_check=_SLOW
)
settings.register_profile("explore", max_examples=1000, deadline=None, suppress_health_check=_SLOW)
settings.load_profile("default")


@pytest.fixture
def kernel_runs(monkeypatch):
    """The number of leaves of each call of a compiled kernel."""
    runs = []
    run = _cpu_kernel.Kernel.run

    def counted(self, leaves, *scalars):
        runs.append(len(leaves))
        return run(self, leaves, *scalars)

    monkeypatch.setattr(_cpu_kernel.Kernel, "run", counted)
    with fadam.backend("kernel"):  # the generated kernel, also where a program is one of torch's fused kernels' chains
        yield runs
