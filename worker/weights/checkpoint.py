"""Read safetensors checkpoints at the speed of the disk.

transformers' loader converts weights tensor by tensor in a thread pool; on a 2-core host
it reached 0.31 x a raw sequential read of the same file. This reader does large
sequential reads instead, and trusts nothing in a file it has not checked (offsets inside
the file, known dtypes, byte counts that match the shapes):

- `Prefetch` pulls the files into the page cache front to back in a background thread
  (sendfile to /dev/null: no copy to user space, no GIL held), so the disk is busy while
  the caller builds the model's skeleton; it stays at most `LEAD` bytes ahead of the
  reader, so a model larger than the page cache is not read twice;
- `Checkpoint.to_cpu` (simulated GPUs) returns views of a private, read-populated mmap:
  no copy and no zeroing of fresh memory, as llama.cpp and Ollama load CPU weights;
  writes are copy-on-write, so the file never changes;
- `Checkpoint.to_cuda` streams the bytes through two pinned buffers into one allocation
  per tensor, each chunk's host-to-device copy overlapping the next read.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from placement.errors import CheckpointError, UnsupportedCheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHUNK = 8 * 2**20  # one pinned staging buffer: small enough to stay in the CPU's cache
STEP = 64 * 2**20  # one prefetch request
SMALL = 4 * 2**20  # the prefetch's read size where sendfile is unavailable
LEAD = 2**30  # how far the prefetch may run ahead of the reader
MAX_HEADER = 100 * 2**20
MADV_POPULATE_READ = 22  # Linux >= 5.14; older kernels fall back to touching each page
PAGE = mmap.PAGESIZE

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: where its bytes lie in which file."""

    name: str
    file: int  # index into Checkpoint.files
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Checkpoint:
    """The safetensors files of one model directory, their headers parsed and checked."""

    def __init__(self, files: list[Path], entries: dict[str, Entry]) -> None:
        self.files = files
        self.entries = entries

    @classmethod
    def open(cls, directory: Path) -> Checkpoint:
        """Parse `model.safetensors`, or every shard its index names."""
        if (directory / SINGLE).is_file():
            names = [SINGLE]
        elif (directory / INDEX).is_file():
            names = _shards(directory / INDEX)
        else:
            raise UnsupportedCheckpointError(f"{directory} has no {SINGLE} or {INDEX}")
        files = [directory / name for name in names]
        entries: dict[str, Entry] = {}
        for index, path in enumerate(files):
            for entry in _header(path, index):
                if entry.name in entries:  # transformers lets the last shard win
                    raise UnsupportedCheckpointError(f"{path}: {entry.name!r} is in two shards")
                entries[entry.name] = entry
        return cls(files, entries)

    def prefetch(self) -> Prefetch:
        """Start reading every file into the page cache in the background."""
        return Prefetch(self.files)

    def to_cpu(
        self, names: Iterable[str], prefetch: Prefetch | None = None
    ) -> dict[str, torch.Tensor]:
        """The named tensors as views of a private mmap, every page read before returning."""
        out: dict[str, torch.Tensor] = {}
        for index, group in self._by_file(names):
            try:
                with open(self.files[index], "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
            except (OSError, ValueError) as exc:  # e.g. a file system without mmap
                raise UnsupportedCheckpointError(f"{self.files[index]}: cannot map: {exc}") from exc
            if len(mapped) < max(e.end for e in group):
                raise CheckpointError(
                    f"{self.files[index]}: now {len(mapped)} bytes, shorter than its header "
                    f"says; it was truncated while loading"
                )
            for begin, end in _spans(group, gap=STEP):
                for start in range(begin - begin % PAGE, end, STEP):
                    _populate(mapped, start, min(STEP, end - start), self.files[index])
                    if prefetch is not None:
                        prefetch.advance(index, start + STEP)
            data = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the mmap alive
            for entry in group:
                raw = data[entry.begin : entry.end]
                if entry.begin % entry.dtype.itemsize:
                    raw = raw.clone()  # a misaligned tensor cannot be a dtype view
                out[entry.name] = raw.view(entry.dtype).view(entry.shape)
        return out

    def to_cuda(
        self, names: Iterable[str], device: torch.device, prefetch: Prefetch | None = None
    ) -> dict[str, torch.Tensor]:
        """The named tensors on `device`, copied through two pinned staging buffers."""
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            staging = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            copied: list[torch.cuda.Event | None] = [None, None]
            turn = 0
            for index, group in self._by_file(names):
                targets = {
                    e.name: torch.empty(e.shape, dtype=e.dtype, device=device) for e in group
                }
                out.update(targets)
                pending = deque(e for e in group if e.nbytes)
                try:
                    fd = os.open(self.files[index], os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(f"{self.files[index]}: cannot open it: {exc}") from exc
                try:
                    for begin, end in _spans(group, gap=CHUNK):
                        for start in range(begin, end, CHUNK):
                            stop = min(start + CHUNK, end)
                            slot = turn % 2
                            done = copied[slot]
                            if done is not None:
                                done.synchronize()  # the last copy out of this buffer finished
                            buffer = staging[slot]
                            _read_exact(fd, buffer, start, stop - start, self.files[index])
                            for entry in _overlapping(pending, start, stop):
                                a, b = max(entry.begin, start), min(entry.end, stop)
                                flat = targets[entry.name].view(-1).view(torch.uint8)
                                flat[a - entry.begin : b - entry.begin].copy_(
                                    buffer[a - start : b - start], non_blocking=True
                                )
                            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                            event.record(stream)
                            copied[slot] = event
                            turn += 1
                            if prefetch is not None:
                                prefetch.advance(index, stop)
                finally:
                    os.close(fd)
            stream.synchronize()
        return out

    def _by_file(self, names: Iterable[str]) -> Iterator[tuple[int, list[Entry]]]:
        """The named entries grouped by file, in file order and then offset order."""
        groups: dict[int, list[Entry]] = {}
        for name in names:
            entry = self.entries[name]
            groups.setdefault(entry.file, []).append(entry)
        for index in sorted(groups):
            yield index, sorted(groups[index], key=lambda e: e.begin)


class Prefetch:
    """Reads files front to back into the page cache, at most `LEAD` (+ one step) ahead.

    Best effort: a read error stops it silently, and the real read reports the error.
    """

    def __init__(self, files: list[Path]) -> None:
        self._files = files
        self._starts = [0]
        for path in files:
            try:
                self._starts.append(self._starts[-1] + path.stat().st_size)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read it: {exc}") from exc
        self._reader = 0  # where the consumer is, in bytes over all files
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="gpufleet-prefetch", daemon=True)
        self._thread.start()

    def advance(self, file: int, offset: int) -> None:
        """The consumer has read `file` up to `offset`; let the prefetch run further."""
        with self._cond:
            self._reader = max(self._reader, self._starts[file] + offset)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        spare = memoryview(bytearray(SMALL))
        try:
            with open(os.devnull, "wb") as sink:
                for index, path in enumerate(self._files):
                    with open(path, "rb", buffering=0) as f:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                        offset = 0
                        while self._wait_for_room(self._starts[index] + offset):
                            read = _discard(f, sink, offset, spare)
                            if not read:
                                break
                            offset += read
        except OSError:
            return

    def _wait_for_room(self, position: int) -> bool:
        with self._cond:
            while not self._stopped and position - self._reader >= LEAD:
                self._cond.wait()
            return not self._stopped


def _discard(f: BinaryIO, sink: BinaryIO, offset: int, spare: memoryview) -> int:
    """Pull up to `STEP` bytes of `f` into the page cache without copying them out."""
    try:
        return os.sendfile(sink.fileno(), f.fileno(), offset, STEP)
    except OSError:  # no sendfile to /dev/null here: read through a small buffer
        return os.preadv(f.fileno(), [spare], offset)


def _shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc}); re-save it") from exc
    for name in names:
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{index}: shard {name!r} is not a file name in its directory")
    return names


