"""Continuous batching for one causal language model: calls share decode steps.

An `Engine` holds one replica's running sequences as the rows of one batch. Each `step`
first admits waiting sequences (their prompts prefilled in one left-padded pass, as
`generate` prefills a batch), then runs one decode step for every row at once, then lets
the rows that are done leave. A sequence joins at the next step and leaves when it is done:
a short call never waits for a long one.

The batch's KV cache is transformers' `DynamicCache`, with rows of different lengths
left-padded inside it: a joining row's keys and values are padded on the left to the
batch's width (or the batch to the row's), and the attention mask and explicit position ids
keep the padding out of the arithmetic, as `generate` does for a left-padded batch. When
rows leave, the columns no row needs any more are cut off. Models whose cache is not plain
full attention (sliding windows, linear attention) run one row at a time.

Memory: the engine never holds more than `budget` tokens of cache. A padded batch of `r`
rows takes `r x` the longest row's reach (prompt plus max_new_tokens) at most, so a sequence
is admitted only while that bound stays within the budget; the others wait. A sequence that
could never fit (longer than the model's window or the whole budget) is refused when it is
added.

Fairness: waiting sequences are admitted in start-time fair queueing order (Goyal et al.,
SIGCOMM 1996), each call a flow (a sequence's key is `(call, prompt index)`) and a
sequence's cost its reach. A call's first sequence starts at the engine's virtual time (the
start tag of the last one admitted), and each further one after its call's previous
finish. So a call of 64 prompts gets its share of rows, not all of them ahead of a call that
arrives after it: the newcomer's sequence is admitted at the next free row. Calls that
arrive together keep their order (ties go to the first added), and within a call the
prompts keep theirs.
"""

from __future__ import annotations

import bisect
import inspect
import itertools
import logging
import os
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from placement.errors import PayloadError
from worker.generation import blocks, paged, sampling, slots
from worker.generation.params import MAX_NEW_TOKENS
from worker.generation.text import Detokenizer

log = logging.getLogger(__name__)

#: Prompt tokens prefilled in one step (its first prompt always goes): a bound on how long the
#: running rows wait for newcomers, and on the first tokens of short prompts behind long
#: ones. vLLM's serving defaults for chunked prefill (not tuned here; docs/worker.md has
#: what 4,096 did instead on this CPU): 2,048, and 8,192 on a GPU of 70 GiB or more other
#: than an A100 (`prefill_tokens`).
PREFILL_TOKENS = 2048
PREFILL_TOKENS_LARGE_GPU = 8192
#: A prefill pass holds prompts of similar lengths: its padded size stays within this
#: multiple of its real tokens (so at most a quarter of the pass is padding).
PADDING = 1.25


@dataclass(frozen=True)
class Options:
    """A sequence's generation parameters (`worker.generation.params`), checked."""

    max_new_tokens: int = 16
    choice: sampling.Choice = field(default_factory=sampling.Choice)
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Options:
        return cls(
            max_new_tokens=params["max_new_tokens"],
            choice=sampling.Choice(
                temperature=params["temperature"],
                top_k=params["top_k"],
                top_p=params["top_p"],
                repetition_penalty=params["repetition_penalty"],
            ),
            stop=tuple(params["stop"]),
            seed=params["seed"],
        )


@dataclass(eq=False)
class Sequence_:
    """One prompt being continued. `on_text` gets the streamable text as it grows."""

    key: Hashable
    prompt: list[int]
    options: Options
    on_text: Callable[[str], None] | None = None
    deadline: float | None = None  # time.monotonic() after which it is cancelled
    tokens: list[int] = field(default_factory=list)
    finish: str = ""  # "stop", "length" or "cancelled" once done
    cancelled: bool = False
    first_token: float | None = None  # when its first token was made
    text: Detokenizer | None = None
    generator: torch.Generator | None = None
    tag: tuple[float, int] = (0.0, 0)  # its place in the fair queue: start tag, then order
    table: blocks.Table | None = None  # its KV blocks, while admitted (a paged engine)
    resumed: bool = False  # preempted, to be prefilled again with the tokens it made

    def context(self) -> list[int]:
        """The tokens whose keys and values it holds once admitted (the last token made
        is fed by the next decode step)."""
        return self.prompt + self.tokens[:-1] if self.tokens else self.prompt

    @property
    def flow(self) -> Hashable:
        """The call the sequence belongs to (fairness is between calls)."""
        return self.key[0] if isinstance(self.key, tuple) and self.key else self.key

    @property
    def reach(self) -> int:
        """The most cache positions it can take: its prompt and every token it may make."""
        return len(self.prompt) + self.options.max_new_tokens

    @property
    def done(self) -> bool:
        return bool(self.finish)


