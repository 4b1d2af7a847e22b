"""Warm copies the other GPU workers of a host can read: issue 41's "one arena per host".

A warm copy stays its holder's: the holder alone restores it, drops it, or reuses its
region. What another worker of the host may do is *read* it, as the source of an ordinary
load onto its own GPU, instead of reading the model's files (docs/worker.md, "Warm copies
another worker reads"). The ledger needs no new transition for that: the copy stays a WARM
record, and the reader's replica is loaded like any other.

The holder publishes a copy once it is whole (`publish`): after the copy's tensors, in its
own arena region, it writes a header:

    nonce (8 bytes) | manifest length (8 bytes) | manifest (JSON: [name, dtype, shape, offset])

and hands the region's `Locator` to the ledger with the offload. The nonce is a seqlock's
count: random, never 0, written last. Before the holder gives the region back (a restore,
a drop) it writes 0 there (`withdraw`). A reader checks the nonce, copies the tensors it
wants, waits for its copies, and checks the nonce again (`WarmCopy.read`): if it changed,
the region may have been reused under the copy, and the reader loads from disk instead.
A copy whose holder died, or that lives in another container's PID namespace, cannot be
opened, and the reader loads from disk as well. The manifest lists the tensors of the
model's state dict (parameters and persistent buffers, each once): what a checkpoint
holds, and what the reader fills its skeleton with.

Ordering: the nonce is written last and read first and last by plain loads and stores.
x86 keeps them in order; elsewhere the holder's arena lock, released after the nonce is
zeroed and before a region can be reused, and on the reader's side the interpreter lock
that torch releases and takes again around each copy (and, on CUDA, the device
synchronisation), order the copies between the two reads.

The reader maps the holder's chunk read-only through `/proc/<pid>/fd/<n>`, which the
kernel allows to processes of the same user (ptrace's read access), and checks the link
names an arena chunk (`worker.warm.arena.MEMFD`) before it maps anything.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import secrets
import struct
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch

from placement.errors import WarmCopyGoneError
from worker.warm.arena import MEMFD, PinnedArena, Region, align, layout
from worker.weights.checkpoint import DTYPES

log = logging.getLogger(__name__)

HEAD = struct.Struct("<qq")  # the nonce, then the manifest's length
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Locator:
    """Where a published warm copy lies: the holder's pid and memfd, the region's offset
    and size in that memfd, its header's offset in the region, and the nonce it carries."""

    pid: int
    fd: int
    offset: int
    size: int
    header: int
    nonce: int

    def __str__(self) -> str:
        return f"{self.pid}:{self.fd}:{self.offset}:{self.size}:{self.header}:{self.nonce}"

    @classmethod
    def parse(cls, text: str) -> Locator:
        """A locator from its `str`; `WarmCopyGoneError` when `text` is not one."""
        try:
            pid, fd, offset, size, header, nonce = (int(part) for part in text.split(":"))
        except ValueError:
            raise WarmCopyGoneError(f"{text!r} does not locate a warm copy") from None
        if min(pid, fd, offset, size, header) < 0 or not nonce or header + HEAD.size > size:
            raise WarmCopyGoneError(f"{text!r} does not locate a warm copy")
        return cls(pid, fd, offset, size, header, nonce)


