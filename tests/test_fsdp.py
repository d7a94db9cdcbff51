"""DTensor / FSDP2 and distributed checkpoints: 2 ranks on CPU (gloo) equal a single process.

One torchrun launch (``tests/fsdp_worker.py``) trains every optimizer of its ``CASES`` on a ``fully_shard`` model and
saves checkpoints; the tests here compare its results with the same training in this process, and load its
checkpoints into this single process (resharding from 2 ranks to 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fadam
from tests.fsdp_worker import (
    CASES,
    DCP_CASES,
    GLOBAL_NORM_CASES,
    dtensor_grads,
    make_model,
    train,
    train_on_grads,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, str(ROOT / "tests" / "fsdp_worker.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out, torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_training_equals_one_process(distributed_run: tuple[Path, dict], name: str) -> None:
    params, _ = train(make_model(), CASES[name]())
    sharded = distributed_run[1]["params"][name]
    assert sharded.keys() == params.keys()
    for key, p in params.items():
        assert type(sharded[key]) is torch.Tensor
        # FSDP's forward/backward rounds differently from one process (measured up to 5e-7 after 3 steps); the
        # optimizer's own part is bit-identical (next test)
        torch.testing.assert_close(sharded[key], p.detach(), rtol=0, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.parametrize("name", list(CASES))
def test_dtensor_updates_equal_one_process_bit_for_bit(distributed_run: tuple[Path, dict], name: str) -> None:
    """On identical gradients the sharded optimizer is exact where its math is elementwise (shard-local); a global
    norm adds the ranks' partial sums of squares, which rounds like a different summation order."""
    plain = {k: v.detach() for k, v in make_model().named_parameters()}
    expected = train_on_grads(plain, dtensor_grads(), CASES[name]())
    for key, p in expected.items():
        if name in GLOBAL_NORM_CASES:
            torch.testing.assert_close(distributed_run[1]["dtensor"][name][key], p, rtol=1e-6, atol=1e-8)
        else:
            assert torch.equal(distributed_run[1]["dtensor"][name][key], p), (name, key)


def test_global_norm_of_dtensors_is_reduced_across_ranks(distributed_run: tuple[Path, dict]) -> None:
    norm = distributed_run[1]["global_norm"]
    assert type(norm) is torch.Tensor and norm.shape == ()  # a plain tensor, equal on every rank
    torch.testing.assert_close(norm, fadam.tree_global_norm(dtensor_grads()[0]), rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note that it loads in one process
@pytest.mark.parametrize("name", DCP_CASES)
def test_checkpoint_from_two_ranks_loads_into_one_process(distributed_run: tuple[Path, dict], name: str) -> None:
    import torch.distributed.checkpoint as dcp

    out, results = distributed_run
    tx = CASES[name]()
    like = tx.init(dict(make_model().named_parameters()))
    target = {"optim": fadam.state_to_dict(like)}
    dcp.load(target, checkpoint_id=out / f"ckpt-{name}")
    loaded = fadam.state_from_dict(like, target["optim"])
    expected = fadam.state_from_dict(like, results["states"][name])
    paths = fadam.tree_paths(loaded)
    for path, a, b in zip(paths, fadam._tree.tree_leaves(loaded), fadam._tree.tree_leaves(expected)):
        assert type(a) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b), path
