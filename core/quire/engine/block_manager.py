"""The block manager: fixed-size KV pages, block tables, reference counts, prefix caching.

Every page is in exactly one of three states:

==========  ==========  =============  ===================================================
state       ref_count   block_hash     where
==========  ==========  =============  ===================================================
free        0           None           ``_free`` if used before, else past ``_fresh_from``
cached      0           set            ``_evictable`` (LRU order) and ``_by_hash``
used        > 0         set or None    some sequences' block tables (``_by_hash`` if set)
parked      0           None           ``_parked``: used before, at or past ``limit``
==========  ==========  =============  ===================================================

A *full* page is named by a hash chained over its parent page's hash and its own token
ids, so equal hashes mean equal whole prefixes. A new sequence takes the longest chain of
cached pages without copying (ref count + 1); pages nobody uses keep their contents and
stay findable until a new page is needed and none is free, then the least recently
released is evicted.

A new page is a free page used before (the latest released first), else a never-used one
in id order. Pages used before are resident and likely in the CPU's caches; a never-used
page of a host pool costs a page fault at its first write, dear under a hypervisor
(docs/bench.md, "first touch"), so the pool's touched part grows only when its free
pages run out.

A pool that shares one memory budget with other models' pools
(:mod:`quire.engine.kv_budget`) has a ``limit``: only pages below it are handed out. A
page at or past it that its last user releases is *parked* (its prefix forgotten), and
once every page from some id up to the extent (``_fresh_from``) is parked, those pages
go back as never used (:meth:`release_top`), so the engine can give their memory back.

Only the scheduler (and, for the limit, the engine's budget share) calls the mutating
methods; it owns the sequences whose
``block_table`` and ``block_hashes`` this class writes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from quire.engine.sequence import Sequence
from quire.multimodal.inputs import page_keys


def hash_block(parent_hash: int | None, token_ids: SequenceABC[int]) -> int:
    """Chained hash of one full page: depends on the whole prefix, not just this page."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    """Owns the page pool. Methods that return ``False`` have changed nothing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per-page state as flat lists, not objects: an engine may have a million pages.
        self._ref_count = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Free pages used before: a dict keeps insertion order (popitem takes the latest)
        # and removes in O(1).
        self._free: dict[int, None] = {}
        # Pages [_fresh_from, num_blocks) were never used (or given back); they are free
        # too, below the limit.
        self._fresh_from = 0
        #: Pages handed out are below this (a shared memory budget moves it).
        self.limit = num_blocks
        # Pages used before, at or past the limit, that nobody holds.
        self._parked: set[int] = set()
        # Cached pages with no user, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        #: Cached pages reclaimed for new content (statistic).
        self.num_evictions = 0

    # -- reading ---------------------------------------------------------------------------
    def ref_count(self, block_id: int) -> int:
        """Block tables holding page ``block_id``."""
        return self._ref_count[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The prefix hash page ``block_id`` is findable by, or None."""
        return self._hash[block_id]

    @property
    def num_free_blocks(self) -> int:
        """Pages a sequence could take now (free and evictable, below the limit)."""
        return (len(self._free) + max(0, self.limit - self._fresh_from)
                + len(self._evictable))

    @property
    def extent(self) -> int:
        """Pages ``[0, extent)`` have been used and not given back: the pool's memory in
        use on a host that backs pages on first touch."""
        return self._fresh_from

    @property
    def num_never_used_blocks(self) -> int:
        """Free pages no sequence has held yet (the highest ids)."""
        return self.num_blocks - self._fresh_from

    @property
    def num_cached_blocks(self) -> int:
        """Pages with no user that still hold a reusable prefix."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._fresh_from - len(self._free) - len(self._evictable) - len(self._parked)

    @property
    def usage(self) -> float:
        """Share of pages held by sequences, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    # -- prefix caching --------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Make ``seq.block_hashes`` cover its first ``num_full_blocks`` pages."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            # a LoRA adapter's pages hold other K/V than the base model's: its chain
            # starts from its own root
            parent = hashes[-1] if hashes else (hash(("lora", seq.lora_id))
                                                if seq.lora_id else None)
            tokens = seq.token_slice(i * bs, (i + 1) * bs)
            if seq.mm_items:  # image tokens: the page's K/V depend on the image too
                images = page_keys(seq.mm_items, i * bs, (i + 1) * bs)
                if images:
                    parent = hash((parent, images))
            hashes.append(hash_block(parent, tokens))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding the longest cached prefix of ``seq``'s tokens. Changes no page.

        At least one token is always left to compute, because the model must run on the
        last token to produce the next one's logits.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        found: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Make the full pages among ``seq``'s first ``num_computed_tokens`` findable.

        Call only once their K/V are in the cache. A page whose hash another page already
        carries stays unnamed: the older copy keeps serving the prefix (and it is looked
        at again next time). The leading pages already named are skipped: a page keeps
        its name while a table holds it, so a decoding sequence costs O(new pages).
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_table))
        first = seq.num_named_blocks
        if first >= num_full:
            return
        self._extend_hashes(seq, num_full)
        named = first  # the leading run of named pages, once this call is done
        for i in range(first, num_full):
            block_id = seq.block_table[i]
            if self._hash[block_id] is None:
                h = seq.block_hashes[i]
                if h not in self._by_hash:
                    self._hash[block_id] = h
                    self._by_hash[h] = block_id
            if named == i and self._hash[block_id] is not None:
                named = i + 1
        seq.num_named_blocks = named

    # -- allocation ------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()
    ) -> bool:
        """Grow ``seq``'s table to hold ``num_new_tokens`` more tokens, all or nothing.

        ``cached_blocks`` (from :meth:`find_cached_prefix`, for a sequence with an empty
        table) are shared first; the tokens they hold count as already computed.
        :returns: False, changing nothing, when the pool cannot supply the pages.
        """
        if not cached_blocks:  # the common case: a running sequence grows
            new_needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) \
                - len(seq.block_table)
            if new_needed <= 0:
                return True
            if new_needed > self.num_free_blocks:
                return False
            seq.block_table.extend(self._take_new() for _ in range(new_needed))
            return True
        if seq.block_table:
            raise ValueError("cached prefix pages can only start an empty block table")
        held = len(seq.block_table) + len(cached_blocks)
        computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        new_needed = max(0, self.blocks_for(computed + num_new_tokens) - held)
        revived = sum(1 for b in cached_blocks if self._ref_count[b] == 0)
        if new_needed + revived > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            if self._ref_count[block_id] == 0:
                del self._evictable[block_id]
            self._ref_count[block_id] += 1
        seq.block_table.extend(cached_blocks)
        seq.block_table.extend(self._take_new() for _ in range(new_needed))
        return True

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give ``child`` (empty table) the first ``num_blocks`` of ``parent``'s pages.

        No page is copied: each gains a reference, and the child's pages past these are
        its own. Only full pages may be shared, since both would write into a partial one.
        """
        if child.block_table:
            raise ValueError("pages can only be shared into an empty block table")
        if num_blocks * self.block_size > parent.num_computed_tokens:
            raise ValueError(
                f"cannot share {num_blocks} pages: only {parent.num_computed_tokens} of the "
                "parent's tokens are computed"
            )
        shared = parent.block_table[:num_blocks]
        for block_id in shared:
            self._ref_count[block_id] += 1
        child.block_table.extend(shared)
        child.block_hashes[:] = parent.block_hashes[:num_blocks]

    def _take_new(self) -> int:
        if self._free:
            block_id, _ = self._free.popitem()
        elif self._fresh_from < self.limit:
            block_id = self._fresh_from
            self._fresh_from += 1
        else:
            block_id, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash[block_id]]  # type: ignore[arg-type]
            self._hash[block_id] = None
            self.num_evictions += 1
        self._ref_count[block_id] = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release every page of ``seq`` and empty its table.

        Pages are released last-first, so a sequence's tail is evicted before its prefix,
        which is the part other requests are likeliest to share.
        """
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_named_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Release ``seq``'s pages past those that hold ``num_tokens`` tokens (the pages
        of rejected draft tokens); returns how many went back."""
        keep = self.blocks_for(num_tokens)
        table = seq.block_table
        if len(table) <= keep:
            return 0
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        released = len(table) - keep
        del table[keep:]
        del seq.block_hashes[keep:]
        seq.num_named_blocks = min(seq.num_named_blocks, keep)
        return released

    def _release(self, block_id: int) -> None:
        self._ref_count[block_id] -= 1
        if self._ref_count[block_id] == 0:
            if block_id >= self.limit:
                self._forget(block_id)
                self._parked.add(block_id)
            elif self._hash[block_id] is None:
                self._free[block_id] = None
            else:
                self._evictable[block_id] = None

    def _forget(self, block_id: int) -> None:
        """Drop page ``block_id``'s prefix name, if it has one."""
        h = self._hash[block_id]
        if h is not None:
            del self._by_hash[h]
            self._hash[block_id] = None

    # -- a shared memory budget ------------------------------------------------------------
    def set_limit(self, limit: int) -> None:
        """Hand out only pages below ``limit`` from now on. Lowering it parks the free
        and cached pages at or past it (cached ones are evicted); used ones park when
        released. Raising it makes parked pages below it free again."""
        if not 0 <= limit <= self.num_blocks:
            raise ValueError(f"limit must be in [0, {self.num_blocks}], got {limit}")
        if limit < self.limit:
            for block_id in [b for b in self._free if b >= limit]:
                del self._free[block_id]
                self._parked.add(block_id)
            for block_id in [b for b in self._evictable if b >= limit]:
                del self._evictable[block_id]
                self._forget(block_id)
                self._parked.add(block_id)
                self.num_evictions += 1
        elif limit > self.limit:
            for block_id in [b for b in self._parked if b < limit]:
                self._parked.discard(block_id)
                self._free[block_id] = None
        self.limit = limit

    def release_top(self) -> tuple[int, int] | None:
        """Give back the parked pages at the top of the extent: ``(start, stop)`` of the
        pages that are now never used (their memory may go back to the OS), or None."""
        stop = self._fresh_from
        while self._fresh_from > self.limit and self._fresh_from - 1 in self._parked:
            self._fresh_from -= 1
            self._parked.discard(self._fresh_from)
        return (self._fresh_from, stop) if self._fresh_from < stop else None

    def reset_prefix_cache(self) -> None:
        """Forget every cached page that nobody uses (they become free)."""
        for block_id in self._evictable:
            del self._by_hash[self._hash[block_id]]  # type: ignore[arg-type]
            self._hash[block_id] = None
            self._free[block_id] = None
        self._evictable.clear()

    # -- checking --------------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError naming the first broken rule.

        free + cached + used = total; each page is in the one place its state says; the
        hash index points at pages carrying that hash; and, given every live sequence,
        each page's ref count equals the number of tables that hold it.
        """
        n_used = sum(1 for r in self._ref_count if r > 0)
        n_free = len(self._free) + self.num_never_used_blocks
        n_parked = len(self._parked)
        if n_free + len(self._evictable) + n_used + n_parked != self.num_blocks:
            raise AssertionError(
                f"free {n_free} + cached {len(self._evictable)} + used {n_used} "
                f"+ parked {n_parked} != total {self.num_blocks}"
            )
        if n_used != self.num_used_blocks:
            raise AssertionError(f"{n_used} pages are used, num_used_blocks says "
                                 f"{self.num_used_blocks}")
        for b, (ref, h) in enumerate(zip(self._ref_count, self._hash)):
            page = f"page {b} (ref {ref}, hash {h})"
            if ref < 0:
                raise AssertionError(f"{page} has a negative ref count")
            never_used = b >= self._fresh_from
            in_free, in_evictable = b in self._free, b in self._evictable
            parked = b in self._parked
            if never_used and (ref or h is not None or in_free or in_evictable or parked):
                raise AssertionError(f"{page} is past the used ones yet not plainly free")
            if parked and (ref or h is not None or in_free or in_evictable
                           or b < self.limit):
                raise AssertionError(f"{page} is parked yet used, named, listed or below "
                                     f"the limit {self.limit}")
            if (in_free or in_evictable) and b >= self.limit:
                raise AssertionError(f"{page} can be handed out yet is past the limit "
                                     f"{self.limit}")
            if ref > 0 and (in_free or in_evictable):
                raise AssertionError(f"{page} is used yet listed as free or cached")
            if ref == 0 and h is None and not (in_free or never_used or parked):
                raise AssertionError(f"{page} is unused and unnamed but not in the free list")
            if ref == 0 and h is not None and not in_evictable:
                raise AssertionError(f"{page} is unused and cached but not evictable")
            if h is not None and self._by_hash.get(h) != b:
                raise AssertionError(f"{page} carries a hash the index does not map to it")
        for h, b in self._by_hash.items():
            if self._hash[b] != h:
                raise AssertionError(f"hash index maps {h} to page {b} carrying {self._hash[b]}")
        if seqs is not None:
            counts = [0] * self.num_blocks
            for seq in seqs:
                for block_id in seq.block_table:
                    counts[block_id] += 1
            for b, ref in enumerate(self._ref_count):
                if counts[b] != ref:
                    raise AssertionError(
                        f"page {b}: {counts[b]} block tables hold it, ref count says {ref}"
                    )