@dataclass(frozen=True)
class Slot:
    """One tensor of a published copy (the fields `worker.loading` matches a model by)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the region

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header_room(model: Any) -> int:
    """Bytes a copy of `model` needs after its tensors for its header, laid out as an
    offload lays it (`worker.warm.arena.layout`): what its arena region must hold beyond them."""
    named = _named(model)
    offsets, _ = layout([t.data for t in named.values()])
    listed = _listed(model)
    entries = [
        [name, _DTYPE_NAMES.get(t.dtype, "?"), list(t.shape), offset]
        for (name, t), offset in zip(named.items(), offsets, strict=True)
        if name in listed
    ]
    return align(HEAD.size + len(_encode(entries)))


def publish(arena: PinnedArena, region: Region, model: Any) -> Locator | None:
    """Publish the warm copy of `model` that lies in `region`: write its header after its
    tensors and return where to find it. None when it cannot be shared: its chunk is
    private, a tensor lies outside the region or cannot be described, or no room is left."""
    fd, offset = arena.where(region)
    if fd < 0:
        return None
    raw = arena.raw(region)
    described = _entries(model, raw.data_ptr(), region.size)
    if described is None:
        return None
    entries, end = described
    body = _encode(entries)
    header = align(end)
    if header + HEAD.size + len(body) > region.size:
        log.info("no room left in a warm copy's region for its header: not shared")
        return None
    nonce = secrets.randbits(63) or 1
    raw[header + 8 : header + HEAD.size + len(body)] = _bytes(struct.pack("<q", len(body)) + body)
    raw[header : header + 8] = _bytes(struct.pack("<q", nonce))  # last: readable from here on
    return Locator(os.getpid(), fd, offset, region.size, header, nonce)


def withdraw(arena: PinnedArena, region: Region, locator: Locator) -> None:
    """Mark a published copy gone, before its region is given back: a reader that still
    copies it finds the nonce changed and loads from disk."""
    raw = arena.raw(region)
    raw[locator.header : locator.header + 8] = 0


class WarmCopy:
    """A neighbour's published warm copy, mapped read-only: its tensors by name
    (`entries`), copied out with `read`."""

    def __init__(self, mapping: mmap.mmap, start: int, locator: Locator) -> None:
        self._mapping = mapping
        self._start = start  # the region's first byte in the mapping
        self.locator = locator
        self.entries = self._manifest()

    def intact(self) -> bool:
        """Whether the copy is still the one published (its nonce unchanged)."""
        nonce, _ = HEAD.unpack_from(self._mapping, self._start + self.locator.header)
        return bool(nonce == self.locator.nonce)

    def read(self, names: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
        """Copies of the named tensors on `device`, in memory of their own; the copies
        have all run when this returns. `WarmCopyGoneError` when the copy changed meanwhile."""
        out: dict[str, torch.Tensor] = {}
        for name in names:
            slot = self.entries[name]
            if not slot.nbytes:
                out[name] = torch.empty(slot.shape, dtype=slot.dtype, device=device)
                continue
            with warnings.catch_warnings():  # read-only on purpose: nothing writes through it
                warnings.simplefilter("ignore", UserWarning)
                view = torch.frombuffer(
                    self._mapping, dtype=torch.uint8, count=slot.nbytes,
                    offset=self._start + slot.offset,
                )  # fmt: skip
            tensor = view.view(slot.dtype).view(slot.shape)
            out[name] = tensor.to(device) if device.type != "cpu" else tensor.clone()
            del view, tensor
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not self.intact():
            raise WarmCopyGoneError("the warm copy changed while it was read")
        return out

    def _manifest(self) -> dict[str, Slot]:
        if not self.intact():
            raise WarmCopyGoneError("the warm copy was withdrawn")
        at = self._start + self.locator.header
        _, length = HEAD.unpack_from(self._mapping, at)
        if length <= 0 or at + HEAD.size + length > self._start + self.locator.size:
            raise WarmCopyGoneError("the warm copy's manifest is malformed")
        try:
            rows = json.loads(self._mapping[at + HEAD.size : at + HEAD.size + length])
            entries = {
                str(name): Slot(DTYPES[dtype], tuple(int(d) for d in shape), int(offset))
                for name, dtype, shape, offset in rows
            }
        except (ValueError, KeyError, TypeError) as exc:
            raise WarmCopyGoneError(f"the warm copy's manifest is malformed: {exc}") from None
        for slot in entries.values():
            if min(slot.shape, default=0) < 0 or slot.offset % slot.dtype.itemsize:
                raise WarmCopyGoneError("the warm copy's manifest is malformed")
            if slot.offset < 0 or slot.offset + slot.nbytes > self.locator.header:
                raise WarmCopyGoneError("the warm copy's manifest points outside its tensors")
        return entries


@contextmanager
def opened(text: str) -> Iterator[WarmCopy]:
    """The copy `text` locates, mapped while the block runs; `WarmCopyGoneError` when it
    cannot be read (its holder is gone or out of reach, or it was withdrawn)."""
    locator = Locator.parse(text)
    path = f"/proc/{locator.pid}/fd/{locator.fd}"
    base = locator.offset - locator.offset % mmap.ALLOCATIONGRANULARITY
    try:
        if not os.readlink(path).startswith(f"/memfd:{MEMFD}"):
            raise WarmCopyGoneError(f"{path} is not a warm copy's chunk")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            length = locator.offset - base + locator.size
            mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=base)
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:
        raise WarmCopyGoneError(f"cannot map the warm copy at {path}: {exc}") from None
    try:
        yield WarmCopy(mapping, locator.offset - base, locator)
    finally:
        with suppress(BufferError):  # a view still alive (a traceback's): unmapped with it
            mapping.close()


def _named(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters, then its buffers, by name, each once: the order an offload
    copies them in (`worker.loading.to_cpu`)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _listed(model: Any) -> set[str]:
    """The names the manifest lists: those of the model's state dict. Its non-persistent
    buffers (rotary frequencies, position ids) are left out, as a checkpoint leaves them:
    a reader's skeleton computes them, and their dtype is not the weights'."""
    return set(model.state_dict(keep_vars=True))


def _entries(model: Any, base: int, size: int) -> tuple[list[list[Any]], int] | None:
    """The manifest of a copy whose region starts at address `base`, and where its last
    tensor ends; None when a tensor lies outside the region or cannot be described."""
    entries: list[list[Any]] = []
    end = 0
    listed = _listed(model)
    for name, tensor in _named(model).items():
        data = tensor.data
        dtype = _DTYPE_NAMES.get(data.dtype)
        if type(data) is not torch.Tensor or dtype is None or data.device.type != "cpu":
            return None
        nbytes = data.numel() * data.element_size()
        offset = data.data_ptr() - base if nbytes else 0
        if nbytes and (offset < 0 or offset + nbytes > size or not data.is_contiguous()):
            return None
        if name in listed:
            entries.append([name, dtype, list(data.shape), offset])
        end = max(end, offset + nbytes)  # the header goes after every tensor of the copy
    return entries, end


def _encode(entries: list[list[Any]]) -> bytes:
    return json.dumps(entries, separators=(",", ":")).encode()


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


__all__ = ["HEAD", "Locator", "Slot", "WarmCopy", "header_room", "opened", "publish", "withdraw"]
