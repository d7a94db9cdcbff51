"""Where paged state lives between steps: host buffers, or a crash-consistent memory-mapped file.

Both storages hold every chunk of the inner state twice (two *slots*): an update reads the current slot and writes the
other one, so the state passed to ``update`` is never overwritten while it is read, and a crash mid-update leaves the
current slot intact.

The disk file is its own checkpoint::

    [header page][chunk 0: slot 0 | slot 1] ... [checksums: slot 0 | slot 1][description (JSON)]

The header holds a magic, the format version, a random file id, the SHA-256 fingerprint of the description (for
each chunk: the param leaves it covers, the inner state's tree structure, and the shape and dtype of every state leaf),
where the checksum tables lie, and two commit records, one per slot: ``(serial, generation, crc32 of the slot's
checksum table, crc32 of the record)``. A slot's checksum table holds, per chunk, the 64-bit checksum
(``fadam.paging._checksum``) of that chunk's state leaves in the slot, computed from the bytes as they are written
(in memory, never read back from the disk). An update
invalidates the record of the slot it is about to write, writes the data, the slot's checksum table, then that record
with a new serial: the record is the commit marker and it is written last. On load, the valid record with the highest
serial names the slot to read; a file without one is reported as incomplete. ``verify`` checks a slot's data against
its table (on resume); updates do not, as that would read the state a second time every step. An open file keeps
its data mapped (``StateFile``). A fused step or an update on the CPU reads the chunk's current slot where it lies
and the generated kernel writes the new state into the writable map of the other slot, in the page cache (no staging
buffer, no copy in or out), summing it for the checksum as it goes; other updates write each leaf with ``pwrite``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import mmap
import os
import re
import secrets
import struct
import warnings
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace

import torch

from fadam.paging._checksum import ChunkChecksum, Spans

FORMAT_VERSION = 3  # 64-bit Fletcher checksums of each slot's data (``_checksum``)
_OLDER_FORMATS = {1: "without checksums of its data", 2: "with CRC-32 checksums of its data"}
MAGIC = b"FADAMPG\x00"
RECORD_MAGIC = b"COMMIT\x00\x00"
PAGE = mmap.ALLOCATIONGRANULARITY  # mmap offsets must be multiples of it
LEAF_ALIGN = 64
# magic, version, reserved, file id, fingerprint, description offset and length, checksum tables offset
_HEADER = struct.Struct("<8sIIq32sqqq")
_RECORD = struct.Struct("<8sqqqI")  # magic, serial, generation, slot, crc32 of the slot's checksum table
_VERSION = struct.Struct("<I")  # at offset 8 in every format version
_RECORD_OFFSETS = (1024, 2048)
_CHECKSUM_BYTES = 8  # per chunk in a slot's checksum table


def align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class LeafPlace:
    """Where one tensor leaf of a chunk's state lies inside the chunk's bytes."""

    index: int  # position among the chunk state's flattened leaves
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def leaf_places(meta_leaves: list[object]) -> tuple[list[LeafPlace], int]:
    """Packs the tensor leaves of one chunk, each aligned to 64 bytes; returns the places and the chunk's size."""
    places, offset = [], 0
    for index, leaf in enumerate(meta_leaves):
        if isinstance(leaf, torch.Tensor):
            nbytes = leaf.numel() * leaf.element_size()
            places.append(LeafPlace(index, offset, nbytes, tuple(leaf.shape), leaf.dtype))
            offset = align(offset + nbytes, LEAF_ALIGN)
    return places, align(offset, PAGE)


def view_leaf(buffer: torch.Tensor, place: LeafPlace) -> torch.Tensor:
    """A zero-copy view of ``place`` in a flat uint8 ``buffer``."""
    return buffer[place.offset : place.offset + place.nbytes].view(place.dtype).view(place.shape)


