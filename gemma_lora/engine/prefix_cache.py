"""Automatic prefix caching: KV blocks of prompts that start alike (a system prompt, a conversation's
history) kept in a pool on the device and copied into a new row, so only the rest of the prompt is prefilled."""
import array
import collections
import functools
import hashlib

import numpy as np

from gemma_lora.engine.programs import Program, cache_length, cache_shapes
from gemma_lora.metrics import TIMELINE


def gather_blocks(axes, pool, block_ids):
    """A one-row cache of len(block_ids) x block positions, block k taken from pool block block_ids[k]."""
    import jax
    import jax.numpy as jnp

    def gather(leaf, axis):
        blocks = jnp.moveaxis(leaf[block_ids], 0, axis - 1)  # [..., n blocks, block tokens, ...]
        return blocks.reshape(blocks.shape[:axis - 1] + (-1,) + blocks.shape[axis + 1:])[None]
    return jax.tree.map(gather, pool, axes)


def store_blocks(axes, pool, row_cache, sources, targets):
    """Copies block sources[k] of a one-row cache into pool block targets[k], for every k (pairs that
    should do nothing target the pool's scratch block)."""
    import jax
    import jax.numpy as jnp

    def store(leaf, row, axis):
        size = leaf.shape[axis]
        row = row[0].reshape(row.shape[1:axis] + (row.shape[axis] // size, size) + row.shape[axis + 1:])
        return jnp.asarray(leaf).at[targets].set(jnp.moveaxis(row, axis - 1, 0)[sources])
    return jax.tree.map(store, pool, row_cache, axes)


class PrefixCache:
    """Which prompt prefixes the engine's device pool holds: --prefix-cache-blocks blocks of
    --prefix-block-tokens positions of KV each (plus a scratch block). A block's key hashes every token
    before and in it, and the adapter of the row that computed it (an adapter changes K and V), so one
    key is one exact KV. Only full blocks are kept; least recently used blocks that no running
    generation holds are evicted first. The worker thread alone calls it."""

    def __init__(self, blocks, block_tokens):
        self.blocks, self.block_tokens, self.scratch = blocks, block_tokens, blocks
        self.by_key = collections.OrderedDict()  # key -> block, least recently used first
        self.free = list(range(blocks - 1, -1, -1))
        self.holders = [0] * blocks  # running generations that hold each block

    def keys(self, ids, adapter):
        """The key chain of the full blocks of `ids`."""
        digest, keys, size = hashlib.sha256(b"adapter %d" % adapter).digest(), [], self.block_tokens
        for start in range(0, len(ids) - size + 1, size):
            digest = hashlib.sha256(digest + array.array("i", ids[start:start + size]).tobytes()).digest()
            keys.append(digest)
        return keys

    def match(self, keys):
        """The blocks of the longest cached prefix of the chain `keys`, now the most recently used."""
        found = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            self.by_key.move_to_end(key)
            found.append(block)
        return found

    def allocate(self, keys):
        """[(index in keys, block)] to write for the keys not cached yet, evicting the least recently used
        blocks nobody holds; fewer (or none) when every block is held. The blocks come back held, so one
        call never hands out a block twice (a pool write with a repeated block would be undefined)."""
        out = []
        for index, key in enumerate(keys):
            if key in self.by_key:
                self.by_key.move_to_end(key)
                continue
            block = self.free.pop() if self.free else self.evict()
            if block is None:
                break
            self.by_key[key] = block
            self.holders[block] += 1
            out.append((index, block))
        return out

    def forget(self, blocks):
        """Drops the keys of `blocks` (their KV was never written); the blocks stay held until released."""
        blocks = set(blocks)
        for key in [key for key, block in self.by_key.items() if block in blocks]:
            del self.by_key[key]
        self.free.extend(sorted(blocks, reverse=True))

    def evict(self):
        for key, block in self.by_key.items():
            if not self.holders[block]:
                del self.by_key[key]
                return block
        return None

    def hold(self, blocks):
        for block in blocks:
            self.holders[block] += 1

    def release(self, blocks):
        for block in blocks:
            self.holders[block] -= 1

    def used(self):
        return len(self.by_key)


class PrefixPool(PrefixCache):
    """The prefix cache with its blocks' KV on the device: the pool (a one-row cache's leaves cut into
    blocks, plus the scratch block) and the programs that copy a prefix out of it and a prompt's new
    blocks into it, for an Engine's prefills."""

    def __init__(self, engine, blocks, block_tokens, rows):
        import jax
        super().__init__(blocks, block_tokens)
        self.engine = engine
        self.pool = self.empty()
        self.pool_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(self.pool)) * blocks // (blocks + 1)
        self.gather_program = Program(functools.partial(gather_blocks, engine.axes), out_shardings=rows)
        self.store_program = Program(functools.partial(store_blocks, engine.axes), donate_argnums=(0,))

    def empty(self):
        import jax
        blocks, size = self.blocks, self.block_tokens
        return self.engine.put(jax.tree.map(
            lambda s, axis: np.zeros((blocks + 1,) + s.shape[1:axis] + (size,) + s.shape[axis + 1:], s.dtype),
            cache_shapes(self.engine.model, 1, 8), self.engine.axes), replicated=True)

    def keys_of(self, generation):
        return self.keys(generation.prompt_ids, 0 if generation.adapter is None else generation.adapter.uid)

    def reuse(self, generation, keys):
        """The pool blocks of the prompt's longest cached prefix, held until the generation ends, and the
        number of positions they cover."""
        ids, engine = generation.prompt_ids, self.engine
        reused = self.match(keys[:(len(ids) - 1) // self.block_tokens])  # the last token is always computed
        # The rest is prefilled in a block after the prefix, and both must fit the cache: near the end of it,
        # reuse fewer blocks (the block for the rest shrinks with it).
        while reused and len(reused) * self.block_tokens + engine.block_for(
                len(ids) - len(reused) * self.block_tokens) > engine.max_length:
            reused.pop()
        self.hold(reused)  # before this prompt's own blocks are allocated, which may evict
        generation.releases.append(functools.partial(self.release, reused))
        return reused, len(reused) * self.block_tokens

    def gather(self, reused, window):
        """A one-row cache of `window` positions starting with the `reused` blocks."""
        TIMELINE.dispatched("pool_gather")
        return self.gather_program(self.pool, np.array(
            reused + [self.scratch] * (window // self.block_tokens - len(reused)), np.int32))

    def store(self, generation, keys, start, row):
        """Writes the prompt's new full blocks (those after the first `start` positions) into the pool, held
        until the generation ends."""
        first = start // self.block_tokens
        written = [(first + index, block) for index, block in self.allocate(keys[first:])]
        generation.releases.append(functools.partial(self.release, [block for _, block in written]))
        if written:
            size = cache_length(row, self.engine.axes) // self.block_tokens
            sources = np.zeros(size, np.int32)
            targets = np.full(size, self.scratch, np.int32)
            sources[:len(written)], targets[:len(written)] = zip(*written)
            try:
                self.pool = self.store_program(self.pool, row, sources, targets)
                TIMELINE.dispatched("pool_store")
            except BaseException:
                # The store donates the pool: whatever failed, its buffer may be gone. A fresh pool, and no
                # key left to match a block that is not in it.
                self.forget(list(self.by_key.values()))
                self.pool = self.empty()
                raise
