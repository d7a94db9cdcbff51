"""One outer step of an unrolled inner loop: fadam vs torchopt's MetaAdam vs a hand-written differentiable Adam.

An outer step restores the meta-parameters, takes K differentiable Adam steps on a support batch, computes the query
loss and backpropagates it to the meta-parameters. Same model, K, batch and hyperparameters for every contender; the
outer gradients are checked to agree before timing. Contenders run interleaved in one process; the table shows
medians and the ratio to torchopt (or, when torchopt cannot be imported, to the hand-written loop).

    PYTHONPATH=. python benchmarks/bench_meta.py [--steps 5] [--width 256] [--batch 128] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import fadam

try:
    import torchopt
except Exception as error:  # torchopt 0.7 imports graphviz at import time; any failure means "not available"
    torchopt = None
    TORCHOPT_ERROR = f"{type(error).__name__}: {error}"

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def make_net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def mse(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net(x) - y) ** 2).mean()


def fadam_outer_step(net: nn.Module, steps: int, data: tuple[torch.Tensor, ...]) -> Callable[[], list[torch.Tensor]]:
    opt = fadam.MetaOptimizer(net, fadam.adam(lr=LR, betas=BETAS, eps=EPS))
    start = opt.snapshot()
    meta_params = list(start.params.values())
    x, y, xq, yq = data

    def run() -> list[torch.Tensor]:
        opt.restore(start)
        for _ in range(steps):
            opt.step(mse(net, x, y))
        return list(torch.autograd.grad(mse(net, xq, yq), meta_params))

    return run


def torchopt_outer_step(net: nn.Module, steps: int, data: tuple[torch.Tensor, ...]) -> Callable[[], list[torch.Tensor]]:
    opt = torchopt.MetaAdam(net, lr=LR, betas=BETAS, eps=EPS, moment_requires_grad=False)
    net_state = torchopt.extract_state_dict(net, by="reference")
    opt_state = torchopt.extract_state_dict(opt, by="reference")
    meta_params = list(net.parameters())
    x, y, xq, yq = data

    def run() -> list[torch.Tensor]:
        torchopt.recover_state_dict(net, net_state)
        torchopt.recover_state_dict(opt, opt_state)
        for _ in range(steps):
            opt.step(mse(net, x, y))
        return list(torch.autograd.grad(mse(net, xq, yq), meta_params))

    return run


def plain_torch_outer_step(
    net: nn.Module, steps: int, data: tuple[torch.Tensor, ...]
) -> Callable[[], list[torch.Tensor]]:
    """The baseline a user writes by hand: Adam's equations on tensors, through ``torch.func.functional_call``."""
    names = [name for name, _ in net.named_parameters()]
    meta_params = list(net.parameters())
    x, y, xq, yq = data
    b1, b2 = BETAS

    def loss(params: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((torch.func.functional_call(net, dict(zip(names, params)), (a,)) - b) ** 2).mean()

    def run() -> list[torch.Tensor]:
        params = meta_params
        mu = [torch.zeros_like(p) for p in params]
        nu = [torch.zeros_like(p) for p in params]
        for t in range(1, steps + 1):
            grads = torch.autograd.grad(loss(params, x, y), params, create_graph=True)
            mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, grads)]
            nu = [b2 * v + (1 - b2) * g * g for v, g in zip(nu, grads)]
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            params = [p - LR * (m / bc1) / ((v / bc2).sqrt() + EPS) for p, m, v in zip(params, mu, nu)]
        return list(torch.autograd.grad(loss(params, xq, yq), meta_params))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="inner steps K")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the 32-w-w-1 MLP")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    data = tuple(torch.randn(args.batch, d, generator=gen) for d in (32, 1, 32, 1))

    contenders: dict[str, Callable[[], list[torch.Tensor]]] = {"fadam.MetaOptimizer": fadam_outer_step}
    if torchopt is not None:
        contenders["torchopt.MetaAdam"] = torchopt_outer_step
    contenders["hand-written torch Adam"] = plain_torch_outer_step
    runs = {name: make(make_net(args.width), args.steps, data) for name, make in contenders.items()}

    # float32 rounding differs between the implementations and the meta-gradient amplifies it (in float64 all three
    # agree to 1e-14); each must match the hand-written loop to 1e-3 of the largest gradient entry
    reference = runs["hand-written torch Adam"]()
    agreement = {}
    for name, run in runs.items():
        agreement[name] = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(run(), reference))
        if agreement[name] > 1e-3:
            raise AssertionError(f"{name}'s outer gradient differs from the hand-written loop by {agreement[name]:.2e}")

    # wall time, and the process's CPU time, which other jobs on a shared machine disturb much less; the order of the
    # contenders alternates between repeats, and each repeat's own ratio is kept (paired: noise hits both sides)
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        names = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in names:
            run = runs[name]
            start, cpu_start = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)

    params = sum(p.numel() for p in make_net(args.width).parameters())
    print(
        f"one outer step: K={args.steps} inner Adam steps + outer backward, MLP 32-{args.width}-{args.width}-1 "
        f"({params} params), batch {args.batch}, {args.threads} threads, median of {args.repeats}, torch "
        f"{torch.__version__}, torchopt {torchopt.__version__ if torchopt else 'not available: ' + TORCHOPT_ERROR}"
    )
    baseline_name = "torchopt.MetaAdam" if torchopt is not None else "hand-written torch Adam"
    baseline = statistics.median(times[baseline_name])
    cpu_baseline = statistics.median(cpu_times[baseline_name])
    print(
        f"ratios are to {baseline_name} (of medians, and the median of each repeat's own ratio: 'paired'); the last "
        "column is the outer gradient's max deviation from hand-written"
    )
    print(f"{'contender':<26}{'wall ms':>9}{'ratio':>8}{'paired':>8}{'cpu ms':>9}{'ratio':>8}{'grad dev':>10}")
    for name in runs:
        wall, cpu = statistics.median(times[name]), statistics.median(cpu_times[name])
        paired = statistics.median(a / b for a, b in zip(times[name], times[baseline_name]))
        print(
            f"{name:<26}{wall * 1e3:>9.2f}{wall / baseline:>7.3f}x{paired:>7.3f}x{cpu * 1e3:>9.2f}"
            f"{cpu / cpu_baseline:>7.3f}x{agreement[name]:>10.1e}"
        )


if __name__ == "__main__":
    main()
