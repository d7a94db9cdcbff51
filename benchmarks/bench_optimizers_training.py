"""What the modern optimizers buy: the same small models trained with AdamW, Muon, Schedule-Free AdamW, SOAP, Prodigy
and ADOPT, from the same seed on the same batches, for a fixed budget of steps, in one process.

    PYTHONPATH=. python benchmarks/bench_optimizers_training.py [--steps 600] [--out results.json]
    PYTHONPATH=. python benchmarks/bench_optimizers_training.py --tiny --out results.json   # seconds (tests)
    PYTHONPATH=. python benchmarks/bench_optimizers_training.py --sweep   # the lr sweep: about 4x longer

Models: (a) ``charlm``, the character transformer of ``examples/quantized_charlm.py`` on fadam's own text
(README.md, then fadam/**/*.py in sorted order; the first 90% trains, the rest validates); (b) ``teacher_mlp``, an MLP
classifying Gaussian inputs by the argmax of a fixed random teacher network (fresh inputs every step, a held-out set
to validate). Every optimizer takes the same steps and batches; at each step the optimizers run one after another
(interleaved), so the step times share the machine's state. The table gives the final validation loss (Schedule-Free
at its evaluation point ``schedule_free_eval_params``) and the mean time of the optimizer step (``fadam.step`` with
``donate=True``) and of the whole training step (forward, backward and optimizer step) after the first ``UNTIMED``
of the steps, as ratios to AdamW's.

Hyperparameters (``RECIPES``): each optimizer's reference defaults, except that AdamW takes nanoGPT's character-model
recipe (betas (0.9, 0.99), weight decay 0.1), which Muon's AdamW part shares; every learning rate but Prodigy's is
the best of ``--sweep`` (``LEARNING_RATES``); the first ``WARMUP`` of the steps warm the learning rate up linearly,
then a cosine decays it to ``END_LR`` of its peak, except Schedule-Free's, which warms up and stays constant (it
needs no schedule: its point). No gradient clipping.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import fadam
from examples.quantized_charlm import CharLM, batches

Params = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]
AdamWFor = Callable[[str, torch.Tensor], bool]

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon", "schedule_free_adamw", "soap", "prodigy", "adopt")
UNTIMED = 0.1  # fraction of the first steps not timed: they build kernels and SOAP's eigenbases
WARMUP = 0.05  # fraction of the steps that warm the learning rate up
END_LR = 0.1  # the cosine ends at this fraction of the peak (nanoGPT's lr / 10)
# the models' and runs' sizes: the default (about 5 minutes on 2 threads) and --tiny's (seconds)
SIZE = dict(dim=64, layers=2, heads=4, context=64, batch=16, mlp_width=128, mlp_batch=128, val_batches=16, evals=10)
TINY = dict(dim=16, layers=1, heads=2, context=16, batch=4, mlp_width=32, mlp_batch=16, val_batches=1, evals=2)
SWEEP_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # --sweep tries each chosen learning rate times these

# the best final validation loss of --sweep at the default size (Prodigy's lr stays 1: it estimates the step size)
LEARNING_RATES: dict[str, dict[str, float]] = {
    "charlm": {
        "adamw": 0.024,
        "muon": 0.04,
        "schedule_free_adamw": 0.02,
        "soap": 0.048,
        "prodigy": 1.0,
        "adopt": 0.012,
    },
    "teacher_mlp": {
        "adamw": 6e-3,
        "muon": 0.02,
        "schedule_free_adamw": 0.01,
        "soap": 0.012,
        "prodigy": 1.0,
        "adopt": 3e-3,
    },
}

# what each optimizer is given besides its learning rate, as its factory's keyword arguments (stored with the results)
RECIPES: dict[str, dict[str, Any]] = {
    "adamw": {"betas": (0.9, 0.99), "weight_decay": 0.1},
    # Muon for the hidden matrices (no decay: Jordan et al.'s recipe), AdamW's recipe and lr for every other param
    "muon": {
        "momentum": 0.95,
        "nesterov": True,
        "weight_decay": 0.0,
        "adamw_betas": (0.9, 0.99),
        "adamw_weight_decay": 0.1,
    },
    "schedule_free_adamw": {"b1": 0.9, "b2": 0.999, "weight_decay": 0.0},
    "soap": {"betas": (0.95, 0.95), "weight_decay": 0.01, "precondition_frequency": 10},
    "prodigy": {"betas": (0.9, 0.999), "d0": 1e-6, "safeguard_warmup": True},  # safeguard_warmup: as with any warmup
    "adopt": {"b1": 0.9, "b2": 0.9999, "eps": 1e-6, "use_clipping": True},
}
SCHEDULED = {"adamw": fadam.adamw, "soap": fadam.soap, "prodigy": fadam.prodigy, "adopt": fadam.adopt}


class Contender(NamedTuple):
    tx: fadam.GradientTransformation
    eval_params: Callable[[Any, Params], Params]  # the point to validate at, from (state, params)


@dataclass
class Task:
    name: str
    model: nn.Module
    loss: Callable[[nn.Module, Params, Batch], torch.Tensor]
    train: list[Batch]
    val: list[Batch]
    adamw_for: AdamWFor  # the 2-D params Muon leaves to AdamW (embeddings, head; the MLP's first and last layers)
    description: str


def train_point(state: Any, params: Params) -> Params:
    """The params themselves: where every optimizer but Schedule-Free is validated."""
    return params


def contender(name: str, lr: float, steps: int, adamw_for: AdamWFor, adamw_lr: float) -> Contender:
    """``name``'s optimizer (``RECIPES``) at peak learning rate ``lr`` for a run of ``steps``; ``adamw_lr`` is the
    peak learning rate of Muon's AdamW part."""
    warmup = max(1, round(WARMUP * steps))

    def cosine(peak: float) -> fadam.Schedule:
        # the warmup starts at peak / warmup, not 0: a first step at lr 0 would spend one step of the budget moving
        # nothing
        return fadam.warmup_cosine_decay_schedule(peak / warmup, peak, warmup, steps, end_value=END_LR * peak)

    recipe = RECIPES[name]
    if name == "schedule_free_adamw":
        return Contender(fadam.schedule_free_adamw(lr, warmup, **recipe), fadam.schedule_free_eval_params)
    if name == "muon":
        tx = fadam.muon_with_adamw(cosine(lr), adamw_lr=cosine(adamw_lr), adamw_for=adamw_for, **recipe)
        return Contender(tx, train_point)
    return Contender(SCHEDULED[name](cosine(lr), **recipe), train_point)