def host_buffers(nbytes: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two slots of one chunk in host memory (page-locked when the state is used on an accelerator)."""
    return (_page_locked(nbytes), _page_locked(nbytes)) if pin else (_host(nbytes), _host(nbytes))


def _host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _page_locked(nbytes: int) -> torch.Tensor:
    """Page-locked host memory of exactly ``nbytes``.

    ``pin_memory=True`` goes through torch's caching host allocator, which rounds every block up to a power of two:
    a 64 MiB + 4 KiB chunk would take 128 MiB. Registering an ordinary allocation with the CUDA driver pins exactly
    what is asked for; the caching allocator is the fallback.
    """
    buffer = _host(nbytes)
    if nbytes:
        try:
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0:
                weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
                return buffer
        except (AttributeError, RuntimeError, TypeError):
            pass
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def described_places(chunk: dict) -> list[LeafPlace]:
    """The places of a chunk's state leaves, from the chunk's entry in a file's description."""
    metas = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in chunk["leaves"]]
    return leaf_places(metas)[0]


def leaves_checksum(buffer: torch.Tensor, places: list[LeafPlace]) -> int:
    """The checksum of a chunk's state leaves in ``buffer`` (``ChunkChecksum.of_leaves``)."""
    return ChunkChecksum.of_leaves(buffer, Spans.of(places)).value


