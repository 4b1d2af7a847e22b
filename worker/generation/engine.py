"""Continuous batching for one causal language model: calls share decode steps.

An `Engine` holds one replica's running sequences as the rows of one batch. Each `step`
first admits waiting sequences and prefills their prompts (in left-padded passes, as
`generate` prefills a batch), then runs one decode step for every row at once, then lets
the rows that are done leave. A sequence joins at the next step and leaves when it is done:
a short call never waits for a long one.

Paged, a step prefills prompts in chunks: while rows are decoding, at most the prompt
tokens whose compute costs one decode step (`worker.generation.pacing`), so a burst of
long prompts does not freeze the streams already running; a prompt whose prefill is not
done yet holds its blocks and goes on at the next step, ahead of anything admitted after
it, and joins the rows with its first token once its last chunk is in.

The batch's KV cache is paged (`worker.generation.paging`, docs/worker.md): each row's keys
and values live in blocks of the replica's budget, taken as the row grows, and whole
blocks are shared by every row whose tokens begin the same way. Rows of different lengths
are laid out right-aligned, left-padded, with the attention mask and explicit position ids
keeping the padding out of the arithmetic, as `generate` does for a left-padded batch.
With `paged_cache=False` the engine keeps the rows' keys and values padded in place
instead (`slots`, the engine before paging, kept for comparison); models whose cache is
not plain full attention (sliding windows, linear attention) run one row at a time so.

Memory: the engine never holds more than `budget` tokens of cache. Paged, a sequence is
admitted when the blocks its prompt takes (less its cached prefix) fit, and when blocks
run out mid-generation the youngest row is preempted and recomputed later. Left-padded, a
batch of `r` rows takes `r x` the longest row's reach (prompt plus max_new_tokens), so a
sequence is admitted only while that bound fits. Either way the others wait, and a
sequence that could never fit (longer than the model's window or the whole budget) is
refused when it is added.

Fairness: waiting sequences are admitted in start-time fair queueing order (Goyal et al.,
SIGCOMM 1996, `worker.generation.line`) in two levels: each tenant is a flow by its weight
(calls of no tenant are the default tenant's, of weight 1), and a tenant's calls take its
turns by the same rule among themselves (a sequence's key is `(call, prompt index)`, its
cost its reach). So a call of 64 prompts gets its share of rows, not all of them ahead of
a call that arrives after it, and a tenant's burst of calls does not stand ahead of
another tenant's: the newcomer's sequence is admitted at the next free row. Calls that
arrive together keep their order (ties go to the first added), and within a call the
prompts keep theirs.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from placement.errors import PayloadError
from worker.adapters.room import AdapterRoom
from worker.generation import sampling
from worker.generation.kv import blocks, paged, slots
from worker.generation.kv.graphs import DecodeGraphs
from worker.generation.line import FairLine
from worker.generation.pacing import Allowance, Pace
from worker.generation.params import MAX_NEW_TOKENS
from worker.generation.sequence import Options, Sequence_
from worker.generation.text import Detokenizer
from worker.generation.turns import RowTurns

log = logging.getLogger(__name__)

#: Prompt tokens prefilled in one step: a bound on a pass's activations, on how long the
#: running rows wait for newcomers (paged, `pacing` bounds that more tightly while rows
#: decode; left-padded, a step's first prompt goes however long), and on the first tokens
#: of short prompts behind long ones. vLLM's serving defaults for chunked prefill (not
#: tuned here; docs/worker.md has what 4,096 did instead on this CPU): 2,048, and 8,192 on
#: a GPU of 70 GiB or more other than an A100 (`prefill_tokens`).
PREFILL_TOKENS = 2048
PREFILL_TOKENS_LARGE_GPU = 8192
#: A prefill pass holds prompts of similar lengths: its padded size stays within this
#: multiple of its real tokens (so at most a quarter of the pass is padding).
PADDING = 1.25


class Engine(RowTurns):
    """The running batch of one model (see the module). Not thread-safe: one thread steps it."""

    def __init__(  # noqa: PLR0917 - what one batch needs
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        budget: int,
        window: int | None,
        max_rows: int = 64,
        eos: frozenset[int] = frozenset(),
        merge_prefill: bool | None = None,
        prefill_tokens: int | None = None,
        kv: paged.Paged | None = None,
        paged_cache: bool = True,
        pace: Pace | None = None,
        graphs: bool | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.budget = budget
        self.window = window
        self.eos = eos
        self.max_rows = max_rows
        # On a GPU a pass of a model this engine serves is mostly kernel launches, so
        # padding costs little next to another pass; on a CPU it is compute.
        self.merge_prefill = device.type == "cuda" if merge_prefill is None else merge_prefill
        if prefill_tokens is not None and prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be at least 1, got {prefill_tokens}")
        self.prefill_tokens = prefill_tokens or default_prefill_tokens(device)
        # Told after a step's prefill, before its decode: newcomers' first tokens can go
        # out a decode step sooner (a stream's writer flushes here).
        self.after_prefill: Callable[[], None] | None = None
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        # transformers 5.2x renamed the forward's `past_key_values` to `cache`
        named = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in named else "past_key_values"
        # A prompt's pass needs the logits of its last position only, not [rows, width,
        # vocabulary] of them (600 MB for 2,048 tokens of a 150k vocabulary).
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in named else {}
        self.waiting: list[Sequence_] = []  # in their fair order (`line`)
        self.adapters: AdapterRoom | None = None  # its replica's LoRA slots, if it has any
        self._unstepped: list[Sequence_] = []  # added since the last step began
        self.line = FairLine()  # the waiting sequences' tags
        self.rows: list[Sequence_] = []
        # Paged: admitted sequences whose prompt is not all prefilled yet, oldest first; and
        # the keys of the full blocks their prefills have still to write (`_admit`)
        self.prefilling: list[Sequence_] = []
        self._pending: dict[bytes, Sequence_] = {}
        self.pace = pace if pace is not None else Pace()  # a step's prefill beside decoding
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [rows, width]: 1 where a row has a token
        self._seen: torch.Tensor | None = None  # [rows, vocab]: tokens each row has had
        self._columns: sampling.Columns | None = None
        self._merges = slots.supported(model)  # rows share one cache; else one at a time
        # Full-attention rows keep their keys and values in blocks (`paged`), unless the
        # caller asks for the left-padded batch (the engine before paging, for comparison).
        self.kv: paged.Paged | None = None
        if self._merges and paged_cache:
            self.kv = kv if kv is not None else paged.Paged.for_model(model, budget)
            # A replica's blocks outlive its engines: one that failed mid-step left its
            # rows' blocks held, and no other engine holds any now (the replica's lock).
            self.kv.pool.unhold_all()
        # Decode steps read a prefix every row shares once, not once a row (`paged.cascade`).
        self._cascade = self.kv is not None and paged.use_cascade(model)
        self._shared = 0  # blocks the rows' last decode step read once for all (`cascade`)
        # Paged decode steps in fixed shapes, replayed from CUDA graphs (`graphs`; None:
        # on CUDA); elsewhere the same padded steps run as they are when asked (what tests
        # check). Only on SDPA attention, as `cascade`.
        if graphs is None:
            graphs = device.type == "cuda"
        self._graphs: DecodeGraphs | None = None
        if graphs and self._cascade and self.kv is not None:
            self._graphs = self._kept_graphs(self.kv, max_rows)
        self._slots: torch.Tensor | None = None  # [rows, width]: each column's KV slot
        # On a CPU, the running rows kept padded in place too while the budget's unused
        # room holds them, so that a decode step gathers nothing (`_copy_fits`).
        self._copy: Any = None
        self.peak_tokens = 0  # the most cache positions the buffers held room for at once
        self.steps = 0
        self.preemptions = 0  # rows taken out of the batch (for want of blocks, or turns)
        self.handovers = 0  # of them, rows handed over to calls holding fewer
        self.handed: set[Sequence_] = set()  # sequences heading the line by a hand-over
        self.decoded_rows = 0  # rows summed over decode steps (their mean is this / steps)
        self.decode_steps = 0

    # --- what callers do --------------------------------------------------------------

    def add(self, sequence: Sequence_) -> None:
        """Queue a sequence; PayloadError when it could never run on this replica."""
        self.check(sequence)
        sequence.text = Detokenizer(self.tokenizer, sequence.options.stop)
        if sequence.options.choice.greedy:
            sequence.generator = None
        else:
            seed = sequence.options.seed
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little") >> 1
            sequence.generator = sampling.generator_for(seed, self.device)
        self._unstepped.append(sequence)
        self.line.add(self.waiting, sequence)

    def room(self, prompt: int) -> int:
        """The most tokens a prompt of `prompt` tokens may make here: what the model's
        window and this replica's KV budget hold, up to `MAX_NEW_TOKENS` (at least 1, so
        that `check` says why a prompt that leaves none cannot run)."""
        budget = self.budget
        if self.kv is not None:  # the budget's whole blocks, less the null block
            budget = min(budget, (self.kv.pool.budget - 1) * self.kv.pool.size)
        held = min(budget, self.window if self.window is not None else budget)
        return max(1, min(MAX_NEW_TOKENS, held - prompt))

    def check(self, sequence: Sequence_) -> None:
        """PayloadError when `sequence` could never run on this replica."""
        reach = sequence.reach
        if self.window is not None and reach > self.window:
            raise PayloadError(
                f"the prompt is {len(sequence.prompt)} tokens and max_new_tokens is"
                f" {sequence.options.max_new_tokens}, but the model holds {self.window}"
                " positions; shorten the prompt or lower max_new_tokens"
            )
        if reach > self.budget:
            raise PayloadError(
                f"the prompt is {len(sequence.prompt)} tokens and max_new_tokens is"
                f" {sequence.options.max_new_tokens}, over this model's KV-cache budget of"
                f" {self.budget} tokens; shorten the prompt, lower max_new_tokens, or raise"
                " the model's kv_cache in the catalog"
            )
        if self.kv is not None and blocks.blocks_for(reach) > self.kv.pool.budget - 1:
            held = (self.kv.pool.budget - 1) * self.kv.pool.size
            raise PayloadError(
                f"the prompt is {len(sequence.prompt)} tokens and max_new_tokens is"
                f" {sequence.options.max_new_tokens}, over the {held} tokens this model's"
                f" KV-cache budget of {self.budget} holds in blocks of {self.kv.pool.size};"
                " shorten the prompt, lower max_new_tokens, or raise the model's kv_cache"
            )
        if not sequence.prompt:
            raise PayloadError("the prompt encodes to no tokens; send a non-empty prompt")

    def cancel(self, key: Hashable) -> None:
        """Stop a sequence at the next step (waiting, prefilling or running); it ends
        "cancelled"."""
        for sequence in (*self.waiting, *self.prefilling, *self.rows):
            if sequence.key == key:
                sequence.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.rows)

    @property
    def held_tokens(self) -> int:
        """Cache positions the running rows take now: their blocks' slots when paged,
        else rows x width, padding included."""
        if self.kv is not None:
            return self.kv.pool.in_use * self.kv.pool.size
        return 0 if self._mask is None else int(self._mask.numel())

    @property
    def capacity_tokens(self) -> int:
        """Cache positions the buffers hold room for (at most the budget; paged, the
        store's blocks, cached prefixes included)."""
        if self.kv is not None:
            return self.kv.store.blocks * self.kv.pool.size
        if self._cache is None:
            return 0
        if self._merges:
            return int(self._cache.layers[0].capacity())
        return self.held_tokens

    def kv_stats(self) -> dict[str, float]:
        """The paged cache's blocks in use, cached and free, and its prefix hit rate
        (empty for a left-padded engine)."""
        return self.kv.pool.stats() if self.kv is not None else {}

    def step(self) -> list[Sequence_]:
        """Admit what fits, decode one token for every row, and return the sequences that
        ended in this step (done, cancelled or failed)."""
        began = time.monotonic()
        for sequence in self._unstepped:
            sequence.stepped = began
        self._unstepped = []
        with torch.inference_mode(), _on(self.device), _attention_kernels(self.device):
            ended = self._drop_cancelled()
            self.line.settle(self.waiting, self.handed)
            chunks = self._admit()
            if chunks:
                joined = self._prefill(chunks)
                ended += self._leave()
                if joined and self.after_prefill is not None:
                    self.after_prefill()
            if self.rows:
                self._decode()
                ended += self._leave()
        self.steps += 1
        return ended

    def run(self) -> None:
        """Step until every sequence added has ended (what a one-shot caller wants)."""
        while self.busy:
            self.step()

    # --- inside a step ----------------------------------------------------------------

    def _drop_cancelled(self) -> list[Sequence_]:
        now = time.monotonic()
        for sequence in (*self.waiting, *self.prefilling, *self.rows):
            if sequence.deadline is not None and now >= sequence.deadline:
                sequence.cancelled = True
        ended = [s for s in self.waiting if s.cancelled]
        for sequence in ended:
            self.line.drop(sequence)
            self.handed.discard(sequence)
        self.waiting = [s for s in self.waiting if not s.cancelled]
        stopped = [s for s in self.prefilling if s.cancelled]  # their blocks go back
        for sequence in stopped:
            assert self.kv is not None and sequence.table is not None
            self._unpend(sequence)
            self.kv.pool.release(sequence.table.blocks)
            sequence.table = None
        self.prefilling = [s for s in self.prefilling if not s.cancelled]
        ended += stopped
        for sequence in ended:
            sequence.finish = "cancelled"
            if sequence.text is not None and sequence.tokens:  # preempted, then cancelled
                sequence.text.finish(sequence.tokens)
        for sequence in self.rows:
            if sequence.cancelled:
                sequence.finish = "cancelled"
                if sequence.text is not None:
                    sequence.text.finish(sequence.tokens)
        return ended + self._leave()

    def _admit(self) -> list[tuple[Sequence_, int]]:
        """This step's prefill, as (sequence, prompt tokens it computes now): chunks of the
        prompts being prefilled, oldest first, within the step's pace (`_allowance`); then the
        waiting sequences that fit now, in their fair order (none jumps the queue): a
        prompt the pace holds whole, at once (a call never waits a step for others' short
        prompts), up to `prefill_tokens` in the step; a longer one, a chunk of what is left
        of the pace. Left-padded, whole prompts (`_admit_whole`)."""
        if self.kv is None:
            return [(s, len(s.prompt)) for s in self._admit_whole()]
        self._hand_over()  # rows of the call holding the most, to calls waiting with fewer
        self.line.settle(self.waiting, self.handed)  # its victims in their places
        pool = self.kv.pool
        allowance = self._allowance()
        total = 0  # the step's prompt tokens
        chunks: list[tuple[Sequence_, int]] = []
        for sequence in self.prefilling:
            assert sequence.table is not None
            todo = min(self._todo(sequence), self.prefill_tokens - total)
            granted = allowance.chunk(todo, sequence.table.length) if todo > 0 else 0
            if not granted:
                break
            allowance.spend(granted, sequence.table.length)
            chunks.append((sequence, granted))
            total += granted
        admitted: list[Sequence_] = []
        count = len(self.rows) + len(self.prefilling)
        spare = pool.available - self._next_blocks()  # kept for the rows' next tokens
        self._hold_back()  # the working copy's room, from the store's growth
        while len(admitted) < len(self.waiting) and count < self.max_rows:
            head = self.waiting[len(admitted)]
            context = head.context()
            # a token at least is computed
            prefix = pool.match(context, len(context) - 1, head.salt)
            past = len(prefix[0]) * pool.size
            todo = len(context) - past
            whole = allowance.holds(todo, past)  # a prompt a step holds starts whole at once
            if whole and chunks and total + todo > self.prefill_tokens:
                break
            room = self.prefill_tokens - total
            granted = todo if whole else allowance.chunk(min(todo, room), past) if room > 0 else 0
            if not granted:
                break
            if self._written_by_another(context, prefix):
                break  # it begins as one being prefilled does: it reads that once written
            taken = self._blocks_for(head, prefix, spare)
            if taken is None:
                break
            spare -= taken
            self._pend(head, context)
            admitted.append(head)
            allowance.spend(granted, past)
            chunks.append((head, granted))
            total += granted
            count += 1
        self._leave_queue(admitted)
        self.prefilling += admitted
        return chunks

    def _allowance(self) -> Allowance:
        """What this step prefills (paged): the engine's bound while no row decodes, else
        what one decode step's time allows (`worker.generation.pacing`)."""
        if not self.rows:
            return Allowance(self.prefill_tokens, None)
        building = min(self.max_rows, len(self.rows) + len(self.prefilling) + len(self.waiting))
        return self.pace.step(
            self.prefill_tokens, len(self.rows), building, launch_bound=self.merge_prefill
        )

    def _admit_whole(self) -> list[Sequence_]:
        """Left-padded: the waiting sequences that fit now, in their fair order, with at
        most `prefill_tokens` of prompts in one step (the first goes however long)."""
        admitted: list[Sequence_] = []
        reach = max((s.reach for s in self.rows), default=0)
        count = len(self.rows)
        prompts = 0
        while len(admitted) < len(self.waiting) and count < (self.max_rows if self._merges else 1):
            head = self.waiting[len(admitted)]
            wider = max(reach, head.reach)
            if (count + 1) * wider > self.budget:
                break
            if admitted and prompts + len(head.prompt) > self.prefill_tokens:
                break
            admitted.append(head)
            reach, count = wider, count + 1
            prompts += len(head.prompt)
        self._leave_queue(admitted)
        return admitted

    def _leave_queue(self, admitted: list[Sequence_]) -> None:
        """The waiting line's head, `admitted`, leaves it."""
        del self.waiting[: len(admitted)]
        now = time.monotonic()
        for sequence in admitted:
            handed = sequence in self.handed  # out of its fair order (`turns`)
            self.handed.discard(sequence)
            self.line.leave(sequence, in_turn=not handed)
            if sequence.admitted is None:
                sequence.admitted = now

    def _prefill(self, chunks: list[tuple[Sequence_, int]]) -> int:
        """Prefill this step's chunks in passes, shortest first: of similar lengths (at most
        PADDING of a pass padding) where compute is what a pass costs, or as few passes of
        up to `prefill_tokens` padded tokens as hold them where launching a pass is
        (`merge_prefill`). How many sequences joined the rows."""
        joined = 0
        group: list[tuple[Sequence_, int]] = []
        for chunk in sorted(chunks, key=lambda c: c[1]):
            padded = (len(group) + 1) * chunk[1]
            if self.merge_prefill:
                full = padded > self.prefill_tokens
            else:
                full = padded > PADDING * sum(n for _, n in (*group, chunk))
            if group and full:
                joined += self._prefill_group(group)
                group = []
            group.append(chunk)
        if group:
            joined += self._prefill_group(group)
        return joined

    def _prefill_group(self, chunks: list[tuple[Sequence_, int]]) -> int:
        """One pass over prompts (or the next chunk of each), left-padded to the longest
        (as `generate` does); the sequences whose prompt is then all in join the batch
        with their first tokens (how many is returned). A pass of several prompts that
        runs out of device memory runs again in two halves (nothing joined the batch yet,
        no token was drawn), and this engine's later steps take at most half that pass's
        padded tokens; one prompt that does not fit alone raises, as any error of the
        model does. Paged, each prompt's cached prefix (and chunks before) is read from
        its blocks and only the rest is computed; a resumed sequence (preempted) gets no
        new token."""
        sequences = [s for s, _ in chunks]
        width = max(n for _, n in chunks)
        past = max((s.table.length for s in sequences if s.table is not None), default=0)
        started = time.perf_counter()
        try:
            with self._adapted(sequences):
                if self.kv is not None:
                    out, mask = self._forward_paged(chunks), None
                else:
                    out, mask = self._forward_padded(sequences)
        except torch.OutOfMemoryError:
            if len(chunks) == 1:
                raise
            out = None  # split below, once the error (and the frames it holds) is gone
        if out is None:  # the allocator freed its cached blocks before it raised
            half = len(chunks) // 2
            self.prefill_tokens = max(1, min(self.prefill_tokens, len(chunks) * width // 2))
            log.warning(
                "a prefill pass of %d prompts (%d tokens wide) ran out of memory; running"
                " it as two passes, and later steps take at most %d prompt tokens",
                len(chunks), width, self.prefill_tokens,
            )  # fmt: skip
            return self._prefill_group(chunks[:half]) + self._prefill_group(chunks[half:])
        if self.kv is not None:  # only a paged engine paces its prefill
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the pass's own time, for its pace
            seconds = time.perf_counter() - started
            self.pace.prefilled(len(chunks) * width, seconds, past + width)
        done = [
            row for row, s in enumerate(sequences)
            if s.table is None or s.table.length == len(s.context())
        ]  # fmt: skip
        if not done:
            return 0
        joining = [sequences[row] for row in done]
        seen = torch.zeros((len(joining), self.vocab), dtype=torch.bool, device=self.device)
        for row, sequence in enumerate(joining):  # its own tokens, not the padding's
            had = sequence.prompt + sequence.tokens
            seen[row, torch.tensor(had, device=self.device)] = True
        fresh = [row for row, s in enumerate(joining) if not s.resumed]
        first: list[int] = []
        if fresh:
            picking = [joining[row] for row in fresh]
            columns = sampling.Columns([s.options.choice for s in picking], self.device)
            logits = out.logits[:, -1, :]
            rows = [done[row] for row in fresh]
            if len(rows) < len(sequences):
                logits = logits[torch.tensor(rows, device=self.device)]
            first = sampling.pick(logits, columns, seen[fresh], [s.generator for s in picking])
        if self.kv is not None:
            for sequence in joining:
                self._unpend(sequence)
            self.prefilling = [s for s in self.prefilling if s not in joining]
            self._join_paged(joining, seen)
        else:
            assert mask is not None
            self._join(joining, _cache_of(out), mask, seen)
        for row, token in zip(fresh, first, strict=True):
            self._take(joining[row], token)
        for sequence in joining:
            sequence.resumed = False
        return len(joining)

    def _forward_padded(self, sequences: list[Sequence_]) -> tuple[Any, torch.Tensor]:
        """The pass over left-padded prompts, keeping their cache; and its mask."""
        width = max(len(s.prompt) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, width - len(sequence.prompt) :] = torch.tensor(sequence.prompt)
            mask[row, width - len(sequence.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return self._forward_prompts(ids, mask, positions), mask

    def _join(
        self, sequences: list[Sequence_], cache: Any, mask: torch.Tensor, seen: torch.Tensor
    ) -> None:
        """Add prefilled rows to the batch, left-padding whichever side is narrower."""
        if self._cache is None or self._mask is None or self._seen is None:
            self._cache = slots.from_prefill(cache, self.budget) if self._merges else cache
            self._mask, self._seen = mask, seen
        else:
            width, length = self._mask.shape[1], mask.shape[1]
            for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
                mine.join(theirs.keys, theirs.values)
            if length < width:
                mask = torch.nn.functional.pad(mask, (width - length, 0))
            elif width < length:
                self._mask = torch.nn.functional.pad(self._mask, (length - width, 0))
            self._mask = torch.cat([self._mask, mask], dim=0)
            self._seen = torch.cat([self._seen, seen], dim=0)
        self.rows.extend(sequences)
        self._columns = None

    def _decode(self) -> None:
        started = time.perf_counter()
        if self.kv is not None and not self._grow_rows():
            return  # every row was preempted (their blocks went to older rows)
        assert self._mask is not None and self._seen is not None
        rows = self.rows
        self.decoded_rows += len(rows)
        self.decode_steps += 1
        ids = torch.tensor([[s.tokens[-1]] for s in rows], dtype=torch.long, device=self.device)
        with self._adapted(rows):
            if self.kv is not None:
                logits = self._decode_paged(ids)
            else:
                positions = self._mask.sum(dim=1, keepdim=True)
                self._mask = torch.nn.functional.pad(self._mask, (0, 1), value=1)
                out = self.model(
                    input_ids=ids,
                    attention_mask=self._mask,
                    position_ids=positions,
                    use_cache=True,
                    **{self._cache_arg: self._cache},
                )
                logits = out.logits[:, -1, :]
                if not self._merges:
                    self._cache = _cache_of(out)  # a plain cache grows by concatenation
        self._seen.scatter_(1, ids, True)
        if self._columns is None:
            self._columns = sampling.Columns([s.options.choice for s in rows], self.device)
        picked = sampling.pick(
            logits, self._columns, self._seen, [s.generator for s in rows]
        )  # read back to the host: the step's work is done
        self.pace.decoded(time.perf_counter() - started)
        self.peak_tokens = max(self.peak_tokens, self.capacity_tokens)
        for sequence, token in zip(rows, picked, strict=True):
            self._take(sequence, token)

    def _adapted(self, rows: list[Sequence_]) -> AbstractContextManager[Any]:
        """A pass over `rows` with each row's adapter (`worker.adapters.room`)."""
        if self.adapters is None:
            return nullcontext()
        return self.adapters.rows([s.adapter for s in rows])

    def _take(self, sequence: Sequence_, token: int) -> None:
        """Append a sampled token and decide whether the sequence is done."""
        if sequence.first_token is None:
            sequence.first_token = time.monotonic()
        sequence.tokens.append(token)
        text = sequence.text
        assert text is not None
        text.update(sequence.tokens)
        if token in self.eos or text.stopped:
            sequence.finish = "stop"
        elif len(sequence.tokens) >= sequence.options.max_new_tokens:
            sequence.finish = "length"
        if sequence.done:
            text.finish(sequence.tokens)
        if sequence.on_text is not None:
            chunk = text.delta(final=sequence.done)
            if chunk:
                sequence.on_text(chunk)

    def _leave(self) -> list[Sequence_]:
        """Take the rows that are done out of the batch (the last rows fill their places,
        so only those move), and the columns nobody needs."""
        ended = [s for s in self.rows if s.done]
        if not ended:
            return []
        if self.kv is not None:
            for sequence in ended:
                assert sequence.table is not None
                self.kv.pool.release(sequence.table.blocks)
                sequence.table = None
            self._keep_rows([i for i, s in enumerate(self.rows) if not s.done])
            return ended
        count = len(self.rows) - len(ended)
        self._columns = None
        if not count:
            self.rows = []
            self._cache = self._mask = self._seen = None
            return ended
        holes = [i for i in range(count) if self.rows[i].done]
        tail = [i for i in range(count, len(self.rows)) if not self.rows[i].done]
        order = list(range(count))
        for hole, source in zip(holes, tail, strict=True):
            order[hole] = source
        self.rows = [self.rows[i] for i in order]
        assert self._mask is not None and self._seen is not None
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self._mask = self._mask.index_select(0, index)
        self._seen = self._seen.index_select(0, index)
        cut = int(self._mask.any(dim=0).nonzero()[0])  # columns of padding only
        self._mask = self._mask[:, cut:]
        if self._merges:
            for layer in self._cache.layers:
                layer.keep(order, cut)
        return ended


def default_prefill_tokens(device: torch.device) -> int:
    """vLLM's rule for its serving default: more prompt tokens a step on a large GPU, where
    a pass of that many costs little more than launching it (its authors found larger
    steps slowed an A100, so it keeps the smaller value there)."""
    if device.type != "cuda":
        return PREFILL_TOKENS
    properties = torch.cuda.get_device_properties(device)
    large = properties.total_memory >= 70 * 2**30 and "a100" not in properties.name.lower()
    return PREFILL_TOKENS_LARGE_GPU if large else PREFILL_TOKENS


def _on(device: torch.device) -> AbstractContextManager[Any]:
    """On CUDA, `device` as the current one: a process may step engines on several GPUs in
    turn (`worker.session`). Elsewhere, nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _attention_kernels(device: torch.device) -> AbstractContextManager[Any]:
    """On CUDA, scaled-dot-product attention without its cuDNN kernel: cuDNN builds a plan
    for each new shape, and a decode step's keys grow by one position every step (on an
    H200 the first steps of GPT-2 small took 76 ms each, against 11 ms once shapes
    repeat). Elsewhere, as torch chooses."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a generation: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    sources = (getattr(model, "generation_config", None), getattr(model, "config", None))
    for value in (tokenizer.eos_token_id, *(getattr(s, "eos_token_id", None) for s in sources)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


__all__ = ["Engine", "Options", "Sequence_", "default_prefill_tokens", "eos_ids"]
