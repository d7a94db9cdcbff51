"""``page_state``: keep any transform's state off the compute device and stream it in, chunk by chunk."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import torch
from torch._C import _functorch

from fadam._base import FusibleUpdate, GradientTransformation, add_update
from fadam._dispatch import can_write_in_place, is_dtensor
from fadam._execute import fast_step, run_update
from fadam._program import join_states, split_state
from fadam._tree import PyTree, check_leaves, path_str, tree_flatten
from fadam.paging._checksum import ChunkChecksum, Spans
from fadam.paging._storage import (
    Commit,
    LeafPlace,
    PagedStateFileError,
    StateFile,
    host_buffers,
    leaf_places,
    release_freed_memory,
    remove_stale_temporaries,
    view_leaf,
)

DEFAULT_CHUNK_BYTES = 64 << 20


class PagedState(NamedTuple):
    """The state of ``page_state``: where the inner state lives and how it is laid out, never the state itself on
    the compute device."""

    serial: torch.Tensor  # 0-d int64: the commit this state is (disk: names the slot holding it)
    store_id: torch.Tensor  # 0-d int64: the disk file's random id (0 for host storage)
    path: torch.Tensor  # uint8: the disk file's path, UTF-8 (empty for host storage)
    chunks: tuple[torch.Tensor, ...]  # per chunk: int64 indices of the param leaves it covers
    # per chunk: the inner state, every tensor leaf replaced by a meta tensor (a DTensor leaf: a DTensor of the same
    # global shape, mesh and placements whose local shard is a meta tensor; the storage holds the local shard)
    layout: tuple[PyTree, ...]
    placement: tuple[torch.Tensor, ...]  # per chunk, per tensor leaf: 1 = lives on the params' device, 0 = on the CPU
    buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # host storage: per chunk, its two slots; disk: ()
    # host storage: int64 (2,), the commit each slot holds (-1 while written), shared by the states of one init
    slot_serials: torch.Tensor


class _Split(NamedTuple):
    """How one dtype's leaves of a chunk are cut out of its bytes with a single ``split_with_sizes``: the buffer,
    viewed as ``dtype``, splits into ``sizes`` (gaps and leaves alternating); ``pieces`` names the leaves' parts as
    (part, leaf index, shape)."""

    dtype: torch.dtype
    sizes: list[int]
    pieces: list[tuple[int, int, tuple[int, ...]]]


class _Chunk(NamedTuple):
    spec: Any
    meta_leaves: list[Any]
    places: list[LeafPlace]
    size: int
    on_device: dict[int, bool]  # per tensor leaf, by its index: whether it lives on the params' device
    place_of: dict[int, LeafPlace]  # per tensor leaf, by its index: its place in the chunk's bytes
    spans: Spans  # what the chunk's checksum reads
    splits: list[_Split]
    dtensors: bool  # whether any leaf is a DTensor


def _local(x: Any) -> Any:
    """The local shard of a DTensor (what the storage holds), anything else as it is."""
    return x.to_local() if is_dtensor(x) else x


def _meta(x: Any) -> Any:
    """The layout leaf of a state leaf: a meta tensor like it (a DTensor keeps its mesh, placements and shape)."""
    if not isinstance(x, torch.Tensor):
        return x
    local = _local(x)
    meta = torch.empty(local.shape, dtype=local.dtype, device="meta")
    return _placed_like(meta, x) if is_dtensor(x) else meta


def _placed_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` as the shard of a DTensor laid out like the DTensor ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _chunk(layout: PyTree, placement: torch.Tensor) -> _Chunk:
    meta_leaves, spec = tree_flatten(layout)
    places, size = leaf_places([_local(x) for x in meta_leaves])
    dtensors = any(is_dtensor(x) for x in meta_leaves)
    on_device = {place.index: bool(flag) for place, flag in zip(places, placement.tolist())}
    place_of = {place.index: place for place in places}
    spans = Spans.of(places)
    return _Chunk(spec, meta_leaves, places, size, on_device, place_of, spans, _splits(places, size), dtensors)


def _splits(places: list[LeafPlace], size: int) -> list[_Split]:
    """Per dtype, the cuts that give all of a chunk's leaves of that dtype in one call (leaf offsets are 64-byte
    aligned and the chunk's size a page multiple, so every gap is whole elements)."""
    by_dtype: dict[torch.dtype, list[LeafPlace]] = {}
    for place in places:
        by_dtype.setdefault(place.dtype, []).append(place)
    found = []
    for dtype, members in by_dtype.items():
        width, sizes, pieces, end = dtype.itemsize, [], [], 0
        for place in members:  # in order of offset
            sizes.append((place.offset - end) // width)
            pieces.append((len(sizes), place.index, place.shape))
            sizes.append(place.nbytes // width)
            end = place.offset + place.nbytes
        sizes.append((size - end) // width)
        found.append(_Split(dtype, sizes, pieces))
    return found


def _views(buffer: torch.Tensor, chunk: _Chunk) -> list[tuple[int, torch.Tensor]]:
    """(leaf index, zero-copy view of ``buffer``) for each tensor leaf of the chunk: a split per dtype, not a slice
    per leaf (per-leaf Python is most of a step over many small leaves)."""
    found = []
    for split in chunk.splits:
        parts = buffer.view(split.dtype).split_with_sizes(split.sizes)
        for part, index, shape in split.pieces:
            view = parts[part]
            found.append((index, view if len(shape) == 1 else view.view(shape)))
    return found


def _cpu_state(buffer: torch.Tensor, chunk: _Chunk) -> tuple[PyTree, list[Any]]:
    """A chunk's state as zero-copy views of ``buffer`` (its DTensor leaves as their local shards), and its
    leaves."""
    leaves = list(chunk.meta_leaves)
    for index, view in _views(buffer, chunk):
        leaves[index] = view
    return chunk.spec.unflatten(leaves), leaves


class _BufferViews:
    """Each storage buffer's chunk state (``_cpu_state``), made once per buffer: a host buffer, or a window of a
    file mapped whole, is the same tensor at every step of its state, and making the views (a ``split_with_sizes``
    of thousands of parts for quantized state) and their tree was most of the Python a paged step spends per leaf.
    An entry lives as long as its buffer (``weakref.finalize``); its tree and leaves are shared, never modified."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[weakref.ref, _Chunk, tuple[PyTree, list[Any]]]] = {}

    def of(self, buffer: torch.Tensor, chunk: _Chunk) -> tuple[PyTree, list[Any]]:
        key = id(buffer)
        entry = self._found.get(key)
        if entry is not None and entry[0]() is buffer and entry[1] is chunk:
            return entry[2]
        state = _cpu_state(buffer, chunk)
        if entry is None:  # the first entry of this buffer: it goes when the buffer does
            weakref.finalize(buffer, self._found.pop, key, None)
        self._found[key] = (weakref.ref(buffer), chunk, state)
        return state


class _Layouts:
    """What a state's layout gives each step (its chunks' leaf places and splits, the param groups), computed once
    per layout: the states of successive steps share their layout's objects."""

    SIZE = 4  # layouts kept: a few live states of one transform (e.g. of separate inits)

    def __init__(self) -> None:
        self.found: dict[int, tuple[tuple, list[_Chunk], list[list[int]]]] = {}

    def of(self, state: PagedState) -> tuple[list[_Chunk], list[list[int]]]:
        key = (state.layout, state.placement, state.chunks)
        entry = self.found.get(id(state.layout))
        if entry is None or any(a is not b for a, b in zip(entry[0], key)):
            chunks = [_chunk(layout, placement) for layout, placement in zip(state.layout, state.placement)]
            entry = (key, chunks, [group.tolist() for group in state.chunks])
            if len(self.found) >= self.SIZE:
                del self.found[next(iter(self.found))]
            self.found[id(state.layout)] = entry  # holds ``key``: its ids are not reused while it is here
        return entry[1], entry[2]


def _describe(layout: PyTree, group: list[int]) -> dict:
    meta_leaves, spec = tree_flatten(layout)
    places, size = leaf_places([_local(x) for x in meta_leaves])
    leaves = [[list(place.shape), str(place.dtype).removeprefix("torch.")] for place in places]
    return {"params": group, "tree": str(spec), "leaves": leaves, "size": size}


def _tensor_bytes(tree: PyTree) -> int:
    leaves = [_local(x) for x in tree_flatten(tree)[0]]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def _probe_bytes(inner: GradientTransformation, leaf: Any) -> int:
    """Bytes of ``inner``'s state for one param leaf, from an init on the meta device (no memory) where it works."""
    if isinstance(leaf, torch.Tensor):
        try:
            return _tensor_bytes(inner.init([torch.empty_like(leaf, device="meta")]))
        except Exception:  # an init that needs real values (e.g. data-dependent): measure it for real
            pass
    return _tensor_bytes(inner.init([leaf]))


def _plan(inner: GradientTransformation, leaves: list[Any], chunk_bytes: int | None, storage: str) -> list[list[int]]:
    """Groups consecutive param leaves of one device into chunks of about ``chunk_bytes`` of inner state each
    (``None``: as ``_chunk_limit`` says)."""
    groups: list[list[int]] = []
    size, device = 0, None
    for index, leaf in enumerate(leaves):
        leaf_device = leaf.device if isinstance(leaf, torch.Tensor) else None
        limit = _chunk_limit(chunk_bytes, storage, leaf_device)
        nbytes = 0 if limit is None else _probe_bytes(inner, leaf)
        if not groups or leaf_device != device or (limit is not None and size + nbytes > limit and groups[-1]):
            groups.append([])
            size, device = 0, leaf_device
        groups[-1].append(index)
        size += nbytes
    return groups


def _chunk_limit(chunk_bytes: int | None, storage: str, device: torch.device | None) -> int | None:
    """The bytes of state a chunk of leaves on ``device`` holds at most; ``None``: no limit. Unless given, CPU
    leaves in host storage form one chunk: their step reads and writes the host buffers where they lie, so chunks
    would bound no copy, and each chunk is one more inner step to prepare."""
    if chunk_bytes is not None:
        return chunk_bytes
    if storage == "host" and (device is None or device.type == "cpu"):
        return None
    return DEFAULT_CHUNK_BYTES


def _first_difference(found: dict, expected: dict) -> str:
    chunks_found, chunks_expected = found["chunks"], expected["chunks"]
    if len(chunks_found) != len(chunks_expected):
        return (
            f"it has {len(chunks_found)} chunks, this model and optimizer make {len(chunks_expected)} "
            "(same params, inner transform, chunk_bytes and per_leaf?)"
        )
    for k, (a, b) in enumerate(zip(chunks_found, chunks_expected)):
        if a["params"] != b["params"]:
            return f"chunk {k} covers param leaves {a['params'][:8]}..., expected {b['params'][:8]}..."
        if a["tree"] != b["tree"]:
            return f"chunk {k} has state structure {a['tree']}, expected {b['tree']}"
        for i, (x, y) in enumerate(zip(a["leaves"], b["leaves"])):
            if x != y:
                return f"chunk {k} state leaf {i} is {x[1]}{tuple(x[0])}, expected {y[1]}{tuple(y[0])}"
        if len(a["leaves"]) != len(b["leaves"]):
            return f"chunk {k} has {len(a['leaves'])} state leaves, expected {len(b['leaves'])}"
    return "the descriptions differ"


class _Streams:
    """CUDA side streams: host-to-device copies of the next chunk and device-to-host write-back of the previous one
    run while the current chunk computes on the caller's stream."""

    def __init__(self, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)


def _materialize(
    buffer: torch.Tensor,
    chunk: _Chunk,
    device: torch.device,
    streams: _Streams | None,
    state_of: Callable[[torch.Tensor, _Chunk], tuple[PyTree, list[Any]]] = _cpu_state,
) -> tuple[PyTree, list[Any]]:
    """One chunk's inner state on ``device``, and its leaves: CPU leaves are views of ``buffer`` (``state_of``'s,
    as they are where no leaf is a DTensor); device leaves are copies, made on the copy stream when ``streams`` is
    given (``_pipeline`` makes the compute stream wait for them)."""
    tree, views = state_of(buffer, chunk)
    if device.type == "cpu" and not chunk.dtensors:  # the common case: views only, no per-leaf work
        return tree, views
    leaves = list(chunk.meta_leaves)
    for place in chunk.places:
        index, view = place.index, views[place.index]
        if chunk.on_device[index] and device.type != "cpu":
            if streams is not None:
                with torch.cuda.stream(streams.h2d):
                    view = view.to(device, non_blocking=True)
            else:
                view = view.to(device)
        meta = chunk.meta_leaves[index]
        leaves[index] = _placed_like(view, meta) if is_dtensor(meta) else view
    return chunk.spec.unflatten(leaves), leaves


class _StorageAccess:
    """One update's access to the storage: the buffer to read each chunk from, the buffer to write it to, and the
    commit at the end."""

    def __init__(self, state: PagedState, state_file: StateFile | None, durable: bool, in_place: bool) -> None:
        self.state, self.file, self.durable = state, state_file, durable
        self.in_place = in_place and state_file is None  # a donated host state is updated in its own buffers
        if state_file is None:
            self.serials, serial = state.slot_serials.tolist(), int(state.serial)
            if serial not in self.serials:
                raise ValueError(
                    f"stale paged state: it is commit {serial}, but its buffers now hold commits {self.serials}; a "
                    "paged state can be updated only while its buffers have not been overwritten (the latest state "
                    "or the one before it, and not after donating it)"
                )
            self.read_slot = self.serials.index(serial)
            self.write_slot = self.read_slot if self.in_place else 1 - self.read_slot
        else:
            if int(state.store_id) != state_file.file_id:
                raise PagedStateFileError(
                    f"this paged state belongs to another file than {state_file.path} (was the file re-created "
                    "by another init?)"
                )
            self.read_commit = state_file.find(int(state.serial))
            self.write_commit: Commit | None = None
            self.checksums = [ChunkChecksum() for _ in state_file.chunk_sizes]  # of the chunks written

    def begin(self) -> None:
        if self.file is None:
            self.new_serial = max(self.serials) + 1  # serials are never reused
            self.state.slot_serials[self.write_slot] = -1  # the slot being written is invalid until ``finish``
        else:
            self.write_commit = self.file.begin(self.read_commit, self.durable)
            self.new_serial = self.write_commit.serial
        # made now, not after the step: a step over more state than the caches hold leaves them cold, and even
        # one small tensor op then costs tens of microseconds
        self.serial = torch.tensor(self.new_serial, dtype=torch.int64)

    def read(self, k: int) -> torch.Tensor:
        if self.file is None:
            return self.state.buffers[k][self.read_slot]
        return self.file.window(k, self.read_commit.slot)

    def write(self, k: int) -> torch.Tensor:
        """Host: the buffer the new state goes to (the spare one, or the state's own when donated). Disk: a writable
        map of the slot being written, where a fused step updates the chunk in place."""
        if self.file is None:
            return self.state.buffers[k][self.write_slot]
        return self.file.window(k, self.write_commit.slot, writable=True)

    def store(self, k: int, place: LeafPlace, leaf: torch.Tensor) -> None:
        """Writes one leaf of chunk ``k`` with ``pwrite``; the leaves of a chunk come in order of offset, as its
        checksum needs."""
        self.file.write(k, self.write_commit.slot, place, leaf, self.checksums[k])

    def stored(self, k: int, window: torch.Tensor, spans: Spans, sums: dict[int, bytes]) -> None:
        """Chunk ``k``'s new state lies in ``window`` (from ``write``): its checksum, from the sums the kernel took
        of the leaves it wrote there (``sums``, by data pointer) and from the bytes of the others."""
        self.checksums[k] = ChunkChecksum.of_leaves(window, spans, sums)

    def advise(self, k: int) -> None:
        if self.file is not None:
            self.file.advise(k, self.read_commit.slot)

    def finish(self) -> PagedState:
        state = self.state
        if self.file is None:
            state.slot_serials[self.write_slot] = self.new_serial
        else:
            self.file.commit(self.write_commit, [checksum.value for checksum in self.checksums], self.durable)
        return state._replace(serial=self.serial)


def _refuse_functorch(leaves: list[Any], where: str) -> None:
    """Paged state lives in a storage, not in the tensors passed in, so torch.func cannot batch or differentiate it."""
    if any(isinstance(x, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(x) for x in leaves):
        raise ValueError(
            f"page_state's {where} cannot run under torch.func transforms (vmap, grad): the state lives in host "
            "memory or a file outside the traced tensors; vmap or differentiate the unpaged transform instead"
        )


def _refuse_meta(leaves: list[Any], spec: Any) -> None:
    """A param on the meta device holds no data, so no state of it can be stored (checked before anything is made)."""
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            where = path_str(spec.paths()[index])
            raise ValueError(f"page_state cannot page the state of param {where}: it is on the meta device (no data)")


def leafwise(tx: GradientTransformation) -> bool:
    """Whether ``tx``'s update of a param leaf reads no other leaf, as its declaration shows: every member declares
    per-element math (``fadam._program.Elementwise``) without a reduction over several leaves (``reduce``; a leaf's
    own, ``reduce_leaf``, is fine) and selects no leaves by a mask, which may be given as a tree of the params. An
    opaque member, or one that builds its inner transform at each step (``inject_hyperparams``), may look anywhere."""
    program = getattr(tx.update, "program", None)
    return program is not None and all(
        stage.decl is not None and stage.decl.reduce is None and not stage.selections for stage in program.stages
    )


def page_state(
    inner: GradientTransformation,
    storage: Literal["host", "disk"] = "host",
    path: str | os.PathLike | None = None,
    chunk_bytes: int | None = None,
    *,
    per_leaf: bool | None = None,
    resume: bool = False,
    durable: bool = False,
) -> GradientTransformation:
    r"""Keeps ``inner``'s state in host memory or in a file and streams it to the compute device during ``update``.

    The results are bit-identical to ``inner``'s: each chunk of state is copied to the device of its gradients,
    ``inner`` updates it there, and the new state is written back to storage (one exception: the state of a strided
    param, a transposed view, comes back dense, so a reduction over values computed from it, a global norm, adds
    them up in another order than ``inner`` on its own, which keeps that state in the param's strides):

    .. math::
        (u_k, s_k') = \mathrm{inner.update}(g_k, \mathrm{fetch}(s_k), p_k), \quad \mathrm{store}(s_k'),
        \quad k = 1, \dots, K

    **Chunks.** With ``per_leaf=True`` the params are split into chunks of consecutive leaves holding about
    ``chunk_bytes`` of inner state each, and ``inner`` runs on each chunk separately, with its own state (its params
    are a list of that chunk's leaves, so a mask given as a tree shaped like the params needs ``per_leaf=False``; a
    callable mask works either way). This is exact only for transforms whose update of one param leaf never looks at
    another (Adam, AdamW, SGD, quantized state). Anything that couples leaves (``clip_by_global_norm``, a global norm)
    needs ``per_leaf=False``: the whole state is one chunk, streamed in, updated once, streamed out; still
    bit-identical, but all of it is on the device during the update. The default, ``None``, decides from ``inner``'s
    declaration (``leafwise``): chunks of leaves where every member of ``inner`` declares per-element math with no
    reduction across leaves and no mask, one chunk otherwise (an opaque transform, ``inject_hyperparams``, a mask).
    A single leaf is never split; unless ``chunk_bytes`` is given, CPU params in host storage are one chunk, since their
    step reads and writes the host buffers where they lie. At most two chunks of state are materialized at once: the one
    being updated and the next one, whose copy runs while the current one computes (on CUDA on a side stream from
    page-locked memory; from disk the kernel reads the next chunk ahead). A fused step on the CPU of a file that
    stays mapped steps all of its chunks in one call of the generated kernel: they are views of the map, which
    cost no memory, and one call spares each chunk an inner step's work.

    **Storages.** ``"host"``: two buffers per chunk in CPU memory (page-locked when params are on an accelerator).
    ``"disk"``: a file at ``path``, kept open between updates, so the state may exceed RAM: a file that fits in a
    quarter of the available memory stays mapped (its pages are mapped once), a larger one is mapped a chunk at a
    time (resident memory stays at about two chunks). A fused step on the CPU (``fadam.step``) reads a chunk's
    current copy where it lies and writes the new state into a writable map of the other copy, in the page cache (no
    buffer in between, no copy in or out): the generated kernel does that;
    torch's fused kernels, which update their state in place, would need the copy made first, so a disk-paged chain
    of theirs (``adamw``) takes the generated kernel instead, whose numbers are the eager path's. ``update`` on the
    CPU does the same where the generated kernel runs the inner transform's program (host state: into the spare
    buffer); leaves it does not take, and steps on an accelerator, write each new leaf with ``pwrite`` (host state:
    a copy into the spare buffer). The file is a checkpoint:
    ``page_state(..., resume=True)``'s ``init`` reopens it after checking that it belongs to the same model and
    optimizer. It keeps two copies of the state; an update writes the other copy and then flips a commit record, so a
    killed process leaves either the previous or the new step, never a mix, and a file whose creation was interrupted
    is reported as incomplete. Each commit records a 64-bit checksum of every chunk it wrote (two running sums over
    its 64-bit words, ``fadam.paging._checksum``), computed from the bytes written, never read back from the file: a
    generated kernel that writes the new state into the file adds up each of its rows as it writes it (no second
    pass), other updates take one more pass over the state in memory, at memory speed on
    ``torch.get_num_threads()`` threads;
    ``resume=True`` reads the committed state once to check it and refuses a file whose data does not match, naming
    the chunk. Updates do not re-check what they read (that would be a second pass over the state every step). A
    file of an older format (1: no checksums; 2: CRC-32 checksums) is refused. An ``init`` on ``path`` removes the
    ``<path>.tmp-<pid>`` files that killed inits left behind, where that process is gone. ``durable=True`` also
    flushes to the disk before each commit (power-loss safety, at the cost of writing the state to the disk every
    step).

    **Purity.** ``update`` never writes the storage its input state reads: it writes the spare copy, which the
    returned state reads. The input state stays valid until the next update overwrites that spare, so an update may
    be retried from the state before it (a skipped step); a state older than that is refused as stale. ``fadam.step``
    applies each chunk's updates as soon as they are computed, so with ``per_leaf=True`` the full update tree is
    never materialized either, and steps each chunk by the backend the unpaged step would take (torch's fused
    kernel, the generated kernel; on disk the generated one, as said above); with ``donate=True`` a host state is
    updated in its own buffers (the caller gave it up), while a disk state still goes to the other copy (the file
    must stay consistent).

    **DTensor params (FSDP2).** The storage holds each rank's local shard of a DTensor state leaf, and the layout
    keeps its mesh, placements and global shape, so a chunk streams in as DTensors laid out as ``inner`` made them;
    each rank pages only its own shards (a disk ``path`` must then differ per rank).

    The storage lives outside autograd and ``torch.func``: page a state for eager training loops, not inside
    ``vmap``, ``grad`` or ``torch.compile``. One process at a time may use a state file.

    Args:
        inner: the transform whose state is paged.
        storage: ``"host"`` or ``"disk"``.
        path: the state file for ``"disk"``; ``None``: a new file in the temp directory per ``init``, removed once
            no state refers to it.
        chunk_bytes: target bytes of inner state per chunk (``per_leaf=True`` only); ``None``: 64 MiB
            (``DEFAULT_CHUNK_BYTES``), except that CPU params in host storage form one chunk (their step reads and
            writes the host buffers in place, so a chunk would bound no copy and only add an inner step's work).
        per_leaf: ``inner`` treats each param leaf independently, so it may run chunk by chunk; ``None``: as
            ``inner``'s declaration says (``leafwise``).
        resume: ``init`` reopens the existing file at ``path`` instead of creating it.
        durable: ``fsync`` the file before each commit.

    Example:
        >>> import torch, fadam
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> tx = fadam.page_state(fadam.adam(lr=0.1))  # chunks of leaves: Adam steps each leaf on its own
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -0.5])}, state, params)
        >>> fadam.apply_updates(params, updates)["w"]
        tensor([ 0.9000, -0.9000])

    References:
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022 (paged optimizers).
        Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", 2021.
    """
    if storage not in ("host", "disk"):
        raise ValueError(f"storage must be 'host' or 'disk', got {storage!r}")
    if storage == "host" and (path is not None or resume):
        raise ValueError("path and resume apply to storage='disk' only")
    if chunk_bytes is not None and not chunk_bytes > 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if path is None and resume:
        raise ValueError("resume=True needs the path of the state file")
    given_path = os.fspath(path) if path is not None else None
    if per_leaf is None:
        per_leaf = leafwise(inner)

    layouts = _Layouts()
    held = _HeldFile()
    buffer_views = _BufferViews()

    def chunk_params(leaves: list[Any], params: PyTree, group: list[int]) -> PyTree:
        return [leaves[i] for i in group] if per_leaf else params

    def init(params: PyTree) -> PagedState:
        leaves, spec = tree_flatten(params)
        _refuse_functorch(leaves, "init")
        if per_leaf:
            groups = _plan(inner, leaves, chunk_bytes, storage)
        else:
            devices = {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}
            if len(devices) > 1:
                names = sorted(map(str, devices))
                raise ValueError(f"page_state with per_leaf=False needs params on one device, got {names}")
            groups = [list(range(len(leaves)))]
        _refuse_meta(leaves, spec)
        pin = (
            storage == "host"
            and torch.cuda.is_available()
            and any(isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda" for leaf in leaves)
        )
        file_path = given_path
        if storage == "disk" and file_path is None:
            file_path = _temporary_path()  # a new file per init: states of separate inits stay independent
        if storage == "disk":
            remove_stale_temporaries(file_path)
        layouts, placements, buffers, descriptions = [], [], [], []

        def build(write_chunk: Callable[[dict, list[Any], list[LeafPlace]], None] | None) -> None:
            for group in groups:
                inner_state = inner.init(chunk_params(leaves, params, group))
                state_leaves, spec = tree_flatten(inner_state)
                layouts.append(spec.unflatten([_meta(x) for x in state_leaves]))
                state_leaves = [_local(x) for x in state_leaves]  # DTensor state: the storage holds its shard
                placements.append(
                    torch.tensor(
                        [x.device.type != "cpu" for x in state_leaves if isinstance(x, torch.Tensor)], dtype=torch.uint8
                    )
                )
                description = _describe(layouts[-1], group)
                descriptions.append(description)
                if write_chunk is not None:
                    write_chunk(description, state_leaves, leaf_places(state_leaves)[0])

        def write_host(description: dict, state_leaves: list[Any], places: list[LeafPlace]) -> None:
            first, second = host_buffers(description["size"], pin)
            for place in places:
                view_leaf(first, place).copy_(state_leaves[place.index])
            buffers.append((first, second))

        store_id = 0
        if storage == "host":
            build(write_host)
        elif resume:
            build(None)
            release_freed_memory()
            state_file = StateFile.open(file_path)
            try:
                found = state_file.description
                expected = {"version": found["version"], "chunks": descriptions}
                stripped = {**found, "chunks": [{k: v for k, v in c.items() if k != "offset"} for c in found["chunks"]]}
                if stripped != expected:
                    raise PagedStateFileError(
                        f"{file_path} holds the state of a different model or optimizer: "
                        f"{_first_difference(stripped, expected)}"
                    )
                latest = state_file.latest()
                state_file.verify(latest)
                serial, store_id = latest.serial, state_file.file_id
            finally:
                state_file.close()
        else:
            with StateFile.create(file_path, durable) as builder:
                build(builder.add_chunk)
                store_id, serial = builder.file_id, 1
            release_freed_memory()
        if storage == "host":
            serial = 0
        path_bytes = torch.tensor(list(file_path.encode()) if storage == "disk" else [], dtype=torch.uint8)
        if storage == "disk" and given_path is None:
            weakref.finalize(path_bytes, _remove, file_path)  # the temporary file lives as long as its states
        return PagedState(
            torch.tensor(serial, dtype=torch.int64),
            torch.tensor(store_id, dtype=torch.int64),
            path_bytes,
            tuple(torch.tensor(group, dtype=torch.int64) for group in groups),
            tuple(layouts),
            tuple(placements),
            tuple(buffers),
            torch.tensor([0, -1] if storage == "host" else [], dtype=torch.int64),
        )

    # an update by the inner transform's declared program writes the new state it computes into storage
    program = getattr(inner.update, "program", None)
    direct = program if program is not None and getattr(inner.update, "fused_step", None) is None else None

    def chunk_update(
        grads_k: PyTree, chunk: _Fetched, params_k: PyTree | None, extra_args: dict[str, Any]
    ) -> tuple[PyTree, PyTree]:
        """``inner.update`` of one chunk; where the generated kernel runs its program on the CPU, the new slots go
        straight into the places ``chunk.target`` gives (summed for the checksum on the way), not into new tensors
        that are then copied there."""
        target = chunk.target(spare=True) if direct is not None and not extra_args else None
        if target is not None:
            done = run_update(direct, grads_k, chunk.state, params_k, into=target, sums=chunk.sums)
            if done is not None:
                return done
        return inner.update(grads_k, chunk.state, params_k, **extra_args)

    def run(
        updates: PyTree,
        state: PagedState,
        params: PyTree | None,
        extra_args: dict[str, Any],
        consume: Callable[[list[int], PyTree], None],
        fused: Callable[[list[int], PyTree, _Fetched], PyTree | None] | None = None,
        in_place: bool = False,
        checked: tuple[list[Any], list[Any]] | None = None,
        fused_whole: Callable[[list[list[int]], list[_Fetched]], list[PyTree] | None] | None = None,
    ) -> PagedState:
        """Streams every chunk through ``inner.update``, hands each chunk's updates to ``consume`` and commits.

        ``fused(group, grads, chunk)``, when given, may instead step the chunk's params with the inner transform's
        fused kernel and return the chunk's new state (``None``: it cannot, take the general path).
        ``fused_whole(groups, chunks)`` may step every chunk at once where the state file is mapped whole (its chunks
        are views of the map, so having all of them at hand costs no memory) and return their new states.
        ``checked``: the leaves of the updates and of the params from the caller's ``check_leaves``, where there are
        params.
        """
        if not isinstance(state, PagedState):
            raise ValueError(f"page_state expected a PagedState, got {type(state).__name__}")
        grad_leaves, param_leaves = checked or (tree_flatten(updates)[0], None)
        chunks, groups = layouts.of(state)
        count = sum(len(group) for group in groups)
        if len(grad_leaves) != count:
            raise ValueError(f"updates have {len(grad_leaves)} leaves but the paged state was built for {count} params")
        if storage == "host" and len(state.buffers) != len(chunks):
            raise ValueError("a host-paged state needs its buffers; was it built with storage='disk'?")
        state_file = held.get(state) if storage == "disk" else None
        try:
            access = _StorageAccess(state, state_file, durable, in_place)
            access.begin()
            pipeline = _pipeline(access, chunks, groups, grad_leaves, buffer_views)
            fetched: list[_Fetched | None] = []
            if fused_whole is not None and state_file is not None and state_file.keeps_windows and len(chunks) > 1:
                fetched = [next(pipeline) for _ in chunks]
                new_states = fused_whole(groups, fetched)
                if new_states is not None:
                    for k, (chunk, new_state) in enumerate(zip(fetched, new_states)):
                        chunk.store(_checked(new_state, chunks[k], k, chunk.given))
                    next(pipeline, None)
                    return access.finish()
            for k in range(len(chunks)):
                # not enumerate/zip: their cached result tuple keeps the previous chunk alive during the next fetch
                if fetched:
                    chunk, fetched[k] = fetched[k], None
                else:
                    chunk = next(pipeline)
                group = groups[k]
                grads_k = [grad_leaves[i] for i in group] if per_leaf else updates
                if fused is not None:
                    new_state = fused(group, grads_k, chunk)
                    if new_state is not None:
                        chunk.store(_checked(new_state, chunks[k], k, chunk.given))
                        del chunk, new_state
                        continue
                params_k = None if param_leaves is None else chunk_params(param_leaves, params, group)
                chunk_updates, new_state = chunk_update(grads_k, chunk, params_k, extra_args)
                new_leaves = _checked(new_state, chunks[k], k, chunk.given)
                chunk.store(new_leaves)
                consume(group, chunk_updates)
                del chunk, new_state, new_leaves
            next(pipeline, None)  # runs to the end: waits for the last write-backs
            return access.finish()
        finally:
            del state_file

    def update(
        updates: PyTree, state: PagedState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PagedState]:
        # the updates' leaves in the params' order, and the params' structure, where mappings of another kind match
        checked = None
        if params is None:
            grad_leaves, spec = tree_flatten(updates)
        else:
            grad_leaves, param_leaves, spec = check_leaves(updates, params)
            checked = (grad_leaves, param_leaves)
        _refuse_functorch(grad_leaves, "update")
        out: list[Any] = [None] * len(grad_leaves)
        whole: list[PyTree] = []

        def collect(group: list[int], chunk_updates: PyTree) -> None:
            if not per_leaf:
                whole.append(chunk_updates)
                return
            for i, u in zip(group, chunk_updates):
                out[i] = u

        new_state = run(updates, state, params, extra_args, collect, checked=checked)
        return (whole[0] if whole else spec.unflatten(out)), new_state

    def fused_step(params: PyTree, grads: PyTree, state: PagedState, donate: bool) -> tuple[PyTree, PagedState] | None:
        # applies each chunk's updates as soon as they exist, so the full update tree is never materialized
        if not per_leaf:
            return None
        grad_leaves, param_leaves, spec = check_leaves(grads, params, what="grads")
        new_params = list(param_leaves)

        def apply(group: list[int], chunk_updates: list[torch.Tensor | None]) -> None:
            for i, u in zip(group, chunk_updates):
                if u is None:
                    continue
                p = param_leaves[i]
                # a DTensor's local shard is written in place
                new_params[i] = add_update(p, u, in_place=donate and can_write_in_place(p))

        # each chunk's leaves take the backends they would take unpaged (the executor decides leaf by leaf), so the
        # numbers are the unpaged step's
        fast = getattr(inner.update, "fused_step", None) or getattr(inner.update, "program", None)

        def fused(group: list[int], grads_k: list[Any], chunk: _Fetched) -> PyTree | None:
            # the inner step's fastest backend (torch._fused_adam_, a generated kernel) steps this chunk in place, on
            # state we own
            params_k = [param_leaves[i] for i in group]
            if not donate:
                params_k = [p.clone() for p in params_k]
            checked = (grads_k, params_k, _list_spec(len(params_k)))  # the check of the whole trees covers the chunk
            target = chunk.target()
            if target is not None:  # a file's slot: the step reads the chunk's state and writes its new one there
                result = fast_step(
                    inner, params_k, grads_k, chunk.state, True, into=target, checked=checked, sums=chunk.sums
                )
            else:
                result = fast_step(inner, params_k, grads_k, chunk.owned(), True, checked=checked)
            if result is None:
                return None
            for i, p in zip(group, result[0]):
                new_params[i] = p
            return result[1]

        def fused_whole(groups: list[list[int]], fetched: list[_Fetched]) -> list[PyTree] | None:
            # every chunk of a file mapped whole in one step: one kernel call for all of them, not one per chunk
            targets = [chunk.target() for chunk in fetched]
            if program is None or any(target is None for target in targets):
                return None
            whole = join_states(program, [chunk.state for chunk in fetched])
            into = join_states(program, targets)
            if whole is None or into is None:
                return None
            order = [i for group in groups for i in group]
            params_all = [param_leaves[i] if donate else param_leaves[i].clone() for i in order]
            grads_all = [grad_leaves[i] for i in order]
            checked = (grads_all, params_all, _list_spec(len(order)))
            sums = fetched[0].sums  # every chunk's (``_pipeline``'s table for a file mapped whole)
            result = fast_step(inner, params_all, grads_all, whole, True, into=into, checked=checked, sums=sums)
            if result is None:
                return None
            for i, p in zip(order, result[0]):
                new_params[i] = p
            return split_state(program, result[1], [chunk.state for chunk in fetched])

        fast_chunk = fused if fast is not None else None
        new_state = run(
            grads,
            state,
            params,
            {},
            apply,
            fast_chunk,
            donate,
            checked=(grad_leaves, param_leaves),
            fused_whole=fused_whole if fast is not None else None,
        )
        return spec.unflatten(new_params), new_state

    # Chunks stream between host memory or a file and the device through Python, outside any graph: inside a compiled
    # step these run eagerly (a graph break; with fullgraph=True, dynamo's error names the reason).
    def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compiler.disable(fn, reason="page_state streams its state chunk by chunk outside the graph")

    return GradientTransformation(eager(init), FusibleUpdate(eager(update), eager(fused_step)))


class _HeldFile:
    """The file of the disk-paged state updated last, kept open (and mapped: see ``StateFile``) until a state of
    another file is updated, the file at its path is replaced, or no state refers to it any more."""

    def __init__(self) -> None:
        self._file: StateFile | None = None
        self._key: weakref.ref | None = None  # the path tensor its states share

    def get(self, state: PagedState) -> StateFile:
        path = _path_of(state)
        if self._file is not None and self._key() is state.path and self._file.same_file(path):
            return self._file
        self.release()
        self._file = StateFile.open(path)
        self._key = weakref.ref(state.path)
        weakref.finalize(state.path, self._release, self._file)
        return self._file

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._key = None

    def _release(self, file: StateFile) -> None:
        if self._file is file:
            self.release()


class _Fetched:
    """One chunk's state on the compute device (``state``, read-only), a copy of it that may be written in place
    (``owned()``), or, on the CPU, the places its new state goes to (``target()``, a state of the same layout over
    the file's writable map; with ``spare=True`` also over a host state's other buffer; ``None`` elsewhere), and how
    its new state goes back to storage (``store``). The leaves ``owned`` or ``target`` handed out (``given``) lie in
    the storage."""

    def __init__(
        self,
        state: PyTree,
        store: Callable[[list[Any]], None],
        owned: Callable[[], PyTree],
        target: Callable[[], PyTree | None],
        given: list[Any],
        sums: dict[int, bytes],
    ) -> None:
        self.state, self.store, self.owned, self.target, self.given = state, store, owned, target, given
        self.sums = sums  # the checksum sums of the leaves the kernel wrote into ``target``, by data pointer


def _pipeline(
    access: _StorageAccess,
    chunks: list[_Chunk],
    groups: list[list[int]],
    grad_leaves: list[Any],
    buffer_views: _BufferViews,
) -> Iterator[_Fetched]:
    """Yields each chunk's state ready for compute, having started the copy of the next one.

    On CUDA with page-locked host storage the next chunk's host-to-device copy and the previous chunk's write-back
    run on side streams while the current chunk computes; before the next chunk is fetched, the previous chunk's
    write-back is waited for, so the device holds at most two chunks of state: the one being updated (with its new
    copy, unless updated in place) and the next one. Elsewhere copies are synchronous, and the kernel is asked to read
    the next chunk ahead from disk. On the CPU a chunk's state is a set of views of its host buffer or file map (one
    ``split_with_sizes`` per dtype), and a leaf the step updated in place is recognised as the view it was given, so
    that a chunk of many small leaves costs little Python.
    """
    devices = [_compute_device(group, grad_leaves) for group in groups]
    pinned = access.file is None and any(b[0].is_pinned() for b in access.state.buffers[:1])
    streams = {d: _Streams(d) for d in set(devices) if d.type == "cuda" and pinned}
    # a window of a file too large to stay mapped is mapped anew at every step
    state_of = buffer_views.of if access.file is None or access.file.keeps_windows else _cpu_state
    # the chunks of a file mapped whole lie in the map at once, so one table of sums by data pointer serves them all
    mapped_sums: dict[int, bytes] | None = {} if access.file is not None and access.file.keeps_windows else None

    def fetch(k: int) -> tuple[PyTree, list[Any], Any, torch.Tensor]:
        stream = streams.get(devices[k])
        buffer = access.read(k)
        state, leaves = _materialize(buffer, chunks[k], devices[k], stream, state_of)
        event = stream.h2d.record_event() if stream is not None else None
        return state, leaves, event, buffer

    written: list[Any] = []
    pending = fetch(0) if chunks else None
    for k in range(len(chunks)):
        state, state_leaves, event, source = pending
        stream = streams.get(devices[k])
        if stream is not None and written and written[-1] is not None:
            written[-1].synchronize()  # bounds the device-resident state to this chunk and the next
        if k + 1 < len(chunks):
            access.advise(k + 1)
            pending = fetch(k + 1)
        if stream is not None:
            stream.main.wait_event(event)
            for leaf in state_leaves:
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                    leaf.record_stream(stream.main)
        # host: the buffer the chunk's new state goes to; disk: the writable map of it, made if a fused step on the
        # CPU asks for a working copy (``owned``), else the new leaves go out with pwrite
        buffer = access.write(k) if access.file is None else None
        working: list[torch.Tensor] = []
        given: list[Any] = []  # the leaves of the CPU working copy ``owned`` handed out, which lie in the storage
        sums: dict[int, bytes] = {} if mapped_sums is None else mapped_sums

        def store(
            new_leaves: list[Any],
            k: int = k,
            buffer: Any = buffer,
            stream: Any = stream,
            working: Any = working,
            given: Any = given,
            sums: Any = sums,
        ) -> None:
            if working:  # disk, updated in its writable map: what is not there yet, then the checksum
                _write_back(working[0], chunks[k], new_leaves, given)
                access.stored(k, working[0], chunks[k].spans, sums)
            elif access.file is not None:
                for place in chunks[k].places:
                    access.store(k, place, _local(new_leaves[place.index]))
            elif stream is None:
                _write_back(buffer, chunks[k], new_leaves, given)
            else:
                written.append(_write_back_async(buffer, chunks[k], new_leaves, stream))
                return
            written.append(None)

        def owned(
            k: int = k,
            state: Any = state,
            state_leaves: Any = state_leaves,
            buffer: Any = buffer,
            source: Any = source,
            working: Any = working,
            given: Any = given,
        ) -> PyTree:
            if devices[k].type == "cpu":
                if access.file is not None:  # the slot being written, mapped, becomes the working copy
                    working.append(access.write(k))
                    working[0].copy_(source)
                    tree, leaves = _materialize(working[0], chunks[k], devices[k], None, state_of)
                elif buffer.data_ptr() == source.data_ptr():  # donated host state: it is its own working copy
                    tree, leaves = state, state_leaves
                else:
                    buffer.copy_(source)  # the spare buffer becomes the working copy
                    tree, leaves = _materialize(buffer, chunks[k], devices[k], None, state_of)
                given[:] = leaves
                return tree
            # device leaves are already private copies; host-side ones (step counts) still view the storage
            return chunks[k].spec.unflatten(
                [x.clone() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x for x in state_leaves]
            )

        def target(
            spare: bool = False,
            k: int = k,
            working: Any = working,
            given: Any = given,
            buffer: Any = buffer,
            source: Any = source,
        ) -> PyTree | None:
            if devices[k].type != "cpu":
                return None
            if access.file is None:  # with ``spare``, the host buffer the new state goes to, unless it is the state's
                if not spare or buffer.data_ptr() == source.data_ptr():
                    return None
                tree, given[:] = _materialize(buffer, chunks[k], devices[k], None, state_of)
                return tree
            working.append(access.write(k))  # the slot being written, mapped: the new state goes there
            tree, given[:] = _materialize(working[0], chunks[k], devices[k], None, state_of)
            return tree

        yield _Fetched(state, store, owned, target, given, sums)
        del state, state_leaves, buffer, store, owned, target, source, working, given, sums
    for stream in streams.values():
        stream.d2h.synchronize()


def _write_back(buffer: torch.Tensor, chunk: _Chunk, new_leaves: list[Any], given: list[Any]) -> None:
    """Copies a chunk's new state into ``buffer`` (CPU), skipping the leaves a fused step updated there in place:
    the very views of ``buffer`` it was given (``given``), or any other tensor over the same bytes."""
    for index in _changed(new_leaves, given or chunk.meta_leaves):
        place = chunk.place_of.get(index)
        if place is None or place.nbytes == 0:
            continue
        leaf = _local(new_leaves[index])
        if leaf.data_ptr() != buffer.data_ptr() + place.offset or not leaf.is_contiguous():
            (_local(given[index]) if given else view_leaf(buffer, place)).copy_(leaf)  # ``given`` holds the views


def _write_back_async(buffer: torch.Tensor, chunk: _Chunk, new_leaves: list[Any], stream: _Streams) -> Any:
    """Copies a chunk's new state from the device into page-locked ``buffer`` on the write-back stream, once the
    compute stream is done with it; returns the event that marks the copy's end."""
    done = stream.main.record_event()
    with torch.cuda.stream(stream.d2h):
        stream.d2h.wait_event(done)
        for place in chunk.places:
            leaf = _local(new_leaves[place.index])
            view_leaf(buffer, place).copy_(leaf, non_blocking=True)
            if leaf.device.type == "cuda":
                leaf.record_stream(stream.d2h)
    return stream.d2h.record_event()


@functools.lru_cache(maxsize=64)
def _list_spec(length: int) -> Any:
    """The tree structure of a list of ``length`` leaves (a chunk's params)."""
    return tree_flatten([None] * length)[1]


def _compute_device(group: list[int], grad_leaves: list[Any]) -> torch.device:
    for i in group:
        g = grad_leaves[i]
        if isinstance(g, torch.Tensor):
            return g.device
    return torch.device("cpu")


def _checked(new_state: PyTree, chunk: _Chunk, k: int, given: list[Any]) -> list[Any]:
    """The new state's leaves, after checking that ``inner`` kept the layout the storage was built for; a leaf of
    ``given`` (the working copy it updated in place) has that layout by construction."""
    leaves, spec = tree_flatten(new_state)
    if spec != chunk.spec:
        raise RuntimeError(f"the inner transform changed its state structure in chunk {k}: {spec} vs {chunk.spec}")
    for index in _changed(leaves, given or chunk.meta_leaves):  # not in place, nor a non-tensor leaf kept as it was
        leaf, meta = leaves[index], chunk.meta_leaves[index]
        if isinstance(meta, torch.Tensor):
            if not isinstance(leaf, torch.Tensor) or leaf.shape != meta.shape or leaf.dtype != meta.dtype:
                raise RuntimeError(
                    f"the inner transform returned {type(leaf).__name__} {getattr(leaf, 'dtype', '')}"
                    f"{tuple(getattr(leaf, 'shape', ()))} at {_where(spec, k, index)}, its storage holds "
                    f"{meta.dtype}{tuple(meta.shape)}"
                )
            local_shape_kept = is_dtensor(leaf) and _local(leaf).shape == _local(meta).shape
            if chunk.dtensors and is_dtensor(meta) and not local_shape_kept:
                layout = f"DTensor {leaf.placements}" if is_dtensor(leaf) else "plain tensor"
                raise RuntimeError(
                    f"the inner transform returned a {layout} at {_where(spec, k, index)}, its storage holds a shard "
                    f"of {tuple(_local(meta).shape)} of a DTensor {meta.placements}"
                )
        elif leaf is not meta and leaf != meta:
            where = _where(spec, k, index)
            raise RuntimeError(f"paged state holds tensors only; the non-tensor leaf at {where} changed")
    return leaves


def _changed(leaves: list[Any], before: list[Any]) -> Iterator[int]:
    """The indices where ``leaves`` hold another object than ``before``: an identity test a leaf, in C (a fused step
    changes few leaves of thousands)."""
    return itertools.compress(itertools.count(), map(operator.is_not, leaves, before))


def _where(spec: Any, k: int, index: int) -> str:
    """Names a state leaf in errors only: its path costs a walk of the whole tree."""
    return f"chunk {k} state leaf {path_str(spec.paths()[index])}"


def _temporary_path() -> str:
    fd, path = tempfile.mkstemp(prefix="fadam-paged-", suffix=".state")
    os.close(fd)
    return path


def _path_of(state: PagedState) -> str:
    if state.path.numel() == 0:
        raise ValueError("this paged state has no file: was it built with storage='host'?")
    return bytes(state.path.tolist()).decode()


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