def _header(path: Path, file: int) -> list[Entry]:
    """Parse and check one file's header; offsets become absolute."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            (length,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (None,)
            raw = f.read(length) if length is not None and length <= MAX_HEADER else b""
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from exc
    if length is None:
        raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
    if length > min(MAX_HEADER, size - 8):
        raise CheckpointError(f"{path}: header length {length} is past the file; re-save it")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: the header is not JSON ({exc}); re-save it") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object; re-save it")
    base = 8 + length
    entries: list[Entry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed entry") from exc
        if not isinstance(dtype_name, str):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed dtype")
        if dtype_name not in DTYPES:
            raise UnsupportedCheckpointError(f"{path}: tensor {name!r} has dtype {dtype_name}")
        dtype = DTYPES[dtype_name]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
        numel = 1
        for dim in shape:
            numel *= dim
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise CheckpointError(f"{path}: tensor {name!r} has malformed offsets")
        if end - begin != numel * dtype.itemsize or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} needs bytes {begin}..{end} that do not match its "
                f"shape or lie past the end of the file; the file is truncated or corrupt"
            )
        entries.append(Entry(name, file, dtype, tuple(shape), base + begin, base + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    covered = base
    for entry in entries:  # as safetensors itself checks: no overlap, no hole, no tail
        if entry.begin != covered:
            raise CheckpointError(
                f"{path}: tensor {entry.name!r} starts at byte {entry.begin}, not {covered}; "
                f"tensors overlap or leave a hole: the file is corrupt"
            )
        covered = entry.end
    if covered != size:
        raise CheckpointError(f"{path}: {size - covered} bytes after the last tensor; re-save it")
    return entries


def _spans(entries: list[Entry], gap: int) -> list[tuple[int, int]]:
    """Byte ranges covering `entries` (sorted by offset), merging holes shorter than `gap`."""
    spans: list[tuple[int, int]] = []
    for entry in entries:
        if not entry.nbytes:
            continue
        if spans and entry.begin - spans[-1][1] < gap:
            spans[-1] = (spans[-1][0], max(spans[-1][1], entry.end))
        else:
            spans.append((entry.begin, entry.end))
    return spans


def _overlapping(pending: deque[Entry], start: int, stop: int) -> list[Entry]:
    """Entries of `pending` (in offset order) that overlap [start, stop); forget finished ones."""
    hits: list[Entry] = []
    for entry in pending:
        if entry.begin >= stop:
            break
        if entry.end > start:
            hits.append(entry)
    while pending and pending[0].end <= stop:
        pending.popleft()
    return hits


def _populate(mapped: mmap.mmap, start: int, length: int, path: Path) -> None:
    """Read a range of a file mapping into memory now, not at first use."""
    try:
        mapped.madvise(MADV_POPULATE_READ, start, length)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EFAULT/EIO: touching the pages would raise SIGBUS
            raise CheckpointError(f"{path}: reading it failed: {exc}; is it truncated?") from exc
        _ = mapped[start : start + length : PAGE]  # kernels before 5.14: touch each page


def _read_exact(fd: int, buffer: torch.Tensor, offset: int, length: int, path: Path) -> None:
    view = buffer.numpy().data
    done = 0
    while done < length:
        try:
            read = os.preadv(fd, [view[done:length]], offset + done)
        except OSError as exc:
            raise CheckpointError(f"{path}: reading byte {offset + done} failed: {exc}") from exc
        if read <= 0:
            raise CheckpointError(f"{path}: ended at byte {offset + done}; the file is truncated")
        done += read
