"""KV-cache blocks of one replica: fixed-size blocks taken as sequences grow, and full
blocks shared by every sequence whose tokens start the same way (prefix caching).

A sequence's keys and values live in blocks of `BLOCK_TOKENS` token slots; its `Table`
lists them in order, so its token `i` is slot `blocks[i // size] * size + i % size` of the
replica's store (`worker.generation.kv.paged`). Blocks are taken one at a time as a sequence
grows and given back when it leaves, so memory follows the tokens held, not a padded
batch's reach.

A block that is full is keyed by the tokens it holds and everything before them (a chained
digest), as vLLM's automatic prefix caching does. A new sequence whose prompt starts with
keyed blocks holds those blocks too (a count of holders per block) and computes only the
rest. A keyed block nobody holds stays cached, least recently used first out: it is taken
back only when a sequence needs a block and the budget has no other room (room the engine
holds back for a CPU's working copy of its running rows counts as other room only when no
cached block is left: live rows come before a prefix a later call may ask for). Only full
blocks are shared, and a sequence writes only into its last block, which is never full, so
no block is written while shared.

Block 0 is never handed out: padding in a batch's gather index reads it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Tokens a block holds: vLLM's default, not tuned here. A sequence wastes at most one
#: block's room less one slot; a prefix is shared in whole blocks.
BLOCK_TOKENS = 16
NULL_BLOCK = 0


@dataclass
class Table:
    """One sequence's blocks, in order, and how much of them holds keys and values."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose keys and values are written
    keyed: int = 0  # leading blocks that are full and keyed
    key: bytes = b""  # the last keyed block's key (the chain's next parent)
    reused: int = 0  # tokens taken from cached blocks when it was admitted


class OutOfBlocks(Exception):
    """No block is free, cached or left in the budget (the engine preempts a row)."""


class BlockPool:
    """The blocks of one replica's KV budget (see the module). Not thread-safe."""

    def __init__(self, budget_blocks: int, size: int = BLOCK_TOKENS, *, share: bool = True) -> None:
        if budget_blocks < 1:
            raise ValueError(f"a pool needs at least one block, got {budget_blocks}")
        self.size = size
        self.share = share  # False: no prefix is ever found (to measure what sharing gains)
        self.budget = budget_blocks + 1  # the null block is one beyond the budget
        self.allocated = 1  # blocks the store has room for (it grows towards `budget`)
        self._free: list[int] = []
        self._holders = [0]  # per block allocated
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # keyed, unheld: LRU first
        # Blocks of the budget's unallocated room the store leaves to a CPU working copy
        # (`worker.generation.paging`) while a cached block can be taken instead.
        self.held_back = 0
        self.prompt_tokens = 0  # admitted prompts' tokens, and of them
        self.reused_tokens = 0  # those read from cached blocks

    # --- counts -----------------------------------------------------------------------

    @property
    def in_use(self) -> int:
        """Blocks some sequence holds."""
        return self.allocated - 1 - len(self._free) - len(self._idle)

    @property
    def cached(self) -> int:
        """Keyed blocks nobody holds (reusable, and taken back first when room runs out)."""
        return len(self._idle)

    @property
    def free(self) -> int:
        """Blocks that hold nothing: unused ones, and the budget's room not yet allocated."""
        return len(self._free) + self.budget - self.allocated

    @property
    def available(self) -> int:
        """Blocks a sequence could take now (free ones, then cached ones)."""
        return self.free + self.cached

    def hit_rate(self) -> float:
        """Prompt tokens read from cached blocks, over all admitted prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # --- taking and giving back -------------------------------------------------------

    def take(self) -> int:
        """A block for one holder: a free one, else room the budget has left beyond what is
        `held_back` (the store must then grow to `allocated`), else the least recently used
        cached one, else the room held back."""
        if self._free:
            block = self._free.pop()
        elif self.allocated < self.budget - self.held_back or (
            not self._idle and self.allocated < self.budget
        ):
            block = self.allocated
            self.allocated += 1
            self._holders.append(0)
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
        else:
            raise OutOfBlocks
        self._holders[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Give back one holder's blocks: a keyed one nobody holds stays cached (its last
        use now), any other is free."""
        for block in blocks:
            self._holders[block] -= 1
            if self._holders[block]:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def unhold_all(self) -> None:
        """Give back every holder's blocks at once (an engine that failed left its rows'
        blocks held): keyed blocks stay cached, as their contents were whole before they
        were keyed; the others are free. Only while no engine uses the pool (so none
        holds room back for its working copy)."""
        self.held_back = 0
        for block in range(1, self.allocated):
            if self._holders[block]:
                self._holders[block] = 1
                self.release([block])

    # --- prefixes ---------------------------------------------------------------------

    def match(
        self, tokens: Sequence[int], limit: int, root: bytes = b""
    ) -> tuple[list[int], bytes]:
        """The cached blocks that hold `tokens`' first whole blocks, within `limit` tokens,
        and the last one's key (`root`, where the chain starts, when none); not held yet
        (`hold`)."""
        blocks: list[int] = []
        key = root
        if not self.share:
            return blocks, key
        for start in range(0, limit - self.size + 1, self.size):
            following = chain(key, tokens[start : start + self.size])
            block = self._by_key.get(following)
            if block is None:
                break
            blocks.append(block)
            key = following
        return blocks, key

    def needs(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (a `match`) are cached and unheld: holding them takes them
        out of what is available."""
        return sum(1 for block in blocks if block in self._idle)

    def sole(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` one holder alone holds: what that holder's release makes
        available (free, or cached and reusable)."""
        return sum(1 for block in blocks if self._holders[block] == 1)

    def hold(self, blocks: Sequence[int]) -> None:
        """One more holder for each of `blocks` (matched prefix blocks)."""
        for block in blocks:
            if not self._holders[block]:
                del self._idle[block]
            self._holders[block] += 1

    def key_full_blocks(self, table: Table, tokens: Sequence[int]) -> None:
        """Key the table's blocks that became full (`tokens`: the sequence's whole context,
        at least `table.length` long). A block whose key another block holds already stays
        unkeyed: the first one is what later prompts find."""
        while (table.keyed + 1) * self.size <= table.length:
            start = table.keyed * self.size
            key = chain(table.key, tokens[start : start + self.size])
            block = table.blocks[table.keyed]
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = key
            table.key = key
            table.keyed += 1

    def counted(self, prompt_tokens: int, reused: int) -> None:
        """Count an admitted prompt for the hit rate."""
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += reused

    def stats(self) -> dict[str, float]:
        """Blocks in use, cached and free, the block size, and the prompt tokens admitted
        and read from cached blocks (their ratio is the prefix hit rate)."""
        return {
            "block_tokens": self.size,
            "blocks_in_use": self.in_use,
            "blocks_cached": self.cached,
            "blocks_free": self.free,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
        }


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A block's key: a digest of its parent's key and its own tokens."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def blocks_for(tokens: int, size: int = BLOCK_TOKENS) -> int:
    """Blocks that hold `tokens` slots."""
    return -(-tokens // size)


__all__ = ["BLOCK_TOKENS", "BlockPool", "OutOfBlocks", "Table", "blocks_for", "chain"]
