"""MAML and Meta-SGD on sinusoid regression (Finn et al., 2017, section 5.1), written with fadam and torch.func.

Tasks: y = A sin(x + phi), A ~ U[0.1, 5.0], phi ~ U[0, pi], x ~ U[-5, 5]; K = 10 shots per task; a 1-40-40-1 ReLU
network. Three models get the same number of outer iterations and the same test tasks:

- pretrained: one network regressed on all tasks at once (the paper's baseline), then fine-tuned on the K shots;
- MAML: meta-learned initialisation, inner loop one step of ``fadam.sgd(lr=0.01)``;
- Meta-SGD (Li et al., 2017): the initialisation and a per-parameter inner learning rate are meta-learned.

The inner loop runs inside ``torch.func.grad`` and is ``vmap``ped over the meta-batch of tasks; the outer step is
``fadam.adam``. Run ``PYTHONPATH=. python examples/maml_sinusoid.py`` from the repository root (or with fadam
installed); the default takes about a minute and a half on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import fadam

Params = dict[str, torch.Tensor]


def sample_tasks(num_tasks: int, shots: int, queries: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Support and query sets, each ``(num_tasks, points, 1)``."""
    amplitude = 0.1 + 4.9 * torch.rand(num_tasks, 1, 1, generator=gen)
    phase = math.pi * torch.rand(num_tasks, 1, 1, generator=gen)
    x = 10 * torch.rand(num_tasks, shots + queries, 1, generator=gen) - 5
    y = amplitude * torch.sin(x + phase)
    return x[:, :shots], y[:, :shots], x[:, shots:], y[:, shots:]


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))


class Sinusoid:
    def __init__(self, net: nn.Module, inner_steps: int) -> None:
        self.net = net
        self.inner_steps = inner_steps

    def loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(self.net, params, (x,)) - y) ** 2).mean()

    def adapt(self, tx: fadam.GradientTransformation, params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
        """The inner loop: differentiable fadam steps on the support set."""
        state = tx.init(params)
        for _ in range(self.inner_steps):
            params, state = fadam.step(tx, params, grad(self.loss)(params, x, y), state)
        return params

    def query_loss(
        self,
        tx: fadam.GradientTransformation,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        xq: torch.Tensor,
        yq: torch.Tensor,
    ) -> torch.Tensor:
        """Query loss after adapting on the support set, for one task."""
        return self.loss(self.adapt(tx, params, x, y), xq, yq)

    def mean_query_loss(self, tx: fadam.GradientTransformation, params: Params, tasks: tuple) -> torch.Tensor:
        """``query_loss`` vmapped over a batch of tasks, averaged."""
        return vmap(partial(self.query_loss, tx), in_dims=(None, 0, 0, 0, 0))(params, *tasks).mean()


def meta_sgd(alphas: Params) -> fadam.GradientTransformation:
    """Meta-SGD's inner step ``-alpha * g`` with one learned rate per parameter element: one stateless transform."""
    return fadam.stateless(lambda updates, params: fadam.tree_map(lambda g, a: -a * g, updates, alphas))


def train(
    meta_objective: Callable[[dict, tuple[torch.Tensor, ...]], torch.Tensor],
    meta_params: dict,
    iterations: int,
    meta_batch: int,
    gen: torch.Generator,
    log_every: int,
    name: str,
) -> dict:
    """Adam on the meta-parameters (any tree): each iteration differentiates ``meta_objective`` with torch.func."""
    tx = fadam.adam(lr=1e-3)
    state = tx.init(meta_params)
    value_and_grad = torch.func.grad_and_value(meta_objective)
    start = time.perf_counter()
    for iteration in range(1, iterations + 1):
        grads, loss = value_and_grad(meta_params, sample_tasks(meta_batch, 10, 10, gen))
        meta_params, state = fadam.step(tx, meta_params, grads, state, donate=True)
        if log_every and iteration % log_every == 0:
            print(f"  {name} iteration {iteration}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    return meta_params


def evaluate(problem: Sinusoid, tx: fadam.GradientTransformation, params: Params, tasks: tuple) -> float:
    """Mean query MSE after adapting on each test task's K shots."""
    return problem.mean_query_loss(tx, params, tasks).item()


def fresh(params: Params) -> Params:
    """A copy: the outer steps donate (overwrite) their inputs."""
    return {k: v.clone() for k, v in params.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=6000, help="outer iterations per model")
    parser.add_argument("--meta-batch", type=int, default=25, help="tasks per outer iteration (paper: 25)")
    parser.add_argument("--test-tasks", type=int, default=1000)
    parser.add_argument("--inner-lr", type=float, default=0.01, help="MAML's alpha (paper: 0.01)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny ops: more threads only add sync)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    net = make_net()
    init = {k: v.detach().clone() for k, v in net.named_parameters()}
    one_step, ten_steps = Sinusoid(net, 1), Sinusoid(net, 10)
    sgd = fadam.sgd(lr=args.inner_lr)

    def pretrain_objective(params: Params, tasks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y, xq, yq = tasks  # plain regression on every point of every task
        return one_step.loss(params, torch.cat([x, xq], 1), torch.cat([y, yq], 1))

    def maml_objective(params: Params, tasks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return one_step.mean_query_loss(sgd, params, tasks)

    def meta_sgd_objective(meta: dict, tasks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return one_step.mean_query_loss(meta_sgd(meta["alpha"]), meta["params"], tasks)

    start = time.perf_counter()
    schedule = (args.iterations, args.meta_batch, gen, args.log_every)
    pretrained = train(pretrain_objective, fresh(init), *schedule, "pretrain")
    maml = train(maml_objective, fresh(init), *schedule, "MAML")
    alphas = {k: torch.full_like(v, args.inner_lr) for k, v in init.items()}
    learned = train(meta_sgd_objective, {"params": fresh(init), "alpha": alphas}, *schedule, "Meta-SGD")
    train_seconds = time.perf_counter() - start

    test_tasks = sample_tasks(args.test_tasks, 10, 100, torch.Generator().manual_seed(10_000 + args.seed))
    results = {
        "pretrained, 1 step": evaluate(one_step, sgd, pretrained, test_tasks),
        "pretrained, 10 steps": evaluate(ten_steps, sgd, pretrained, test_tasks),
        "MAML, 0 steps": evaluate(Sinusoid(net, 0), sgd, maml, test_tasks),
        "MAML, 1 step": evaluate(one_step, sgd, maml, test_tasks),
        "MAML, 10 steps": evaluate(ten_steps, sgd, maml, test_tasks),
        "Meta-SGD, 1 step": evaluate(one_step, meta_sgd(learned["alpha"]), learned["params"], test_tasks),
    }
    mean_alpha = torch.cat([a.flatten() for a in learned["alpha"].values()]).mean().item()
    print(
        f"\n{args.iterations} outer iterations x {args.meta_batch} tasks per model, K = 10 shots, "
        f"{args.test_tasks} test tasks, trained in {train_seconds:.0f} s"
    )
    print(f"{'model':<24}{'query MSE':>10}")
    for name, value in results.items():
        print(f"{name:<24}{value:>10.3f}")
    print(f"Meta-SGD learned inner lr: mean {mean_alpha:.4f} (started at {args.inner_lr})")
    return results


if __name__ == "__main__":
    main()