def schedule(name: str) -> str:
    """How ``contender`` schedules ``name``'s learning rate, in words."""
    if name == "schedule_free_adamw":
        return f"linear warmup over {WARMUP:.0%} of the steps, then constant"
    return f"linear warmup over {WARMUP:.0%} of the steps, then cosine to {END_LR:g}x the peak"


def fadam_text() -> bytes:
    """fadam's own docs and source: README.md, then every fadam/**/*.py in sorted order."""
    paths = [ROOT / "README.md", *sorted((ROOT / "fadam").rglob("*.py"))]
    return b"\n".join(path.read_bytes() for path in paths)


def charlm_task(cfg: argparse.Namespace) -> Task:
    raw = fadam_text()
    text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    split = int(0.9 * text.numel())
    torch.manual_seed(cfg.seed)
    model = CharLM(cfg.dim, cfg.layers, cfg.heads, cfg.context)
    train = batches(text[:split], cfg.batch, cfg.context, cfg.steps, cfg.seed + 1)
    val = batches(text[split:], cfg.batch, cfg.context, cfg.val_batches, cfg.seed + 2)

    def loss(model: nn.Module, params: Params, batch: Batch) -> torch.Tensor:
        (chunk,) = batch
        logits = functional_call(model, params, (chunk[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))

    description = (
        f"CharLM dim {cfg.dim}, {cfg.layers} blocks, {cfg.heads} heads, context {cfg.context}, batch {cfg.batch}; "
        f"{text.numel():,} bytes of fadam's text (sha256 {hashlib.sha256(raw).hexdigest()[:12]}), 90% train"
    )
    return Task(
        "charlm",
        model,
        loss,
        [(chunk,) for chunk in train],
        [(chunk,) for chunk in val],
        named("embed.weight", "pos", "head.weight"),
        description,
    )


def teacher_mlp_task(cfg: argparse.Namespace) -> Task:
    inputs, classes, width = 32, 10, cfg.mlp_width
    g = torch.Generator().manual_seed(cfg.seed + 3)
    # unit-variance pre-activations: tanh stays smooth, so the labels are a smooth function of the inputs
    teacher = [torch.randn(inputs, 64, generator=g) / inputs**0.5, torch.randn(64, classes, generator=g)]

    def labelled(n: int) -> Batch:
        x = torch.randn(n, inputs, generator=g)
        return x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)

    train = [labelled(cfg.mlp_batch) for _ in range(cfg.steps)]
    val = [labelled(cfg.mlp_batch * 4) for _ in range(cfg.val_batches)]
    torch.manual_seed(cfg.seed)
    layers = [nn.Linear(inputs, width), nn.GELU(), nn.Linear(width, width), nn.GELU()]
    layers += [nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes)]
    model = nn.Sequential(*layers)

    def loss(model: nn.Module, params: Params, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    description = (
        f"MLP {inputs}-{width}-{width}-{width}-{classes} (GELU), batch {cfg.mlp_batch}, labels of a fixed random "
        f"teacher {inputs}-64-{classes} (tanh), fresh inputs every step"
    )
    return Task("teacher_mlp", model, loss, train, val, named("0.weight", "6.weight"), description)


def named(*names: str) -> AdamWFor:
    """A predicate on ``muon_labels``'s paths that is true for the params called ``names``."""
    paths = {f"['{name}']" for name in names}
    return lambda path, param: path in paths


def gradients(task: Task, params: Params, batch: Batch) -> Params:
    """The loss's gradient at ``params`` (plain autograd: ``torch.func.grad``'s first call imports torch._dynamo,
    seconds that a short run would time)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    return dict(zip(leaves, torch.autograd.grad(task.loss(task.model, leaves, batch), list(leaves.values()))))


def train(task: Task, contenders: dict[str, Contender], eval_every: int, untimed: int) -> dict[str, dict[str, Any]]:
    """Trains every contender on ``task``'s batches from the same init, interleaved step by step; returns each one's
    validation curve and its step times after the first ``untimed`` steps."""
    init = {k: v.detach() for k, v in task.model.named_parameters()}
    params = {name: {k: v.clone() for k, v in init.items()} for name in contenders}
    states = {name: c.tx.init(params[name]) for name, c in contenders.items()}
    runs = {name: {"curve": [], "optimizer_s": [], "train_s": []} for name in contenders}

    def validate(name: str, step: int) -> None:
        point = contenders[name].eval_params(states[name], params[name])
        with torch.no_grad():
            loss = statistics.fmean(task.loss(task.model, point, batch).item() for batch in task.val)
        runs[name]["curve"].append((step, loss))

    for name in contenders:
        validate(name, 0)
    for step, batch in enumerate(task.train, start=1):
        for name, c in contenders.items():
            start = time.perf_counter()
            grads = gradients(task, params[name], batch)
            middle = time.perf_counter()
            params[name], states[name] = fadam.step(c.tx, params[name], grads, states[name], donate=True)
            end = time.perf_counter()
            if step > untimed:
                runs[name]["optimizer_s"].append(end - middle)
                runs[name]["train_s"].append(end - start)
            if step % eval_every == 0 or step == len(task.train):
                validate(name, step)
    return runs


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Final losses and mean step times, as ratios to AdamW's."""
    base = runs["adamw"]
    out = {}
    for name, run in runs.items():
        optimizer_ms, train_ms = (1e3 * statistics.fmean(run[k]) for k in ("optimizer_s", "train_s"))
        out[name] = {
            "final_val_loss": run["curve"][-1][1],
            "curve": run["curve"],
            "optimizer_step_ms": optimizer_ms,
            "train_step_ms": train_ms,
            "optimizer_step_ratio": sum(run["optimizer_s"]) / sum(base["optimizer_s"]),
            "train_step_ratio": sum(run["train_s"]) / sum(base["train_s"]),
        }
    return out


def machine() -> dict[str, Any]:
    """What the figures ran on: CPU model, cores, torch's threads and CPU capability, versions, load average."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux names the model there; platform.processor() is often empty
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def print_table(models: dict[str, dict[str, Any]]) -> None:
    """The one table: per model and optimizer, the final validation loss and the step-time ratios."""
    header = ("model", "optimizer", "lr", "val loss", "opt step", "ms", "train step", "ms")
    print("{:12} {:20} {:>7} {:>9} {:>9} {:>7} {:>11} {:>7}".format(*header))
    for model, entry in models.items():
        for name, r in entry["optimizers"].items():
            print(
                f"{model:12} {name:20} {r['lr']:7.3g} {r['final_val_loss']:9.4f} {r['optimizer_step_ratio']:8.2f}x "
                f"{r['optimizer_step_ms']:7.2f} {r['train_step_ratio']:10.2f}x {r['train_step_ms']:7.2f}"
            )
    print("opt step, train step: mean time after the first steps / AdamW's in the same run (ms: the mean itself)")


def benchmark(tasks: list[Task], cfg: argparse.Namespace) -> dict[str, Any]:
    """Every optimizer of ``OPTIMIZERS`` on every task at its chosen learning rate: the results by model."""
    models = {}
    for task in tasks:
        lrs = LEARNING_RATES[task.name]
        contenders = {name: contender(name, lrs[name], cfg.steps, task.adamw_for, lrs["adamw"]) for name in OPTIMIZERS}
        started = time.perf_counter()
        results = summarize(train(task, contenders, cfg.eval_every, cfg.untimed))
        for name, r in results.items():
            r["lr"] = lrs[name]
            r["hyperparameters"] = RECIPES[name] | ({"adamw_lr": lrs["adamw"]} if name == "muon" else {})
            r["schedule"] = schedule(name)
        n_params = sum(p.numel() for p in task.model.parameters())
        print(f"{task.name}: {task.description}; {n_params:,} params; {time.perf_counter() - started:.0f} s")
        models[task.name] = {"description": task.description, "params": n_params, "optimizers": results}
    return models


def sweep(tasks: list[Task], cfg: argparse.Namespace) -> dict[str, Any]:
    """Each optimizer but Prodigy at its chosen learning rate times ``SWEEP_FACTORS``, all trained together; prints
    the final validation losses and the best learning rate of each."""
    found: dict[str, Any] = {}
    for task in tasks:
        lrs = LEARNING_RATES[task.name]
        grid = [(name, lrs[name] * f) for name in OPTIMIZERS if name != "prodigy" for f in SWEEP_FACTORS]
        contenders = {
            f"{name}@{lr:g}": contender(name, lr, cfg.steps, task.adamw_for, lrs["adamw"]) for name, lr in grid
        }
        runs = train(task, contenders, cfg.eval_every, cfg.untimed)
        found[task.name] = {}
        for name in dict.fromkeys(name for name, _ in grid):
            tried = {lr: runs[f"{name}@{lr:g}"]["curve"][-1][1] for n, lr in grid if n == name}
            best = min(tried, key=tried.get)
            cells = "  ".join(f"{lr:.3g}: {loss:.4f}" for lr, loss in tried.items())
            print(f"{task.name:12} {name:20} best {best:.3g}   {cells}")
            found[task.name][name] = {"best": best, "final_val_loss": {f"{lr:g}": v for lr, v in tried.items()}}
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (default: the command line), runs the benchmark or the sweep and returns its report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps of every run")
    parser.add_argument("--tiny", action="store_true", help="tiny models and few steps: seconds (tests)")
    parser.add_argument("--sweep", action="store_true", help="run the learning-rate sweep instead of the benchmark")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=("auto", "eager", "kernel"), default="auto", help="see fadam.backend")
    parser.add_argument("--seed", type=int, default=0)
    cfg = parser.parse_args(argv)
    if cfg.tiny:
        cfg.steps = min(cfg.steps, 4)
    if cfg.steps < 2:
        parser.error(f"--steps must be at least 2 (the first is not timed), got {cfg.steps}")
    size = TINY if cfg.tiny else SIZE
    untimed = max(1, round(UNTIMED * cfg.steps))
    vars(cfg).update(size, eval_every=max(1, cfg.steps // size["evals"]), untimed=untimed)
    torch.set_num_threads(cfg.threads)
    info = machine()
    print(", ".join(f"{k} {v}" for k, v in info.items()))
    tasks = [charlm_task(cfg), teacher_mlp_task(cfg)]
    with fadam.backend(cfg.backend):
        results = {"sweep": sweep(tasks, cfg)} if cfg.sweep else {"models": benchmark(tasks, cfg)}
    if not cfg.sweep:
        print_table(results["models"])
    command = [
        "PYTHONPATH=. python",
        Path(__file__).resolve().relative_to(ROOT).as_posix(),
        *(sys.argv[1:] if argv is None else argv),
    ]
    config = {k: v for k, v in vars(cfg).items() if k != "out"}
    report = {"command": " ".join(command), "machine": info, "config": config, **results}
    if cfg.out:
        cfg.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
