"""Transforms on more than one device: ensembles across devices (``pmap``), model parallel, DTensor/FSDP2, and
distributed checkpoints.

**Ensembles across devices.** ``torch.func.vmap(tx.init)`` and ``vmap(tx.update)`` run N stacked models (see
``torch.func.stack_module_state``) as one batch, each member with its own state; global reductions such as
``clip_by_global_norm`` are per member. ``pmap(fn, devices)`` splits that leading axis across devices and runs
``vmap(fn)`` on each shard on its own device. Its results are ``Sharded`` leaves that stay where they were computed;
feeding them back into the same ``pmap`` moves nothing (the step counts that ``init`` makes on the CPU move to the
devices once, on the first update), and ``gather`` brings them to one device when you ask::

    init, update = fadam.pmap(tx.init), fadam.pmap(tx.update)   # every visible CUDA device
    state = init(params)                                         # params: {name: [N, ...]} on any device
    for grads in batches:
        updates, state = update(grads, state, params)
        params = fadam.pmap(fadam.apply_updates)(params, updates)
    params = fadam.gather(params)                                # {name: [N, ...]} on the first device

Under a plain ``vmap`` on an accelerator the per-member step counts stay on the CPU, and the few scalars derived
from them (bias corrections, scheduled rates) are copied to the params' device at each update; ``pmap`` keeps the
counts on the devices instead.

**Model parallel.** A single model whose params live on several devices needs nothing special: state is created
with ``zeros_like`` of each param (so it follows the param's device), elementwise math runs where each leaf lives,
``fadam.step`` runs its fused kernels once per (device, dtype) group, and ``tree_global_norm`` (hence
``clip_by_global_norm``) sums the per-device squares on the first leaf's device and scales each leaf on its own.

**DTensor and FSDP2.** Params sharded by ``torch.distributed.fsdp.fully_shard`` are DTensors; every transform works
on them as they are: ``tx.init`` builds state with the params' placements (``zeros_like`` of a DTensor keeps them),
elementwise math runs on the local shards with no communication, and global norms are reduced across ranks (a
collective: every rank must step). Fused kernels are never used on DTensors. With ``donate=True``, ``fadam.step``
writes the new values into the sharded params in place, so the module keeps training::

    model = fully_shard(model)                       # after fully_shard on its blocks
    params = dict(model.named_parameters())
    tx = fadam.adamw(lr=1e-3)
    state = tx.init(params)
    loss_fn(model(batch)).backward()
    with torch.no_grad():
        grads = {name: p.grad for name, p in params.items()}
        params, state = fadam.step(tx, params, grads, state, donate=True)

``examples/fsdp_transformer.py`` is a complete script.

**Distributed checkpoints (DCP).** ``torch.distributed.checkpoint`` traverses only dicts and lists, so a DTensor kept
inside fadam's NamedTuple states would be pickled and come back wrong without an error. Save and load the state as
nested dicts with ``fadam.state_to_dict`` / ``fadam.state_from_dict``; loading reshards, so a checkpoint written by
N ranks loads into M ranks or into one process::

    import torch.distributed.checkpoint as dcp

    # save, on every rank
    dcp.save({"model": model.state_dict(), "optim": fadam.state_to_dict(state)}, checkpoint_id=path)

    # load, on every rank of the new job (any number of ranks): build a template with the new sharding,
    # load into it in place, then rebuild the state (every path, shape and dtype is checked)
    like = tx.init(dict(model.named_parameters()))
    target = {"model": model.state_dict(), "optim": fadam.state_to_dict(like)}
    dcp.load(target, checkpoint_id=path)
    model.load_state_dict(target["model"])
    state = fadam.state_from_dict(like, target["optim"])

DCP loads into the template's tensors, so their shapes and placements (not the checkpoint's) decide the sharding of
the loaded state; step counts are saved once, as replicated plain tensors. Loading in a single process without a
process group works as is (DCP warns that it assumes one process).

Quantized state (``fadam.adamw8bit``, ``fadam.adamw4bit`` and other ``quantize_state`` transforms) works on DTensor
params: each rank quantizes its own shard, its codes sharded like the param and one scale per block of the local shard
(see ``fadam.quantization._sharded``). 4-bit codes are kept one per byte there (two per byte cannot be sharded like the
param), so 4-bit state of sharded params takes about 1 byte per element, as 8-bit, with 4-bit precision. Those scales
belong to one shard layout, so ``state_to_dict`` saves such a leaf dequantized, as a float32 DTensor sharded like the
param (a checkpoint 4x the size of 8-bit codes, resharded by DCP like any other state), and ``state_from_dict``
requantizes it in the blocks of the template's layout: exactly the saved codes when the blocks are the same, one more
rounding otherwise. The template must then be sharded too (FSDP over any number of ranks, one included): a plain
single-process template asks for the codes, which such a checkpoint does not hold (DCP raises ``Missing key ...
codes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fadam._tree import PyTree, path_str, tree_flatten, tree_map

__all__ = ["Sharded", "gather", "pmap"]


class Sharded:
    """A tensor split along ``dim`` into shards that stay on their devices: what ``pmap`` returns for each leaf.

    Passing it back into a ``pmap`` over the same devices reuses the shards in place; ``gather`` (or ``fadam.gather``
    for a whole tree) concatenates them on one device, the only point where data moves.

    Example:
        >>> import torch, fadam
        >>> x = fadam.Sharded([torch.zeros(2, 3), torch.ones(1, 3)])
        >>> x.shape, x.gather().sum()
        (torch.Size([3, 3]), tensor(3.))
    """

    __slots__ = ("_shape", "_sizes", "dim", "shards")

    def __init__(self, shards: Sequence[torch.Tensor], dim: int = 0) -> None:
        if not shards:
            raise ValueError("Sharded needs at least one shard")
        for index, shard in enumerate(shards):
            if not isinstance(shard, torch.Tensor):
                raise TypeError(f"shard {index} is a {type(shard).__name__}, expected a torch.Tensor")
        ndim = shards[0].dim()
        if not -ndim <= dim < ndim:
            raise ValueError(f"dim {dim} is out of range for shards of {ndim} dimensions")
        dim = dim % ndim
        first_rest = _without(shards[0].shape, dim)
        for index, shard in enumerate(shards[1:], start=1):
            if _without(shard.shape, dim) != first_rest or shard.dtype != shards[0].dtype:
                raise ValueError(
                    f"shard {index} ({_describe(shard)}) does not match shard 0 ({_describe(shards[0])}) "
                    f"outside dim {dim}"
                )
        self.shards: tuple[torch.Tensor, ...] = tuple(shards)
        self.dim = dim
        self._sizes = tuple(shard.shape[dim] for shard in self.shards)
        shape = list(self.shards[0].shape)
        shape[dim] = sum(self._sizes)
        self._shape = torch.Size(shape)

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(shard.device for shard in self.shards)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The length of each shard along ``dim``."""
        return self._sizes

    @property
    def shape(self) -> torch.Size:
        """The shape of the gathered tensor."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    def gather(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor on ``device`` (default: the first shard's)."""
        device = self.shards[0].device if device is None else torch.device(device)
        return torch.cat([_to(shard, device) for shard in self.shards], dim=self.dim)

    def __repr__(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return f"Sharded(shape={tuple(self.shape)}, dtype={self.dtype}, dim={self.dim}, devices=[{devices}])"


def gather(tree: PyTree, device: torch.device | str | None = None) -> PyTree:
    """Replaces every ``Sharded`` leaf of ``tree`` by its gathered tensor on ``device`` (default: its first shard's).

    Example:
        >>> import torch, fadam
        >>> fadam.gather({"w": fadam.Sharded([torch.ones(1), torch.zeros(1)]), "n": None})
        {'w': tensor([1., 0.]), 'n': None}
    """
    return tree_map(lambda x: x.gather(device) if isinstance(x, Sharded) else x, tree)


InDims = int | None | Sequence[int | None]


def pmap(
    fn: Callable[..., Any],
    devices: Sequence[torch.device | str] | None = None,
    in_dims: InDims = 0,
    out_dims: int = 0,
) -> Callable[..., Any]:
    """JAX's ``pmap`` for torch: ``torch.func.vmap(fn)`` with the mapped axis split across devices.

    Calling the result splits the ``in_dims`` axis of every tensor in the positional arguments into one contiguous
    shard per device (sizes as ``torch.tensor_split``), moves each shard to its device (``non_blocking``), and runs
    ``vmap(fn)`` on it there. Nothing waits for the host: on CUDA the devices' kernels are queued one device after the
    other from this thread and run concurrently. Every tensor of the output becomes a ``Sharded`` leaf whose shards
    stay on their devices, split along ``out_dims``; ``fadam.gather`` collects them explicitly. A ``Sharded`` input
    whose shards match the split is used where it lives; any other is gathered and split again.

    ``pmap(tx.init)`` and ``pmap(tx.update)`` run an ensemble's optimizer on several devices; each member's result
    equals its own separate run.

    Args:
        fn: a function ``vmap`` can batch (every fadam ``init``/``update``, ``apply_updates``).
        devices: the devices, one shard each (the same device may appear twice). Default: every visible CUDA device.
        in_dims: the mapped axis of each positional argument: an int for all, or one int or ``None`` per argument;
            ``None`` copies that argument to every device unsplit (e.g. a shared learning rate). Keyword arguments
            are always copied, never split.
        out_dims: the axis of the outputs along which the shards are stacked.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.adam(lr=0.1)
        >>> params = {"w": torch.ones(4, 3)}  # 4 members with 3 weights each
        >>> cpus = [torch.device("cpu")] * 2
        >>> state = fadam.pmap(tx.init, cpus)(params)
        >>> updates, state = fadam.pmap(tx.update, cpus)({"w": torch.ones(4, 3)}, state, params)
        >>> updates["w"]
        Sharded(shape=(4, 3), dtype=torch.float32, dim=0, devices=[cpu, cpu])
        >>> fadam.gather(updates)["w"][:, 0]
        tensor([-0.1000, -0.1000, -0.1000, -0.1000])
    """
    if devices is None:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise ValueError("pmap: no CUDA device is visible; pass devices=[...] (e.g. [torch.device('cpu')] * 2)")
        devices = [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("pmap needs at least one device")
    if not isinstance(out_dims, int):
        raise TypeError(f"pmap: out_dims must be an int, got {out_dims!r}")

    def mapped(*args: Any, **kwargs: Any) -> Any:
        dims = _arg_dims(in_dims, len(args))
        sizes = _split_sizes(args, dims, len(devices))
        per_device: list[list[Any]] = [[] for _ in devices]
        for index, (arg, dim) in enumerate(zip(args, dims)):
            leaves, spec = tree_flatten(arg)
            sharded = [_shard_leaf(leaf, dim, devices, sizes, index, spec, i) for i, leaf in enumerate(leaves)]
            for k in range(len(devices)):
                per_device[k].append(spec.unflatten([shards[k] for shards in sharded]))
        outputs = []
        for k, device in enumerate(devices):
            device_kwargs = tree_map(lambda x, d=device: _to(x, d) if isinstance(x, torch.Tensor) else x, kwargs)
            with _on(device):
                vmapped = torch.func.vmap(fn, in_dims=tuple(dims), out_dims=out_dims)
                outputs.append(vmapped(*per_device[k], **device_kwargs))
        return _merge(outputs, out_dims)

    return mapped


def _without(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return tuple(size for axis, size in enumerate(shape) if axis != dim)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}, {x.dtype}, {x.device}"
    return type(x).__name__


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; copies to an accelerator do not wait for the host (a copy to the CPU must)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=device.type != "cpu")


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Makes ``device`` current for CUDA (its streams and ``.cuda()`` calls); factory defaults stay unchanged, so
    step counts are still created on the CPU as everywhere in fadam."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _arg_dims(in_dims: InDims, n_args: int) -> list[int | None]:
    if in_dims is None or isinstance(in_dims, int):
        return [in_dims] * n_args
    dims = list(in_dims)
    if len(dims) != n_args:
        raise ValueError(f"pmap: in_dims has {len(dims)} entries but the function got {n_args} positional arguments")
    for dim in dims:
        if dim is not None and not isinstance(dim, int):
            raise TypeError(f"pmap: each in_dims entry must be an int or None, got {dim!r}")
    return dims


def _split_sizes(args: Sequence[Any], dims: Sequence[int | None], n_devices: int) -> list[int]:
    """Shard lengths along the mapped axis, checking that every mapped tensor has the same length there."""
    length, where = None, ""
    for index, (arg, dim) in enumerate(zip(args, dims)):
        if dim is None:
            continue
        leaves, spec = tree_flatten(arg)
        for path, leaf in zip(spec.paths(), leaves):
            if not isinstance(leaf, torch.Tensor | Sharded):
                continue
            if not -len(leaf.shape) <= dim < len(leaf.shape):
                raise ValueError(
                    f"pmap: argument {index} leaf at {path_str(path)} has shape {tuple(leaf.shape)}, "
                    f"no axis {dim} to map over"
                )
            size = leaf.shape[dim]
            if length is None:
                length, where = size, f"argument {index} leaf at {path_str(path)}"
            elif size != length:
                raise ValueError(
                    f"pmap: argument {index} leaf at {path_str(path)} has {size} entries along axis {dim} but "
                    f"{where} has {length}"
                )
    if length is None:
        raise ValueError("pmap: no argument has a tensor to split; give at least one in_dims that is not None")
    if length < n_devices:
        raise ValueError(f"pmap: {length} entries along the mapped axis cannot be split across {n_devices} devices")
    return [len(chunk) for chunk in torch.arange(length).tensor_split(n_devices)]


def _shard_leaf(
    leaf: Any,
    dim: int | None,
    devices: Sequence[torch.device],
    sizes: Sequence[int],
    arg: int,
    spec: Any,
    index: int,
) -> list[Any]:
    """One piece of ``leaf`` per device: its shard along ``dim``, or a copy of all of it when ``dim`` is None."""
    if isinstance(leaf, Sharded):
        if dim is not None and leaf.dim == dim % len(leaf.shape) and list(leaf.sizes) == list(sizes):
            return [_to(shard, device) for shard, device in zip(leaf.shards, devices)]
        leaf = leaf.gather(devices[0])
    if not isinstance(leaf, torch.Tensor):
        if dim is not None and leaf is not None:
            raise TypeError(
                f"pmap: argument {arg} leaf at {path_str(spec.paths()[index])} is a {type(leaf).__name__}; only "
                "tensors can be "
                "split (give this argument in_dims None)"
            )
        return [leaf] * len(devices)
    if dim is None or len(devices) == 1:
        return [_to(leaf, device) for device in devices]
    return [_to(shard, device) for shard, device in zip(leaf.split(list(sizes), dim), devices)]


def _merge(outputs: list[Any], out_dims: int) -> Any:
    """Transposes per-device output trees into one tree of ``Sharded`` leaves."""
    leaves, spec = tree_flatten(outputs[0])
    columns = [leaves]
    for k, output in enumerate(outputs[1:], start=1):
        other, other_spec = tree_flatten(output)
        if other_spec != spec:
            raise ValueError(f"pmap: the function returned differently structured outputs on device 0 and {k}")
        columns.append(other)
    merged = []
    for path, pieces in zip(spec.paths(), zip(*columns)):
        if isinstance(pieces[0], torch.Tensor):
            merged.append(Sharded(pieces, out_dims))
        elif all(piece == pieces[0] for piece in pieces[1:]):
            merged.append(pieces[0])
        else:
            raise ValueError(f"pmap: output leaf at {path_str(path)} is not a tensor and differs between devices")
    return spec.unflatten(merged)
