"""Test-wide settings.

One intra-op thread: the suite runs thousands of steps on tiny tensors, where torch's CPU kernels (the fused
optimizer kernels above all) can take milliseconds per call when OpenMP threads wait for a busy core, measured at
~21 ms instead of ~3 us on a loaded 2-core machine. Subprocesses started by tests (examples, torchrun) inherit it.

The quantized Adam aliases' torch.compile kernels run eagerly except in tests marked slow: compiling costs tens of
seconds on a busy 2-core machine; the same functions run eagerly. Their C++ CPU kernel (float32 and bfloat16 params)
runs everywhere: it builds in seconds, once per machine. Kernels generated for composed chains are cached in a
folder under the system's temporary directory that every worker shares.
"""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# generated kernels go to one folder that every worker of a run shares (and later runs reuse), not the home directory
os.environ.setdefault("FADAM_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"fadam-test-kernels-{os.getuid()}"))

import pytest
import torch  # after OMP_NUM_THREADS, which torch reads when it loads

from fadam.quantization import _aliases, _fused

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _eager_quantized_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(_fused, "_kernel", lambda: _fused._rows_step_inplace)


@pytest.fixture
def unfused():
    """``unfused(fadam.adamw8bit, **kwargs)``: the alias without its kernels, i.e. the chain they must match."""

    def make(factory, *args, **kwargs):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_aliases, "fused_quantized_adam_step", lambda **_: (lambda *a: None, lambda *a: None))
            return factory(*args, **kwargs)

    return make