def _bytes_of(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a contiguous CPU tensor's memory, without a copy (also for a read-only map)."""
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def fingerprint(description: dict) -> bytes:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()


class PagedStateFileError(RuntimeError):
    """A paged-state file that cannot be used: incomplete, corrupt, from another model, or stale."""


@dataclass(frozen=True)
class Commit:
    serial: int
    generation: int
    slot: int
    table_crc: int = 0  # of the slot's checksum table; set when the commit is written


def _os_error(err: OSError, path: str, doing: str, nbytes: int | None = None) -> OSError:
    """The same kind of OSError, with a message that says what fadam was doing and where."""
    if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        need = f" ({nbytes / 2**30:.3f} GiB)" if nbytes is not None else ""
        message = f"not enough space to {doing} {path}{need}: {os.strerror(err.errno)} (disk full or file size limit)"
    else:
        message = f"cannot {doing} {path}: {os.strerror(err.errno) if err.errno else err}"
    return type(err)(err.errno, message)


def _available_memory() -> int:
    """Bytes of memory available to new allocations (``MemAvailable``), or 0 where that is not known."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _check_version(path: str, version: int) -> None:
    if version < FORMAT_VERSION:
        raise PagedStateFileError(
            f"{path} has the older file format {version} ({_OLDER_FORMATS.get(version, 'unknown')}); this fadam reads "
            f"format {FORMAT_VERSION}: create the file anew (resume=False)"
        )
    if version > FORMAT_VERSION:
        raise PagedStateFileError(f"{path} has file format {version}, newer than the format {FORMAT_VERSION} read here")


def remove_stale_temporaries(path: str) -> None:
    """Removes the ``<path>.tmp-<pid>`` files of creations whose process is gone (killed before it could clean up);
    those of live processes are left alone."""
    directory, name = os.path.split(path)
    pattern = re.compile(re.escape(name) + r"\.tmp-(\d+)")
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return  # creating the file reports what is wrong with its directory
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match and not _alive(int(match[1])):
            with suppress(FileNotFoundError):  # another process removed it first
                os.unlink(os.path.join(directory, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no pid can be: not ours to remove
        pass
    return True


class StateFile:
    """An open paged-state file. A file that fits in a quarter of the memory available when it is opened stays mapped
    while it is open (a read-only and a writable map of the whole file), so that a chunk's pages are mapped once, not
    at every update: mapping a window afresh costs a page fault per page written, about as much as the copy itself.
    A larger one is mapped one chunk window at a time, each map released when the last tensor viewing it dies, so
    that resident memory stays at the chunks in use."""

    def __init__(self, path: str, fd: int, file_id: int, description: dict, table_offset: int) -> None:
        self.path, self.fd, self.file_id = path, fd, file_id
        self.description = description
        self.chunk_offsets = [chunk["offset"] for chunk in description["chunks"]]
        self.chunk_sizes = [chunk["size"] for chunk in description["chunks"]]
        self.table_offset = table_offset
        self._maps: dict[bool, mmap.mmap] = {}
        self._mapped_whole = os.fstat(fd).st_size <= _available_memory() // 4
        self._windows: dict[tuple[int, int, bool], torch.Tensor] = {}  # of the whole file's maps, each made once

    # creation ---------------------------------------------------------------------------------------------------
    @classmethod
    @contextmanager
    def create(cls, path: str, durable: bool = False) -> Iterator[_Builder]:
        """Builds a new file beside ``path`` and renames it over ``path`` only once it is complete."""
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as err:
            raise _os_error(err, path, "create the paged state file") from None
        try:
            builder = _Builder(path, fd)
            yield builder
            builder.finish(durable)
            os.replace(tmp, path)
        finally:
            os.close(fd)
            with suppress(FileNotFoundError):  # gone once it replaced ``path``
                os.unlink(tmp)

    @classmethod
    def open(cls, path: str, writable: bool = True) -> StateFile:
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as err:
            raise _os_error(err, path, "open the paged state file") from None
        try:
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) < 8 + _VERSION.size or head[:8] != MAGIC:
                raise PagedStateFileError(f"{path} is not a fadam paged-state file (bad magic)")
            _check_version(path, _VERSION.unpack_from(head, 8)[0])
            if len(head) < _HEADER.size:
                raise PagedStateFileError(f"{path} is truncated: its header ends early")
            _, _, _, file_id, digest, desc_offset, desc_length, table_offset = _HEADER.unpack(head)
            if desc_length <= 0:
                raise PagedStateFileError(f"{path} is incomplete: its creation was interrupted (no description)")
            raw = os.pread(fd, desc_length, desc_offset)
            if len(raw) != desc_length or hashlib.sha256(raw).digest() != digest:
                raise PagedStateFileError(f"{path} is truncated or corrupt: its description does not match its hash")
            description = json.loads(raw)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, file_id, description, table_offset)

    @property
    def keeps_windows(self) -> bool:
        """Whether ``window`` gives the same tensor for a window at every call (the whole file is mapped)."""
        return self._mapped_whole

    def close(self) -> None:
        """Closes the file and its maps; a map that a tensor still views is released when the last such tensor dies."""
        self._windows.clear()  # first: the windows hold the maps' buffers
        for mapped in self._maps.values():
            with suppress(BufferError):
                mapped.close()
        self._maps.clear()
        os.close(self.fd)

    def same_file(self, path: str) -> bool:
        """Whether ``path`` still names this open file (not a file created over it since)."""
        try:
            found, held = os.stat(path), os.fstat(self.fd)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)

    def _mapped(self, writable: bool) -> mmap.mmap:
        if writable not in self._maps:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._maps[writable] = mmap.mmap(self.fd, os.fstat(self.fd).st_size, flags=mmap.MAP_SHARED, prot=prot)
        return self._maps[writable]

    # commits ----------------------------------------------------------------------------------------------------
    def _read_record(self, slot: int) -> Commit | None:
        raw = os.pread(self.fd, _RECORD.size + 4, _RECORD_OFFSETS[slot])
        if len(raw) != _RECORD.size + 4:
            return None
        body, (crc,) = raw[: _RECORD.size], struct.unpack("<I", raw[_RECORD.size :])
        magic, serial, generation, record_slot, table_crc = _RECORD.unpack(body)
        if magic != RECORD_MAGIC or zlib.crc32(body + self._salt()) != crc or record_slot != slot:
            return None
        return Commit(serial, generation, slot, table_crc)

    def _salt(self) -> bytes:
        # ties a record to this file's id, so a record copied from another file never validates
        return struct.pack("<q", self.file_id)

    def _write_record(self, slot: int, commit: Commit | None, durable: bool) -> None:
        if commit is None:
            raw = bytes(_RECORD.size + 4)
        else:
            body = _RECORD.pack(RECORD_MAGIC, commit.serial, commit.generation, slot, commit.table_crc)
            raw = body + struct.pack("<I", zlib.crc32(body + self._salt()))
        self._pwrite(raw, _RECORD_OFFSETS[slot])
        if durable:
            os.fsync(self.fd)

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        try:
            written = os.pwrite(self.fd, data, offset)
        except OSError as err:
            raise _os_error(err, self.path, "write the paged state file") from None
        if written != len(data):
            raise _os_error(OSError(errno.ENOSPC, "short write"), self.path, "write the paged state file")

    def commits(self) -> list[Commit]:
        return [c for c in (self._read_record(0), self._read_record(1)) if c is not None]

    def latest(self) -> Commit:
        commits = self.commits()
        if not commits:
            raise PagedStateFileError(
                f"{self.path} is incomplete: no committed state (the first update or the creation was interrupted)"
            )
        return max(commits, key=lambda c: c.serial)

    def find(self, serial: int) -> Commit:
        for commit in self.commits():
            if commit.serial == serial:
                return commit
        latest = max((c.serial for c in self.commits()), default=None)
        raise PagedStateFileError(
            f"stale paged state: it is commit {serial} of {self.path}, which now holds commit {latest}; a paged "
            "state can be updated only while its slot has not been overwritten (the latest state or the one before it)"
        )

    def begin(self, read: Commit, durable: bool) -> Commit:
        """Invalidates the other slot before it is overwritten; returns the commit that ``commit`` will write."""
        serial = max(c.serial for c in self.commits()) + 1  # before the invalidation: serials are never reused
        target = 1 - read.slot
        self._write_record(target, None, durable)
        return Commit(serial, read.generation + 1, target)

    def commit(self, commit: Commit, checksums: list[int], durable: bool) -> None:
        """Writes the slot's checksum table (one 64-bit checksum per chunk), then the record that makes the slot
        current."""
        table = struct.pack(f"<{len(checksums)}Q", *checksums)
        self._pwrite(table, self._table_at(commit.slot))
        if durable:
            os.fsync(self.fd)  # the data reaches the disk before the record that makes it current
        self._write_record(commit.slot, replace(commit, table_crc=zlib.crc32(table)), durable)

    def _table_at(self, slot: int) -> int:
        return self.table_offset + slot * _CHECKSUM_BYTES * len(self.chunk_sizes)

    def verify(self, commit: Commit) -> None:
        """Checks every chunk of ``commit``'s slot against the checksums committed with it; raises on a mismatch."""
        size = _CHECKSUM_BYTES * len(self.chunk_sizes)
        table = os.pread(self.fd, size, self._table_at(commit.slot))
        if len(table) != size or zlib.crc32(table) != commit.table_crc:
            raise PagedStateFileError(
                f"{self.path} is corrupt: the checksum table of commit {commit.serial} does not match its record"
            )
        for k, expected in enumerate(struct.unpack(f"<{len(self.chunk_sizes)}Q", table)):
            if k + 1 < len(self.chunk_sizes):
                self.advise(k + 1, commit.slot)
            found = self._checksum(k, commit.slot)
            if found != expected:
                raise PagedStateFileError(
                    f"{self.path} is corrupt: chunk {k} of commit {commit.serial} has checksum {found:016x}, "
                    f"its commit recorded {expected:016x}"
                )

    def _checksum(self, chunk: int, slot: int) -> int:
        """The checksum of a chunk's state leaves in ``slot``."""
        size = self.chunk_sizes[chunk]
        if size == 0:
            return 0
        places = described_places(self.description["chunks"][chunk])
        return leaves_checksum(self.window(chunk, slot), places)

    # data -------------------------------------------------------------------------------------------------------
    def window(self, chunk: int, slot: int, writable: bool = False) -> torch.Tensor:
        """The bytes of one chunk's slot as a uint8 tensor over the file's map, or over a map of the window alone
        (see ``StateFile``).

        A read window is read-only: an inner transform that wrote into its input state would fault, not corrupt the
        file. A writable window (of the slot an update writes) lets a fused step write the state where it lies in the
        page cache, with no copy in and out; its space was reserved at creation, so no write through it can fail for
        want of disk space.
        """
        size = self.chunk_sizes[chunk]
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        offset = self.chunk_offsets[chunk] + slot * size
        found = self._windows.get((chunk, slot, writable))
        if found is not None:
            return found
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "the buffer is not writable": by design
            if self._mapped_whole:
                found = torch.frombuffer(self._mapped(writable), dtype=torch.uint8, count=size, offset=offset)
                self._windows[(chunk, slot, writable)] = found
                return found
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            own = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=prot, offset=offset)
            return torch.frombuffer(own, dtype=torch.uint8)

    def write(self, chunk: int, slot: int, place: LeafPlace, tensor: torch.Tensor, checksum: ChunkChecksum) -> None:
        """Writes one leaf with ``pwrite`` (one copy into the page cache, no page faults) and adds its bytes, as they
        are in memory, to ``checksum``: the chunk's checksum when its leaves are written in order of offset."""
        if place.nbytes == 0:
            return
        tensor = tensor.detach().to("cpu").contiguous()
        data = _bytes_of(tensor, place.nbytes)
        self._pwrite(data, self.chunk_offsets[chunk] + slot * self.chunk_sizes[chunk] + place.offset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only view of the bytes, which are only read
            checksum.add(torch.frombuffer(data, dtype=torch.uint8))

    def advise(self, chunk: int, slot: int) -> None:
        """Starts reading a chunk's slot into the page cache in the background (overlaps disk reads with compute)."""
        size = self.chunk_sizes[chunk]
        if size:
            with suppress(AttributeError, OSError):
                os.posix_fadvise(self.fd, self.chunk_offsets[chunk] + slot * size, size, os.POSIX_FADV_WILLNEED)


class _Builder:
    """Writes a new file chunk by chunk: each chunk's space is reserved (so a full disk fails here, not with SIGBUS
    on a later write through the map), then its initial state goes into slot 0."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd
        self.file_id = secrets.randbits(63)
        self.end = PAGE
        self.chunks: list[dict] = []
        self.checksums: list[int] = []  # of slot 0, which holds the initial state

    def reserve(self, size: int) -> int:
        offset = self.end
        if size:
            try:
                os.posix_fallocate(self.fd, offset, 2 * size)
            except OSError as err:
                raise _os_error(err, self.path, "reserve space for the paged state file", offset + 2 * size) from None
        self.end = offset + 2 * size
        return offset

    def add_chunk(self, chunk: dict, leaves: list[torch.Tensor], places: list[LeafPlace]) -> None:
        offset = self.reserve(chunk["size"])
        self.chunks.append({**chunk, "offset": offset})
        checksum = 0
        if chunk["size"]:
            mapped = mmap.mmap(self.fd, chunk["size"], access=mmap.ACCESS_WRITE, offset=offset)
            buffer = torch.frombuffer(mapped, dtype=torch.uint8)
            for place in places:
                view_leaf(buffer, place).copy_(leaves[place.index])
            checksum = leaves_checksum(buffer, places)
            del buffer
            mapped.close()
        self.checksums.append(checksum)

    def finish(self, durable: bool) -> None:
        description = {"version": FORMAT_VERSION, "chunks": self.chunks}
        raw = json.dumps(description, sort_keys=True).encode()
        table_offset, desc_offset = self.end, self.end + 2 * _CHECKSUM_BYTES * len(self.chunks)
        digest = hashlib.sha256(raw).digest()
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.file_id, digest, desc_offset, len(raw), table_offset)
        state_file = StateFile(self.path, self.fd, self.file_id, description, table_offset)
        for data, offset in ((raw, desc_offset), (header, 0)):
            state_file._pwrite(data, offset)
        state_file._write_record(1, None, durable=False)
        state_file.commit(Commit(1, 0, 0), self.checksums, durable=False)
        if durable:
            os.fsync(self.fd)  # a new checkpoint is on the disk before it replaces the old one


def release_freed_memory() -> None:
    """Hands memory that was freed back to the system (glibc keeps freed blocks up to 32 MiB in its heap, so the
    chunk-by-chunk creation of a large state would otherwise stay in the resident set); a no-op elsewhere."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