class Engine:
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
        self.waiting: list[Sequence_] = []  # in their fair order (the module)
        self._virtual = 0.0  # the start tag of the last sequence admitted
        self._finishes: dict[Hashable, tuple[float, int]] = {}  # flow -> last finish, waiting
        self._order = itertools.count()
        self.rows: list[Sequence_] = []
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
        self._slots: torch.Tensor | None = None  # [rows, width]: each column's KV slot
        # On a CPU, the running rows kept padded in place too while the budget's unused
        # room holds them, so that a decode step gathers nothing (`_copy_fits`).
        self._copy: Any = None
        self.peak_tokens = 0  # the most cache positions the buffers held room for at once
        self.steps = 0
        self.preemptions = 0  # rows taken out of the batch for want of blocks
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
        flow = sequence.flow
        last, queued = self._finishes.get(flow, (0.0, 0))
        start = max(self._virtual, last)
        self._finishes[flow] = (start + sequence.reach, queued + 1)
        sequence.tag = (start, next(self._order))
        bisect.insort(self.waiting, sequence, key=lambda s: s.tag)

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
        """Stop a sequence at the next step (waiting or running); it ends "cancelled"."""
        for sequence in (*self.waiting, *self.rows):
            if sequence.key == key:
                sequence.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.rows)

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
        return self.kv.stats() if self.kv is not None else {}

    def step(self) -> list[Sequence_]:
        """Admit what fits, decode one token for every row, and return the sequences that
        ended in this step (done, cancelled or failed)."""
        with torch.inference_mode(), _on(self.device), _attention_kernels(self.device):
            ended = self._drop_cancelled()
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
                ended += self._leave()
                if self.after_prefill is not None:
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
        for sequence in (*self.waiting, *self.rows):
            if sequence.deadline is not None and now >= sequence.deadline:
                sequence.cancelled = True
        ended = [s for s in self.waiting if s.cancelled]
        for sequence in ended:
            sequence.finish = "cancelled"
            if sequence.text is not None and sequence.tokens:  # preempted, then cancelled
                sequence.text.finish(sequence.tokens)
            self._dequeued(sequence)
        self.waiting = [s for s in self.waiting if not s.cancelled]
        for sequence in self.rows:
            if sequence.cancelled:
                sequence.finish = "cancelled"
                if sequence.text is not None:
                    sequence.text.finish(sequence.tokens)
        return ended + self._leave()

    def _admit(self) -> list[Sequence_]:
        """The waiting sequences that fit now, in their fair order (none jumps the queue),
        with at most `prefill_tokens` of prompts in one step (the first goes however long)."""
        admitted: list[Sequence_] = []
        reach = max((s.reach for s in self.rows), default=0)
        count = len(self.rows)
        prompts = 0
        # Paged: blocks the running rows take at their next token, kept for them.
        spare = 0 if self.kv is None else self.kv.pool.available - self._next_blocks()
        computing: set[bytes] = set()  # first blocks this step's prefill computes
        while len(admitted) < len(self.waiting) and count < (self.max_rows if self._merges else 1):
            head = self.waiting[len(admitted)]
            wider = max(reach, head.reach)
            if self.kv is None and (count + 1) * wider > self.budget:
                break
            computed = len(head.prompt)
            if self.kv is not None:  # what its cached prefix leaves to compute
                computed = len(head.context()) - self._cached_tokens(head)
                first = self._first_block(head) if computed == len(head.context()) else None
                if first is not None and first in computing:
                    break  # it begins as one prefilled now does: next step it reads that
                if first is not None:
                    computing.add(first)
            if admitted and prompts + computed > self.prefill_tokens:
                break
            if self.kv is not None:
                taken = self._blocks_for(head, spare)
                if taken is None:
                    break
                spare -= taken
            admitted.append(head)
            reach, count = wider, count + 1
            prompts += computed
        del self.waiting[: len(admitted)]
        for sequence in admitted:
            self._virtual = max(self._virtual, sequence.tag[0])
            self._dequeued(sequence)
        return admitted

    def _dequeued(self, sequence: Sequence_) -> None:
        """A sequence left the queue: its flow's entry goes once none of it waits."""
        last, queued = self._finishes[sequence.flow]
        if queued > 1:
            self._finishes[sequence.flow] = (last, queued - 1)
        else:
            del self._finishes[sequence.flow]

    def _prefill(self, admitted: list[Sequence_]) -> None:
        """Prefill the new prompts in passes, shortest first: of similar lengths (at most
        PADDING of a pass padding) where compute is what a pass costs, or as few passes of
        up to `prefill_tokens` padded tokens as hold them where launching a pass is
        (`merge_prefill`)."""
        group: list[Sequence_] = []
        for sequence in sorted(admitted, key=self._todo):
            padded = (len(group) + 1) * self._todo(sequence)
            if self.merge_prefill:
                full = padded > self.prefill_tokens
            else:
                full = padded > PADDING * sum(self._todo(s) for s in (*group, sequence))
            if group and full:
                self._prefill_group(group)
                group = []
            group.append(sequence)
        if group:
            self._prefill_group(group)

    def _prefill_group(self, sequences: list[Sequence_]) -> None:
        """One pass over prompts, left-padded to the longest (as `generate` does), then
        their rows join the batch with their first tokens. A pass of several prompts that
        runs out of device memory runs again in two halves (nothing joined the batch yet,
        no token was drawn), and this engine's later steps take at most half that pass's
        padded tokens; one prompt that does not fit alone raises, as any error of the
        model does. Paged, each prompt's cached prefix is read from its blocks and only
        the rest is computed; a resumed sequence (preempted) gets no new token."""
        try:
            if self.kv is not None:
                out, mask = self._forward_paged(sequences), None
            else:
                out, mask = self._forward_padded(sequences)
        except torch.OutOfMemoryError:
            if len(sequences) == 1:
                raise
            out = None  # split below, once the error (and the frames it holds) is gone
        if out is None:  # the allocator freed its cached blocks before it raised
            half = len(sequences) // 2
            width = max(self._todo(s) for s in sequences)
            self.prefill_tokens = max(1, min(self.prefill_tokens, len(sequences) * width // 2))
            log.warning(
                "a prefill pass of %d prompts (%d tokens wide) ran out of memory; running"
                " it as two passes, and later steps take at most %d prompt tokens",
                len(sequences), width, self.prefill_tokens,
            )  # fmt: skip
            self._prefill_group(sequences[:half])
            self._prefill_group(sequences[half:])
            return
        seen = torch.zeros((len(sequences), self.vocab), dtype=torch.bool, device=self.device)
        for row, sequence in enumerate(sequences):  # its own tokens, not the padding's
            had = sequence.prompt + sequence.tokens
            seen[row, torch.tensor(had, device=self.device)] = True
        fresh = [row for row, s in enumerate(sequences) if not s.resumed]
        first: list[int] = []
        if fresh:
            picking = [sequences[row] for row in fresh]
            columns = sampling.Columns([s.options.choice for s in picking], self.device)
            logits = out.logits[:, -1, :]
            if len(fresh) < len(sequences):
                logits = logits[torch.tensor(fresh, device=self.device)]
            first = sampling.pick(logits, columns, seen[fresh], [s.generator for s in picking])
        if self.kv is not None:
            self._join_paged(sequences, seen)
        else:
            assert mask is not None
            self._join(sequences, _cache_of(out), mask, seen)
        for row, token in zip(fresh, first, strict=True):
            self._take(sequences[row], token)
        for sequence in sequences:
            sequence.resumed = False

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

    def _forward_prompts(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any = None
    ) -> Any:
        """The model's pass over left-padded prompts, keeping their cache (in `cache`, the
        paged one, when given)."""
        given = {self._cache_arg: cache} if cache is not None else {}
        return self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
            **given, **self._last_logits,
        )  # fmt: skip

    # --- the paged cache ----------------------------------------------------------------

    def _todo(self, sequence: Sequence_) -> int:
        """Tokens its prefill computes: its context, less what cached blocks hold."""
        held = sequence.table.length if sequence.table is not None else 0
        return len(sequence.context()) - held

    def _first_block(self, sequence: Sequence_) -> bytes | None:
        """The key its first block will have, if its context fills one and goes beyond it."""
        assert self.kv is not None
        size, context = self.kv.pool.size, sequence.context()
        return blocks.chain(b"", context[:size]) if len(context) > size else None

    def _cached_tokens(self, sequence: Sequence_) -> int:
        """Tokens of its context that cached blocks hold now."""
        assert self.kv is not None
        context = sequence.context()
        return len(self.kv.pool.match(context, len(context) - 1)[0]) * self.kv.pool.size

    def _next_blocks(self) -> int:
        """Blocks the running rows need for their next token (those whose blocks are full)."""
        assert self.kv is not None
        size = self.kv.pool.size
        return sum(1 for s in self.rows if s.table is not None and s.table.length % size == 0)

    def _blocks_for(self, sequence: Sequence_, spare: int) -> int | None:
        """Admit `sequence` into blocks if what it takes (its context's blocks not cached,
        the cached ones nobody held, and a block for its next token when its last is full)
        is within `spare`: its table then holds its prefix, read from the cache, and room
        for the rest. What it took of `spare`, or None when it does not fit."""
        assert self.kv is not None
        pool = self.kv.pool
        context = sequence.context()
        matched, key = pool.match(context, len(context) - 1)  # one token at least is computed
        whole = blocks.blocks_for(len(context))
        taken = whole - len(matched) + pool.needs(matched)
        taken += 1 if len(context) % pool.size == 0 else 0
        if taken > spare:
            return None
        pool.hold(matched)
        reused = len(matched) * pool.size
        table = blocks.Table(list(matched), reused, len(matched), key, reused)
        table.blocks.extend(pool.take() for _ in range(whole - len(matched)))
        sequence.table = table
        if not sequence.resumed:
            pool.counted(len(sequence.prompt), reused)
        return taken

    def _forward_paged(self, sequences: list[Sequence_]) -> Any:
        """The pass over the admitted sequences' uncached tokens, each row reading its
        cached prefix from its blocks: `[past | new]` columns, each part right-aligned."""
        assert self.kv is not None
        kv = self.kv
        contexts = [s.context() for s in sequences]
        tables = [s.table for s in sequences]
        assert all(t is not None for t in tables)
        past = max(t.length for t in tables if t is not None)
        new = max(len(c) - t.length for c, t in zip(contexts, tables, strict=True) if t)
        rows = len(sequences)
        ids = torch.zeros((rows, new), dtype=torch.long)
        mask = torch.zeros((rows, past + new), dtype=torch.long)
        positions = torch.zeros((rows, new), dtype=torch.long)
        index = torch.zeros((rows, past + new), dtype=torch.long)
        written, slots = [], []
        for row, (context, table) in enumerate(zip(contexts, tables, strict=True)):
            assert table is not None
            held, todo = table.length, len(context) - table.length
            mine = kv.slots(table, 0, len(context))
            index[row, past - held : past] = mine[:held]
            index[row, past + new - todo :] = mine[held:]
            mask[row, past - held : past] = 1
            mask[row, past + new - todo :] = 1
            ids[row, new - todo :] = torch.tensor(context[held:])
            positions[row, new - todo :] = torch.arange(held, len(context))
            written.append(torch.arange(row * new + new - todo, (row + 1) * new))
            slots.append(mine[held:])
        every = torch.cat(written)
        forward = paged.Pass(
            index.to(self.device), past,
            None if every.numel() == rows * new else every.to(self.device),
            torch.cat(slots).to(self.device),
        )  # fmt: skip
        kv.ready()
        if self._copy is not None and not self._copy_fits(len(self.rows), self._copy_width()):
            self._copy = None  # the store grew into its room
        with kv.cache.running(forward) as cache:
            out = self._forward_prompts(
                ids.to(self.device), mask.to(self.device), positions.to(self.device), cache
            )
        for sequence, context in zip(sequences, contexts, strict=True):
            assert sequence.table is not None
            sequence.table.length = len(context)  # written: a pass that raised wrote nothing
            kv.pool.key_full_blocks(sequence.table, context)
        return out

    def _join_paged(self, sequences: list[Sequence_], seen: torch.Tensor) -> None:
        """Add prefilled rows: each row's slots right-aligned, the narrower side padded on
        the left (padding reads the null block, and the mask hides it)."""
        assert self.kv is not None
        lengths = [s.table.length for s in sequences if s.table is not None]
        width = max(lengths)
        index = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            assert sequence.table is not None
            length = sequence.table.length
            index[row, width - length :] = self.kv.slots(sequence.table, 0, length)
            mask[row, width - length :] = 1
        index, mask = index.to(self.device), mask.to(self.device)
        if self._copy is not None:
            assert self._mask is not None
            if self._copy_fits(len(self.rows) + len(sequences), max(width, self._mask.shape[1])):
                for number, layer in enumerate(self._copy.layers):
                    layer.join(*self.kv.cache.gather(number, index))
            else:
                self._copy = None
        if self._slots is None or self._mask is None or self._seen is None:
            self._slots, self._mask, self._seen = index, mask, seen
        else:
            have = self._mask.shape[1]
            if width < have:
                index = torch.nn.functional.pad(index, (have - width, 0))
                mask = torch.nn.functional.pad(mask, (have - width, 0))
            elif have < width:
                self._slots = torch.nn.functional.pad(self._slots, (width - have, 0))
                self._mask = torch.nn.functional.pad(self._mask, (width - have, 0))
            self._slots = torch.cat([self._slots, index], dim=0)
            self._mask = torch.cat([self._mask, mask], dim=0)
            self._seen = torch.cat([self._seen, seen], dim=0)
        self.rows.extend(sequences)
        self._columns = None

    def _grow_rows(self) -> list[Sequence_]:
        """A slot for every row's next token, each a new block when its last is full. When
        no block is left, the youngest row (by its place in the fair queue) is preempted:
        its blocks are given back (the full ones stay cached) and it waits again, ahead of
        every sequence that arrived after it, to be prefilled with the tokens it made.
        Returns the rows that stay, in order."""
        assert self.kv is not None
        pool = self.kv.pool
        for sequence in list(self.rows):
            table = sequence.table
            if table is None:  # preempted for an older row in this loop
                continue
            while sequence in self.rows and table.length == len(table.blocks) * pool.size:
                try:
                    table.blocks.append(pool.take())
                except blocks.OutOfBlocks:
                    self._preempt(max(self.rows, key=lambda s: s.tag))
        return self.rows

    def _preempt(self, sequence: Sequence_) -> None:
        """Take a running row out of the batch and queue it again (`_grow_rows`)."""
        assert self.kv is not None and sequence.table is not None
        log.info(
            "preempted a sequence of %d tokens: the KV budget's blocks are all in use",
            sequence.table.length,
        )
        self.kv.pool.release(sequence.table.blocks)
        self.preemptions += 1
        sequence.table = None
        sequence.resumed = True
        self._keep_rows([i for i, s in enumerate(self.rows) if s is not sequence])
        last, queued = self._finishes.get(sequence.flow, (0.0, 0))
        self._finishes[sequence.flow] = (max(last, sequence.tag[0] + sequence.reach), queued + 1)
        bisect.insort(self.waiting, sequence, key=lambda s: s.tag)

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep the rows `keep` names, in order, and cut the columns of padding only."""
        self._columns = None
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._slots = self._mask = self._seen = self._copy = None
            return
        assert self._slots is not None and self._mask is not None and self._seen is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        cut = int(mask.any(dim=0).nonzero()[0])
        self._mask = mask[:, cut:]
        self._slots = self._slots.index_select(0, index)[:, cut:]
        self._seen = self._seen.index_select(0, index)
        if self._copy is not None:
            for layer in self._copy.layers:
                layer.keep(keep, cut)

    def _decode_paged(self, ids: torch.Tensor) -> Any:
        """One decode step over the blocks: each row's new token (`ids`) written to its
        next slot. When every row begins with the same blocks (a shared system prompt),
        attention reads them once for all rows (`paged.cascade`) and gathers only what
        follows them."""
        assert self.kv is not None and self._slots is not None and self._mask is not None
        kv = self.kv
        rows = self.rows
        size = kv.pool.size
        next_slots = []
        for sequence in rows:
            table = sequence.table
            assert table is not None
            next_slots.append(table.blocks[table.length // size] * size + table.length % size)
        new = torch.tensor(next_slots, dtype=torch.long, device=self.device)
        positions = self._mask.sum(dim=1, keepdim=True)
        index = torch.cat([self._slots, new[:, None]], dim=1)
        mask = torch.nn.functional.pad(self._mask, (0, 1), value=1)
        shared = self._shared_blocks() if self._cascade else 0
        if shared:
            prefix = kv.slots(rows[0].table, 0, shared * size).to(self.device)  # type: ignore[arg-type]
            own = positions[:, 0] - shared * size  # each row's tokens after the prefix
            width = int(own.max())
            columns = torch.arange(width, device=self.device)
            after = (columns[None, :] >= (width - own)[:, None]).long()
            ones = torch.ones((len(rows), 1), dtype=torch.long, device=self.device)
            step_mask = torch.cat([ones.expand(-1, shared * size), after, ones], dim=1)
            step_index = index[:, index.shape[1] - width - 1 :]
            forward = paged.Pass(step_index, shared * size + width, None, new, prefix)
            self._copy = None  # attention reads the prefix once: nothing to gather twice
        else:
            step_mask, forward = mask, paged.Pass(index, self._slots.shape[1], None, new)
        kv.ready()
        copy = None
        if not shared and self._copy_fits(len(rows), index.shape[1]):
            if self._copy is None:  # this step's gather, made once for the steps to come
                self._copy = kv.cache.copy_of(self._slots, self._copy_room())
            copy = self._copy
        else:
            self._copy = None
        with kv.cache.running(forward, copy) as cache:
            out = self.model(
                input_ids=ids, attention_mask=step_mask, position_ids=positions,
                use_cache=True, **{self._cache_arg: cache},
            )  # fmt: skip
        self._slots, self._mask = index, mask
        for sequence in rows:
            table = sequence.table
            assert table is not None
            table.length += 1
            if table.length % size == 0:
                kv.pool.key_full_blocks(table, sequence.prompt + sequence.tokens)
        return out

    def _copy_width(self) -> int:
        return 0 if self._mask is None else int(self._mask.shape[1])

    def _copy_room(self) -> int:
        """Tokens of the budget the store has not taken (nor will by its next growth)."""
        assert self.kv is not None
        return (self.kv.pool.budget - self.kv.store.blocks) * self.kv.pool.size

    def _copy_fits(self, rows: int, width: int) -> bool:
        """Whether a working copy of `rows` rows `width` columns wide (the store's truth
        padded in place, `paged.CopyLayer`) fits the budget beside the store: only on a
        CPU, where a decode step's gather is a copy the CPU pays for; a GPU gathers at its
        memory's speed. Its layers may grow only within that room."""
        if self.kv is None or self.device.type != "cpu":
            return False
        room = self._copy_room()
        if rows * width > room:
            return False
        if self._copy is not None:
            for layer in self._copy.layers:
                layer.budget = room
            if self._copy.layers[0].capacity() > room:
                return False
        return True

    def _shared_blocks(self) -> int:
        """How many whole blocks every running row begins with (the same blocks)."""
        assert self.kv is not None
        tables = [s.table for s in self.rows if s.table is not None]
        if not tables:
            return 0
        full = min(t.length for t in tables) // self.kv.pool.size  # written in every row
        count = 0
        for column in zip(*(t.blocks[:full] for t in tables), strict=False):
            if any(block != column[0] for block in column):
                break
            count += 1
        return count

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
        if self.kv is not None and not self._grow_rows():
            return  # every row was preempted (their blocks went to older rows)
        assert self._mask is not None and self._seen is not None
        rows = self.rows
        self.decoded_rows += len(rows)
        self.decode_steps += 1
        ids = torch.tensor([[s.tokens[-1]] for s in rows], dtype=torch.long, device=self.device)
        if self.kv is not None:
            out = self._decode_paged(ids)
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
        self._seen.scatter_(1, ids, True)
        if self._columns is None:
            self._columns = sampling.Columns([s.options.choice for s in rows], self.device)
        picked = sampling.pick(
            out.logits[:, -1, :], self._columns, self._seen, [s.generator for s in rows]
        )
        self.peak_tokens = max(self.peak_tokens, self.capacity_tokens)
        if not self._merges:
            self._cache = _cache_of(out)  # a plain cache grows by concatenation
        for sequence, token in zip(rows, picked, strict=True):
            self._take(sequence, token)

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
