"""Paged decode steps in fixed shapes, replayed from CUDA graphs on a GPU.

On a GPU a decode step of a model this fleet serves is mostly kernel launches: hundreds a
step (every layer's projections, its cache's writes and gathers, its attention), each a
few microseconds of the CPU for a kernel that runs in less (a lone paged step of GPT-2
small took 9.6 ms on an H200, docs/gpu-validation.md). A CUDA graph records a step's
kernels once and replays them with one launch, as vLLM, SGLang and nano-vllm do. A graph
replays fixed shapes at fixed addresses, so a step here is laid out in a **fixed shape**:
- its rows padded to the next power of two (1, 2, 4, ... as those engines pad them);
- its columns (each row's slots, right-aligned, the step's own last) padded on the left to
  the next power of two, at least a block's worth;
- its inputs (token ids, positions, the slot index, the attention mask, the slots the new
  keys go to) copied into tensors the shape owns before each replay, and its logits read
  from one buffer every shape's graph writes into.
A padded row reads and writes only one slot of the null block that no row reads unmasked
(`scratch`), and the mask hides every padded column, as in the step before padding.

A graph holds the store's tensors at the addresses it was recorded on: when the store
grows (new tensors), every graph goes and shapes are recorded again as they recur.
Recording needs a warm-up run of the step, so a shape's first step runs three times
(warm-up, record, replay); it writes the same keys to the same slots each time. Both run
on a stream of the replica's own GPU. If recording fails (torch raises: a model whose
forward reads a value back to the host, say), the failure is logged once and the
replica's steps run without graphs from then on (the graphs recorded so far go; the
stepping thread keeps its own stream, and the allocator is told the capture ended:
`_end_recording`); if it runs out of memory, only that shape's steps do, until the store
grows and every shape is recorded again. Either way such a step runs as the engine runs
it without graphs, unpadded.

Off a GPU (`record=False`) the same padded step runs as it is, without a graph: what a
graph would record is what the CPU tests check against the unpadded step.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.generation.kv.blocks import NULL_BLOCK

log = logging.getLogger(__name__)


def round_up(count: int, least: int = 1) -> int:
    """The power of two at least `count` and `least`."""
    size = max(1, least)
    while size < count:
        size *= 2
    return size


@dataclass
class Inputs:
    """One shape's inputs, which its graph reads: `ids` and `positions` `[rows, 1]`,
    `index` the slots each row reads `[rows, width]` (right-aligned, its new slot last),
    `mask` `[rows, 1, 1, width]` (True where a column is a token of its row), `slots` the
    slot each row's new keys and values go to `[rows]`."""

    ids: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def empty(cls, rows: int, width: int, device: torch.device) -> Inputs:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        mask = torch.zeros((rows, 1, 1, width), dtype=torch.bool, device=device)
        return cls(longs(rows, 1), longs(rows, 1), longs(rows, width), mask, longs(rows))

    def fill(  # noqa: PLR0917 - a step's five tensors
        self, ids: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
        mask: torch.Tensor, slots: torch.Tensor, scratch: int,
    ) -> None:  # fmt: skip
        """Copy one step's inputs in (`index`, `mask`: `[rows, columns]`), padding rows and
        columns: padded columns read slot 0 masked, padded rows `scratch` alone."""
        rows, columns = index.shape
        width = self.index.shape[1]
        self.ids.zero_()
        self.ids[:rows].copy_(ids)
        self.positions.zero_()
        self.positions[:rows].copy_(positions)
        self.index.zero_()
        self.index[:rows, width - columns :].copy_(index)
        self.index[rows:, -1] = scratch
        self.mask.zero_()
        self.mask[:rows, 0, 0, width - columns :].copy_(mask.bool())
        self.mask[rows:, 0, 0, -1] = True
        self.slots.fill_(scratch)
        self.slots[:rows].copy_(slots)


#: One step of the model over a shape's inputs: its logits `[rows, vocabulary]`.
Step = Callable[[Inputs], torch.Tensor]


class _Shape:
    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.inputs = Inputs.empty(rows, width, device)
        self.graph: Any = None  # torch.cuda.CUDAGraph once recorded
        self.eager = False  # its recording ran out of memory: its steps run as they are


