"""The disk state file: checkpoint and resume, crash consistency under SIGKILL, and clear errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import fadam
from fadam.paging import _storage

ROOT = Path(__file__).resolve().parents[1]


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for n in (300, 40, 1000, 7)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in _params()]


def _train(tx, params, state, steps: range):
    for step in steps:
        params, state = fadam.step(tx, params, _grads(step), state)
    return params, state


def test_the_file_is_a_checkpoint_that_resumes_exactly(tmp_path):
    path = tmp_path / "adam.state"

    def make(resume: bool = False) -> fadam.GradientTransformation:
        return fadam.paged_adamw(lr=1e-2, storage="disk", path=path, chunk_bytes=8192, resume=resume)

    reference = fadam.adamw(lr=1e-2)
    with fadam.backend("kernel"):  # a disk-paged step's kernel: the generated one (torch's cannot write elsewhere)
        ref_params, _ = _train(reference, _params(), reference.init(_params()), range(5))

    tx = make()
    params, _ = _train(tx, _params(), tx.init(_params()), range(3))
    del tx  # a new process would start from here: the params checkpoint plus the state file
    resumed = make(resume=True)
    state = resumed.init(_params())
    assert int(state.serial) == 4  # the creation (1) and three updates
    params, _ = _train(resumed, params, state, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_a_file_of_another_model_or_optimizer_is_refused(tmp_path):
    path = tmp_path / "s"
    fadam.paged_adam(storage="disk", path=path).init(_params())
    other_shapes = [*_params()[:3], torch.zeros(8)]
    with pytest.raises(fadam.PagedStateFileError, match=r"different model.*float32\(8,\)"):
        fadam.paged_adam(storage="disk", path=path, resume=True).init(other_shapes)
    with pytest.raises(fadam.PagedStateFileError, match=r"different model or optimizer.*structure"):
        fadam.page_state(fadam.sgd(momentum=0.9), "disk", path, per_leaf=True, resume=True).init(_params())
    with pytest.raises(fadam.PagedStateFileError, match=r"different model.*chunks"):
        fadam.paged_adam(storage="disk", path=path, chunk_bytes=4096, resume=True).init(_params())


def test_stale_and_foreign_states_are_refused(tmp_path):
    tx = fadam.paged_adam(lr=0.1, storage="disk", path=tmp_path / "s")
    params = _params()
    s1 = tx.init(params)
    _, s2 = tx.update(_grads(0), s1, params)
    u3, s3 = tx.update(_grads(1), s2, params)
    u3b, _ = tx.update(_grads(1), s2, params)  # retrying from the state before the latest is allowed
    assert all(torch.equal(a, b) for a, b in zip(u3, u3b))
    with pytest.raises(fadam.PagedStateFileError, match="stale paged state"):
        tx.update(_grads(2), s3, params)  # its slot was just overwritten by the retry
    with pytest.raises(fadam.PagedStateFileError, match="another file"):
        fadam.paged_adam(storage="disk", path=tmp_path / "s").update(_grads(2), s1._replace(store_id=s1.store_id + 1))


def test_not_a_state_file_truncated_and_unfinished_files_are_detected(tmp_path):
    path = tmp_path / "s"
    path.write_bytes(b"not a state file" * 100)
    with pytest.raises(fadam.PagedStateFileError, match="not a fadam paged-state file"):
        fadam.paged_adam(storage="disk", path=path, resume=True).init(_params())
    fadam.paged_adam(storage="disk", path=path).init(_params())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])  # the description at the end is cut
    with pytest.raises(fadam.PagedStateFileError, match="truncated or corrupt"):
        fadam.paged_adam(storage="disk", path=path, resume=True).init(_params())
    path.write_bytes(data)
    with open(path, "r+b") as f:  # a torn commit record (killed while writing it): the only commit is invalid
        f.seek(_storage._RECORD_OFFSETS[0] + 12)
        f.write(b"\xff")
    with pytest.raises(fadam.PagedStateFileError, match="incomplete: no committed state"):
        fadam.paged_adam(storage="disk", path=path, resume=True).init(_params())
    with pytest.raises(FileNotFoundError, match="cannot open the paged state file"):
        fadam.paged_adam(storage="disk", path=tmp_path / "missing", resume=True).init(_params())


def test_unwritable_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cannot create the paged state file .*no_such_dir"):
        fadam.paged_adam(storage="disk", path=tmp_path / "no_such_dir" / "s").init(_params())
    with pytest.raises(OSError, match=r"cannot create the paged state file /proc/fadam\.state"):
        fadam.paged_adam(storage="disk", path="/proc/fadam.state").init(_params())
    (tmp_path / "ro").mkdir()
    if os.geteuid() != 0:  # root writes anywhere; the two cases above cover it
        os.chmod(tmp_path / "ro", 0o500)
        with pytest.raises(PermissionError, match="cannot create the paged state file"):
            fadam.paged_adam(storage="disk", path=tmp_path / "ro" / "s").init(_params())


def _run_child(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_a_full_disk_is_reported_at_init_not_as_a_crash_later(tmp_path):
    # RLIMIT_FSIZE stands in for a full disk: space is reserved at creation, so updates never grow the file
    child = _run_child(
        f"""
        import resource, signal, torch, fadam
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        tx = fadam.paged_adam(storage="disk", path={str(tmp_path / "big.state")!r})
        try:
            tx.init([torch.zeros(1 << 18)])  # 2 MiB of Adam state, 4 MiB with both copies
        except OSError as err:
            print(type(err).__name__, err)
        """
    )
    out, err = child.communicate(timeout=60)
    assert "not enough space to reserve space for the paged state file" in out, (out, err)
    assert "disk full or file size limit" in out
    assert not (tmp_path / "big.state").exists()
    assert not list(tmp_path.glob("big.state.tmp-*"))  # the partial file is removed


def test_a_process_killed_mid_update_leaves_the_previous_or_the_next_step(tmp_path):
    path = tmp_path / "killed.state"
    child = _run_child(
        f"""
        import sys, torch, fadam
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_paging_storage import _grads, _params, _blocking_adam
        tx = fadam.page_state(_blocking_adam(block_at=7), "disk", {str(path)!r}, 4096, per_leaf=True)
        params, state = _params(), tx.init(_params())
        for step in range(1000):
            _, state = tx.update(_grads(step), state, params)
        """
    )
    # 3 chunks per update: call 7 is the second chunk of the third update, whose first chunk is already written
    watchdog = threading.Timer(60, child.kill)  # never hang the suite
    watchdog.start()
    line = child.stdout.readline()
    watchdog.cancel()
    assert line == "blocked\n", (line, child.stderr.read())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()

    state_file = _storage.StateFile.open(str(path))
    commits = state_file.commits()
    state_file.close()
    assert len(commits) == 1  # killed mid-update: the slot being written had been invalidated first
    resumed = fadam.page_state(_blocking_adam(), "disk", path, 4096, per_leaf=True, resume=True)
    state = resumed.init(_params())
    done = int(state.serial) - 1
    assert done == 2  # the step being written when the process died is not visible
    reference = _blocking_adam()
    ref_state = reference.init(_params())
    for step in range(done):
        _, ref_state = reference.update(_grads(step), ref_state, _params())
    # the state loaded is exactly the one after `done` updates: the next update agrees bit for bit
    updates, _ = resumed.update(_grads(done), state, _params())
    ref_updates, _ = reference.update(_grads(done), ref_state, _params())
    assert all(torch.equal(a, b) for a, b in zip(updates, ref_updates))


def _blocking_adam(block_at: int = -1) -> fadam.GradientTransformation:
    """Adam that, on its ``block_at``-th call (one call per chunk), says so and blocks, so that a kill lands inside
    an update."""
    calls = [0]

    def sleep(updates, params):
        if calls[0] == block_at:
            print("blocked", flush=True)
            time.sleep(600)
        calls[0] += 1
        return updates

    return fadam.chain(fadam.stateless(sleep), fadam.adam(lr=1e-2))


@pytest.mark.parametrize("durable", [False, True])
def test_a_torn_latest_commit_falls_back_to_the_step_before(tmp_path, durable):
    path = tmp_path / "s"
    tx = fadam.page_state(fadam.adam(lr=1e-2), "disk", path, 4096, per_leaf=True, durable=durable)
    params = _params()
    _, state = tx.update(_grads(0), tx.init(params), params)
    _, state = tx.update(_grads(1), state, params)
    with open(path, "r+b") as f:  # serial 1 went to slot 0, serial 2 to slot 1, serial 3 (the latest) to slot 0
        f.seek(_storage._RECORD_OFFSETS[0] + 20)
        f.write(b"\x00\x01")
    state = fadam.page_state(fadam.adam(lr=1e-2), "disk", path, 4096, per_leaf=True, resume=True).init(params)
    assert int(state.serial) == 2
    reference = fadam.adam(lr=1e-2)
    _, ref_state = reference.update(_grads(0), reference.init(params), params)
    ours, _ = tx.update(_grads(1), state, params)
    ref, _ = reference.update(_grads(1), ref_state, params)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def _committed_leaf_bytes(path: Path, chunk: int) -> tuple[int, int]:
    """The file offset and size of the largest state leaf of ``chunk`` in the slot of the latest commit."""
    state_file = _storage.StateFile.open(str(path), writable=False)
    try:
        slot, size = state_file.latest().slot, state_file.chunk_sizes[chunk]
        places = _storage.described_places(state_file.description["chunks"][chunk])
        place = max(places, key=lambda p: p.nbytes)
        return state_file.chunk_offsets[chunk] + slot * size + place.offset, place.nbytes
    finally:
        state_file.close()


def _flip(path: Path, offset: int, count: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupt_state_data_is_refused_on_resume_naming_the_chunk(tmp_path):
    path = tmp_path / "s"
    tx = fadam.page_state(fadam.adam(lr=1e-2), "disk", path, 4096, per_leaf=True)
    params = _params()
    _, state = tx.update(_grads(0), tx.init(params), params)
    _, state = tx.update(_grads(1), state, params)
    resume = fadam.page_state(fadam.adam(lr=1e-2), "disk", path, 4096, per_leaf=True, resume=True)
    assert int(resume.init(params).serial) == 3  # intact, it resumes

    offset, nbytes = _committed_leaf_bytes(path, 1)
    _flip(path, offset + nbytes // 2, 16)
    corrupted = path.read_bytes()
    expected = rf"^{re.escape(str(path))} is corrupt: chunk 1 of commit 3 has checksum [0-9a-f]{{16}}, its commit"
    with pytest.raises(fadam.PagedStateFileError, match=expected):
        resume.init(params)
    assert path.read_bytes() == corrupted  # refused before anything was written

    _flip(path, offset + nbytes // 2, 16)  # repaired, then the checksum table itself is damaged
    state_file = _storage.StateFile.open(str(path), writable=False)
    table = state_file._table_at(state_file.latest().slot)
    state_file.close()
    _flip(path, table + 4, 1)
    with pytest.raises(fadam.PagedStateFileError, match="corrupt: the checksum table of commit 3 does not match"):
        resume.init(params)


def test_corrupting_the_spare_slot_does_not_affect_resume(tmp_path):
    # the spare slot holds the commit before the latest one; resume reads and checks only the latest
    path = tmp_path / "s"
    tx = fadam.page_state(fadam.adam(lr=1e-2), "disk", path, 4096, per_leaf=True)
    params = _params()
    _, state = tx.update(_grads(0), tx.init(params), params)
    offset, nbytes = _committed_leaf_bytes(path, 0)
    state_file = _storage.StateFile.open(str(path), writable=False)
    spare_offset = offset + (1 - 2 * state_file.latest().slot) * state_file.chunk_sizes[0]
    state_file.close()
    _flip(path, spare_offset, nbytes)
    resumed = fadam.page_state(fadam.adam(lr=1e-2), "disk", path, 4096, per_leaf=True, resume=True)
    state = resumed.init(params)
    reference = fadam.adam(lr=1e-2)
    _, ref_state = reference.update(_grads(0), reference.init(params), params)
    ours, _ = resumed.update(_grads(1), state, params)
    ref, _ = reference.update(_grads(1), ref_state, params)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


@pytest.mark.parametrize(
    ("version", "what"), [(1, "without checksums of its data"), (2, "with CRC-32 checksums of its data")]
)
def test_a_file_of_an_older_format_is_refused(tmp_path, version, what):
    path = tmp_path / "s"
    fadam.paged_adam(storage="disk", path=path).init(_params())
    with open(path, "r+b") as f:
        f.seek(8)  # the format version, where every version keeps it
        f.write(version.to_bytes(4, "little"))
    expected = rf"^{re.escape(str(path))} has the older file format {version} \({what}\)"
    with pytest.raises(fadam.PagedStateFileError, match=expected):
        fadam.paged_adam(storage="disk", path=path, resume=True).init(_params())


def test_an_init_that_raises_removes_its_temporary_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "s"
    fadam.paged_adam(storage="disk", path=path).init(_params())
    before = path.read_bytes()
    calls = [0]

    def init(params):
        if params[0].device.type != "meta":  # not page_state's probe of the state's size
            calls[0] += 1
            if calls[0] == 3:  # the third chunk, after two were written to the temporary file
                raise RuntimeError("init failed")
        return fadam.adam().init(params)

    failing = fadam.GradientTransformation(init, fadam.adam().update)
    with pytest.raises(RuntimeError, match="init failed"):
        fadam.page_state(failing, "disk", path, 4096, per_leaf=True).init(_params())
    assert calls[0] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert path.read_bytes() == before


def test_an_init_removes_the_temporary_files_of_killed_inits_not_of_live_ones(tmp_path):
    path = tmp_path / "s"
    code = f"""
        import sys, time, fadam
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_paging_storage import _params

        def init(params):  # blocks in the second chunk, with the temporary file half written
            if params[0].numel() == 40 and params[0].device.type != "meta":
                print("blocked", flush=True)
                time.sleep(600)
            return fadam.adam().init(params)

        blocking = fadam.GradientTransformation(init, fadam.adam().update)
        fadam.page_state(blocking, "disk", {str(path)!r}, 2048, per_leaf=True).init(_params())
        """
    killed, live = _run_child(code), _run_child(code)
    watchdog = threading.Timer(60, lambda: (killed.kill(), live.kill()))  # never hang the suite
    watchdog.start()
    try:
        for child in (killed, live):
            line = child.stdout.readline()
            assert line == "blocked\n", (line, child.stderr.read())
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert (tmp_path / f"s.tmp-{killed.pid}").exists()
        (tmp_path / f"other.tmp-{killed.pid}").write_bytes(b"")  # another path's: not this init's to remove

        fadam.paged_adam(storage="disk", path=path).init(_params())
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["s", f"s.tmp-{live.pid}", f"other.tmp-{killed.pid}"]
        )
    finally:
        watchdog.cancel()
        for child in (killed, live):
            child.kill()
            child.wait()


def test_a_fused_disk_step_writes_the_other_slot_only(tmp_path):
    # the step computes in a writable map of the slot it writes: the state it read stays intact, so it can be
    # stepped again (and a crash mid-step would leave it)
    tx = fadam.paged_adam(lr=1e-2, storage="disk", path=tmp_path / "s", chunk_bytes=8192)
    reference = fadam.adam(lr=1e-2)
    first = tx.init(_params())
    params, second = fadam.step(tx, _params(), _grads(0), first, donate=True)
    with fadam.backend("kernel"):
        ref_params, _ = fadam.step(reference, _params(), _grads(0), reference.init(_params()))
    again, _ = fadam.step(tx, _params(), _grads(0), first, donate=True)
    assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(again, ref_params, params))
    # the latest state is the one the retry wrote over the spare slot; the first step's result is gone
    with pytest.raises(_storage.PagedStateFileError, match="stale"):
        fadam.step(tx, params, _grads(1), second)


@pytest.mark.parametrize(
    ("make", "by_kernel"),
    [
        (lambda path: fadam.paged_adam(lr=1e-2, storage="disk", path=path, chunk_bytes=8192), True),
        # 8-bit and 4-bit moments: the kernel sums their codes; the byte pass reads the blocks' scales
        (lambda path: fadam.paged_adamw8bit(1e-2, storage="disk", path=path, min_size=1, chunk_bytes=2048), True),
        (lambda path: fadam.page_state(fadam.adamw4bit(1e-2, min_size=1), storage="disk", path=path), True),
        # blocks of 100: a pass of 500 codes does not fill whole rows, so the commit sums the codes itself
        (lambda path: fadam.paged_adamw8bit(1e-2, storage="disk", path=path, min_size=1, block_size=100), False),
    ],
)
@pytest.mark.parametrize("update", [False, True])
def test_a_fused_disk_step_takes_its_checksum_from_the_kernel_and_it_verifies(
    tmp_path, monkeypatch, make, by_kernel, update
):
    # the generated kernel sums the moments as it writes them: the commit's byte pass reads only the step counts (and
    # a quantized moment's block scales and map id: at most 32 bytes here), never a moment's values or codes
    from fadam.paging import _checksum

    read: list[int] = []
    original = _checksum.spans_sums

    def reading(buffer, spans):
        read.extend(nbytes for _, nbytes in spans)
        return original(buffer, spans)

    monkeypatch.setattr(_checksum, "spans_sums", reading)
    path = tmp_path / "s"
    tx = make(path)
    params, state = _params(), tx.init(_params())
    read.clear()
    for step in range(2):
        if update:  # an update writes the new state it computes into the file as a step does
            updates, state = tx.update(_grads(step), state, params)
            params = fadam.apply_updates(params, updates)
        else:
            params, state = fadam.step(tx, params, _grads(step), state, donate=True)
    assert read and (max(read) <= 32) == by_kernel
    state_file = _storage.StateFile.open(str(path))
    state_file.verify(state_file.latest())  # the kernel's sums are the bytes' checksum
    state_file.close()


@pytest.mark.parametrize(
    ("make", "chunk_bytes"),
    [
        # a stage with a count and no slots (the schedule) beside Adam's: every chunk's counts advance
        (
            lambda: fadam.chain(
                fadam.scale_by_adam(),
                fadam.add_decayed_weights(1e-2),
                fadam.scale_by_schedule(fadam.linear_schedule(-1e-2, -1e-3, 5)),
            ),
            4096,
        ),
        (lambda: fadam.adamw8bit(1e-2, min_size=1), 1024),
    ],
)
def test_the_chunks_of_a_file_mapped_whole_step_in_one_kernel_call_as_unpaged(tmp_path, monkeypatch, make, chunk_bytes):
    from fadam import _cpu_kernel

    calls = []
    original = _cpu_kernel.Kernel.run

    def counting(self, *args, **kwargs):
        calls.append(len(args[0]))  # the leaves of the call
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_cpu_kernel.Kernel, "run", counting)
    reference, path = make(), tmp_path / "s"
    tx = fadam.page_state(make(), storage="disk", path=path, chunk_bytes=chunk_bytes)
    params, expected = _params(), _params()
    state, expected_state = tx.init(params), reference.init(expected)
    assert len(state.chunks) == 3
    for step in range(3):
        calls.clear()
        params, state = fadam.step(tx, params, _grads(step), state, donate=True)
        assert calls == [4], calls
        with fadam.backend("kernel"):
            expected, expected_state = fadam.step(reference, expected, _grads(step), expected_state, donate=True)
        assert all(torch.equal(a, b) for a, b in zip(params, expected))
    # the file holds each chunk's state of the step, counts included: a resumed step is the unpaged one
    resumed = fadam.page_state(make(), storage="disk", path=path, chunk_bytes=chunk_bytes, resume=True)
    params, _ = fadam.step(resumed, params, _grads(3), resumed.init(_params()))
    with fadam.backend("kernel"):
        expected, _ = fadam.step(reference, expected, _grads(3), expected_state)
    assert all(torch.equal(a, b) for a, b in zip(params, expected))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_moments_summed_by_the_kernel_across_its_chunks_verify_and_step_as_unpaged(tmp_path, bits):
    # leaves over several of the kernel's chunks of 16384 elements, with partial 64-byte rows of codes at their ends,
    # on both threads: the codes the kernel wrote and summed are the unpaged step's, and their checksum verifies
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        make = fadam.adamw8bit if bits == 8 else fadam.adamw4bit
        reference, path = make(1e-2, min_size=1), tmp_path / "s"
        tx = fadam.page_state(reference, storage="disk", path=path)
        gen = torch.Generator().manual_seed(5)
        params = [torch.randn(n, generator=gen) for n in (3 * 16384 + 5, 70_001, 7)]
        expected, state, expected_state = [p.clone() for p in params], tx.init(params), reference.init(params)
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=gen) for p in params]
            params, state = fadam.step(tx, params, grads, state, donate=True)
            expected, expected_state = fadam.step(reference, expected, grads, expected_state, donate=True)
        assert all(torch.equal(a, b) for a, b in zip(params, expected))
        state_file = _storage.StateFile.open(str(path))
        state_file.verify(state_file.latest())
        state_file.close()
    finally:
        torch.set_num_threads(before)


def test_a_host_paged_update_computes_its_new_state_in_the_spare_buffer(monkeypatch):
    # the generated kernel writes the new moments where the returned state reads them: what is copied into the spare
    # buffer afterwards is the step counts only; the numbers are the unpaged update's
    copied: list[int] = []
    original = torch.Tensor.copy_

    def copying(target, source, *args, **kwargs):
        copied.append(target.numel() * target.element_size())
        return original(target, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copying)
    reference = fadam.adam(1e-2)
    tx = fadam.page_state(reference, storage="host", chunk_bytes=8192)
    params, state, expected_state = _params(), tx.init(_params()), reference.init(_params())
    for step in range(3):
        copied.clear()
        updates, state = tx.update(_grads(step), state, params)
        expected, expected_state = reference.update(_grads(step), expected_state, params)
        assert all(torch.equal(a, b) for a, b in zip(updates, expected))
        assert copied and max(copied) <= 8, copied
        params = fadam.apply_updates(params, updates)


def test_a_disk_step_over_empty_leaves_commits_a_checksum_that_verifies(tmp_path):
    # an empty leaf's state takes no bytes: its place is where the next leaf's (or the next slot's) starts
    params = [torch.randn(100), torch.randn(0, 3), torch.randn(40), torch.randn(0)]
    grads = [torch.randn(p.shape) for p in params]
    path = tmp_path / "s"
    tx = fadam.paged_adamw(lr=1e-2, storage="disk", path=path)
    params, state = fadam.step(tx, params, grads, tx.init(params), donate=True)
    params, state = fadam.step(tx, params, grads, state)
    state_file = _storage.StateFile.open(str(path))
    state_file.verify(state_file.latest())
    state_file.close()


def test_a_file_too_large_to_keep_mapped_steps_and_resumes_alike(tmp_path, monkeypatch):
    """A file over a quarter of the available memory is mapped a chunk window at a time: the same numbers, and no
    map of the whole file is made."""
    results = []
    for available in (1 << 40, 0):
        monkeypatch.setattr(_storage, "_available_memory", lambda available=available: available)
        path = tmp_path / f"s{available}"
        tx = fadam.paged_adam(lr=1e-2, storage="disk", path=path, chunk_bytes=8192)
        params, state = _params(), None
        state = tx.init(params)
        for step in range(2):
            params, state = fadam.step(tx, params, _grads(step), state, donate=True)
        resumed = fadam.paged_adam(lr=1e-2, storage="disk", path=path, chunk_bytes=8192, resume=True)
        params, _ = fadam.step(resumed, params, _grads(2), resumed.init(_params()))
        results.append(params)
        state_file = _storage.StateFile.open(str(path))
        state_file.window(0, 0)
        assert bool(state_file._maps) == bool(available)
        state_file.close()
    assert all(torch.equal(a, b) for a, b in zip(*results))