class DecodeGraphs:
    """One replica's decode steps in fixed shapes (see the module): recorded as CUDA graphs when
    `record`, else run as they are. Kept with the replica's KV blocks while it is on its
    GPU, so that its engines, opened and closed as calls come and go, record each shape once;
    each engine names its step (`use`). Its KV blocks hold `block` tokens each;
    `rows`, the most a step has."""

    def __init__(self, device: torch.device, block: int, rows: int, *, record: bool) -> None:
        # the step of the engine open now, held weakly: the replica's blocks hold these
        # graphs, and its engines hold the blocks, so a strong hold would keep the blocks
        # (on the GPU) alive after the replica let them go, until the cyclic GC ran
        self._step: weakref.WeakMethod[Step] | None = None
        self._stream: Any = None  # the stream shapes are recorded on (this GPU's own)
        self.device = device
        self.block = block  # tokens a KV block holds: the fewest columns a shape has
        self.scratch = NULL_BLOCK * block + block - 1  # the null block's last slot
        self.rows = round_up(rows)  # the most rows a step holds, rounded up
        self.record = record
        self.failed = False  # recording failed: the engine steps without graphs from now on
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._logits: torch.Tensor | None = None  # [rows, vocabulary], every graph's output
        self._pool: Any = None  # the graphs' shared memory pool
        self._store: tuple[int, ...] = ()  # the store's tensors the graphs were recorded on
        self.recorded = 0  # graphs recorded (a shape again after the store grew counts again)
        self.replayed = 0

    def use(self, step: Step) -> None:
        """Record the shapes still to come with `step`, a bound method of the engine now
        open (it runs the model over a shape's inputs)."""
        self._step = weakref.WeakMethod(step)

    def step(self, inputs: Inputs) -> torch.Tensor:
        """The open engine's step over `inputs`."""
        step = self._step() if self._step is not None else None
        if step is None:
            raise RuntimeError("no engine is open on these decode graphs")
        return step(inputs)

    def run(  # noqa: PLR0917 - a step's five tensors
        self, ids: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
        mask: torch.Tensor, slots: torch.Tensor, addresses: tuple[int, ...],
    ) -> torch.Tensor | None:  # fmt: skip
        """One decode step (each argument as `Inputs.fill` takes it; `addresses`, those
        of the store's tensors, grown for this step): the rows' logits, `[rows,
        vocabulary]`, valid until the next step; None where the shape's recording failed
        or ran out of memory (the caller runs the step as it is, unpadded: padded, it
        would need more)."""
        rows, columns = index.shape
        shape = (round_up(rows), round_up(columns, self.block))
        if addresses != self._store:
            self._shapes.clear()  # recorded on tensors the store has let go
            self._pool = None  # and a new pool for the graphs to come
            self._store = addresses
        entry = self._shapes.get(shape)
        if entry is None:
            entry = self._shapes[shape] = _Shape(*shape, self.device)
        entry.inputs.fill(ids, positions, index, mask, slots, self.scratch)
        if not self.record:
            return self.step(entry.inputs)[:rows]
        if entry.eager:
            return None
        if entry.graph is None:
            try:
                self._record(entry)
            except torch.OutOfMemoryError:  # the GPU is full now, not the model unrecordable
                log.warning(
                    "recording a decode step of %d rows and %d columns as a CUDA graph ran"
                    " out of memory; steps of that shape run without one until the KV"
                    " store grows", *entry.inputs.index.shape,
                )  # fmt: skip
                entry.eager = True
                return None
            except RuntimeError as error:  # torch's; the step itself is sound: run it as it is
                recording_failed(error)
                self.failed = True
                self._shapes.clear()  # none replays again: their graphs and pool go
                self._pool = None
                return None
        entry.graph.replay()
        self.replayed += 1
        assert self._logits is not None
        return self._logits[:rows]

    def _record(self, entry: _Shape) -> None:
        """Warm the shape's step up on a side stream (lazy initialisation, the allocator's
        first blocks), then record it into the shared pool, writing its logits into the
        buffer every graph shares (made for the most rows at the first recording)."""
        inputs = entry.inputs
        rows = inputs.ids.shape[0]
        if self._stream is None:
            # this GPU's own: torch's default recording stream is made once per process, on
            # whichever GPU recorded first, and a worker steps engines on several GPUs
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            logits = self.step(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._logits is None:
            shape = (max(self.rows, rows), logits.shape[-1])
            self._logits = torch.empty(shape, dtype=logits.dtype, device=self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # The outer context gives this thread its stream back whatever the recording does:
        # torch's `graph` leaves its own stream context only after `capture_end` returns,
        # and `capture_end` raises for a capture the model's step invalidated.
        with torch.cuda.stream(side):
            try:
                # thread_local: other threads of the worker (a copy to or from the GPU)
                # may use CUDA while this one records
                with torch.cuda.graph(
                    graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
                ):
                    self._logits[:rows].copy_(self.step(inputs))
            except BaseException:
                _end_recording(self.device, self._pool)
                raise
        entry.graph = graph
        self.recorded += 1


def _end_recording(device: torch.device, pool: Any) -> None:
    """After a recording that raised: when torch's `capture_end` raised before telling the
    caching allocator that the capture ended (`cudaStreamEndCapture` failed), tell it
    now, and give back the hold the capture took on the graphs' `pool`, which a graph whose
    capture never ended does not. Else the allocator would count a capture underway for
    good, and while one is, it does not free its cached blocks to retry an allocation
    that ran out of memory. When `capture_end` did tell it, the allocator refuses (the
    graph gives its own hold back when it goes), and nothing is done. The calls are
    torch's own `use_mem_pool`'s, private to torch (absent: nothing to do)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        end(index, pool)
    except RuntimeError:
        return  # not recording into it: capture_end ended it
    release(index, pool)


def recording_failed(error: BaseException) -> None:
    """Say why a replica's decode steps run without graphs from now on (once a replica)."""
    log.warning(
        "recording a decode step as a CUDA graph failed (%s: %s); this replica's decode"
        " steps run without graphs (set GPUFLEET_CUDA_GRAPHS=0 to skip trying)",
        type(error).__name__, error,
    )  # fmt: skip


__all__ = ["DecodeGraphs", "Inputs", "Step", "recording_failed", "round_up"]
