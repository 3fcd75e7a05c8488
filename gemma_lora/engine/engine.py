"""The Engine: owns the model and its compiled programs (per batch size and attention window), and admits
prompts into rows of a decode batch (Prefills: alone, grouped, or after a cached prefix)."""
import collections
import functools

import numpy as np

from gemma_lora.engine.batch import DecodeBatch
from gemma_lora.engine.prefix_cache import PrefixPool
from gemma_lora.engine.programs import (DECODE_CHUNK, LONGEST_CHUNK, LONG_CHUNK, LONG_CHUNK_SECONDS, Program,
                                        cache_position_axes, cache_shapes, decode_chunk, decode_until_done, empty_row,
                                        insert, next_tokens, prefill_after_prefix, prefill_group, resize_cache,
                                        zeros_of)
from gemma_lora.engine.warmup import WarmUp
from gemma_lora.interface import CANDIDATES, TOP_LOGPROBS
from gemma_lora.metrics import METRICS, TIMELINE
from gemma_lora.model import LoadError
from gemma_lora.tokens import make_text_codec, pieces_of


# Prompts of up to GROUP_BLOCK tokens that are admitted together are prefilled in groups of these sizes
# (see prefill_group); a batch smaller than a size never uses it. On a CPU, whose prefills are compute-bound
# from fewer tokens, each size only up to its GROUP_BLOCKS_CPU, where it paid for its program (its compiling
# and 30-45 MiB of RSS: BENCHMARKS.md, issue #35). Gemma 3 270M on 2 cores, grouped against one by one:
# 1.1-3.6x in blocks of 16-64 tokens but 0.80-1.09x (int8) and 1.01-1.39x (float32) in blocks of 128; a
# pair 1.88x (int8) and 1.43x (float32) in blocks of 16, 1.12-1.27x in 32 and 64 (5-34 ms once).
# Off a CPU, groups up to 64 prompts and GROUP_TOKENS tokens: a wave of newcomers (streaming clients whose
# answers end together, a burst) is prefilled in a few dispatches, each of which stalls the decoding rows,
# instead of one per 8 (issue #48: 64 clients on a TPU v5e, 67 groups for 389 prompts, 40-56 ms each).
PREFILL_GROUPS = (2, 4, 8, 16, 32, 64)
GROUP_BLOCK, GROUP_TOKENS, GROUP_BLOCKS_CPU = 128, 4096, {2: 16, 4: 64, 8: 64}
UNROLL_FROM_BYTES = 64 << 20  # off a CPU, weights from which a decode chunk is unrolled (see decode_chunk)...
UNROLL_FROM_BATCH_OFF_CPU = 2  # ...and the batch size from which it is (see Engine)
# One batch size's compiled programs (see Engine.batch_programs); resize: {size: program} for its neighbours.
BatchPrograms = collections.namedtuple("BatchPrograms", "new_cache insert decode decode_long next_tokens resize")


class Engine:
    """Owns the model and its compiled programs. Every row of a decode batch keeps its own position,
    so a request takes a free row as soon as one opens (continuous batching), starts right after its
    own prompt, and never waits for its neighbours' prompts or max_tokens. With a prefix-cache pool, a
    prompt's longest cached prefix is copied into its row and only the rest is prefilled."""

    def __init__(self, model, batch_buckets, length_buckets, distribution, tokenizer=None, adapters=None,
                 prefix_blocks=0, block_tokens=16, dispatch_ahead=None):
        import jax
        self.model = model
        # Dispatching a chunk before reading the one ahead of it overlaps the host's work with the device's.
        # A CPU backend computes on the host's own cores, so there is nothing to overlap (bench_generate:
        # 760 ms both ways on the mixed load, the host busy 5% of the time), only a cost: a row freed by a
        # stop token is refilled a chunk later, and after the last one a chunk runs for nothing.
        self.dispatch_ahead = jax.default_backend() != "cpu" if dispatch_ahead is None else dispatch_ahead
        self.long_chunk_seconds = LONG_CHUNK_SECONDS
        self.token_seconds = None  # a token's time in the last long dispatch (None: none made yet)
        if jax.default_backend() == "cpu" and batch_buckets[0] == 1 and any(
                getattr(layer.dtype_policy, "quantization_mode", None) for layer in model.backbone._flatten_layers()):
            # XLA's CPU backend runs an int8 matrix-vector product several times slower than the same
            # product over two rows (640x8192: 3.1 ms against 0.44 ms), so one request decodes in two rows.
            batch_buckets = sorted({max(b, 2) for b in batch_buckets})
        # Every batch's cache holds the longest request; each decode step attends over the smallest of
        # the length buckets that holds every row's position.
        self.batch_buckets, self.length_buckets = batch_buckets, length_buckets
        self.max_length = length_buckets[-1]
        # Prompts are prefilled in the smallest of these blocks that holds them: prefill cost grows with the block.
        self.prompt_blocks = sorted({16 << i for i in range(16) if 16 << i < length_buckets[-1]} | set(length_buckets))
        self.distribution = distribution
        self.adapters = adapters  # AdapterSlots, or None: no LoRA is traced at all
        tokenizer = tokenizer or model.preprocessor.tokenizer
        self.encode, self.decode = make_text_codec(tokenizer)
        self.vocabulary_size = model.backbone.vocabulary_size
        self.pieces = pieces_of(tokenizer)
        if self.vocabulary_size > len(self.pieces):
            # Embedding rows past the tokenizer's pieces (a vocabulary padded to a round size) have no text:
            # they read as empty, as the grammar's token table already has them.
            decode, known = self.decode, len(self.pieces)
            self.decode = lambda ids: decode([i for i in ids if i < known])
        self.bos, self.pad = tokenizer.start_token_id, tokenizer.pad_token_id or 0
        self.stop_ids = {tokenizer.end_token_id}
        if "<end_of_turn>" in self.pieces:
            self.stop_ids.add(tokenizer.token_to_id("<end_of_turn>"))
        self.variables = model.variables
        self.values = [v.value for v in self.variables]
        self.top_logprobs = min(TOP_LOGPROBS, CANDIDATES, model.backbone.vocabulary_size)
        self.mask_words = -(-self.vocabulary_size // 32)  # a grammar mask's int32 words per row
        self.open_mask_arrays = {}
        self.axes = cache_position_axes(model)
        # Unrolled decode chunks (see decode_steps) pay on a TPU at batch 64 (gemma_2b bfloat16: 3,975 -> 4,511
        # tok/s) but not at batch 1, already at its weight-read limit either way (139 -> 140 tok/s), where they
        # cost 24 s more compiling (batch 1's warm-up 43 -> 67 s). On a CPU the loops decode as fast, once they
        # take the kernels laid out (lay_out_for_loops) and the cache by_row (Gemma 3 270M, 4-token chunks,
        # unrolled -> looped: float32 batch 2 window 512 23.8 -> 25.4 tok/s, batch 8 window 256 64.1 -> 66.0;
        # int8 window 512 36.2 -> 40.8 before by_row), for a third of the instructions: BENCHMARKS.md.
        cpu = jax.default_backend() == "cpu"
        large = sum(value.nbytes for value in self.values) >= UNROLL_FROM_BYTES
        self.unrolled = set() if cpu else {batch for batch in batch_buckets
                                           if large and batch >= UNROLL_FROM_BATCH_OFF_CPU}
        bound = functools.partial
        # On a mesh every program that makes a one-row cache hands it back copied to every device: the
        # programs it goes into (insert, a pool write, a prefill after a prefix) were compiled for one
        # layout, whichever program made it (a lone prefill, a group's, the pool's gather).
        rows = None if distribution is None else jax.sharding.NamedSharding(
            distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec())
        # A lone prompt is prefilled into a row of a window's positions, after its cached prefix or from an
        # empty row: one program per (block, window) serves both (a prefill of its own block's positions, one
        # per block, was the model's graph once more for each: Gemma 3 270M int8, 14,000 HLO instructions and
        # some 45 MiB of RSS apiece on a CPU), and at most a window's rows to insert and store.
        self._prefill = Program(bound(prefill_after_prefix, model, self.variables, adapters), out_shardings=rows)
        self._empty_row = Program(bound(empty_row, model), static_argnums=(0,), out_shardings=rows)
        self._prefill_group = Program(bound(prefill_group, model, self.variables, adapters), out_shardings=rows)
        self.group_sizes = [g for g in PREFILL_GROUPS if g <= batch_buckets[-1]]
        # The largest block each group size is formed in (group_blocks).
        self.group_limits = (dict(GROUP_BLOCKS_CPU) if jax.default_backend() == "cpu"
                             else {size: min(GROUP_BLOCK, GROUP_TOKENS // size) for size in PREFILL_GROUPS})
        # What requests may use: WarmUp narrows these while it compiles and widens them part by part.
        # `chunked`: the smallest batch's multi-token decodes exist (until then it decodes a token a step).
        self.ready_batches, self.grouping, self.chunked = list(batch_buckets), bool(self.group_sizes), True
        # A lone request decodes in the smallest batch, where the per-dispatch cost weighs most: on a CPU that
        # batch size gets decode_until_done's long chunks, which make its DECODE_CHUNKs too (one program per
        # window for both: Engine.long_makes_chunks). Off a CPU, dispatching ahead already hides that cost:
        # gemma_2b on a TPU v5e decoded 140 tok/s with them and 143 without at batch 1 (998 and 1,016 at batch 8),
        # and they cost 17-18 s of its warm-up.
        long = jax.default_backend() == "cpu"
        self.programs = {batch: self.batch_programs(batch, long=long and batch == batch_buckets[0])
                         for batch in batch_buckets}
        if prefix_blocks and any(length % block_tokens for length in length_buckets):
            raise LoadError(f"--prefix-block-tokens {block_tokens} must divide every --length-buckets length")
        self.prefix = PrefixPool(self, prefix_blocks, block_tokens, rows) if prefix_blocks else None
        self.prefills = Prefills(self)

    def cache_layout(self, batch):
        """(abstract shapes, device layout or None) of a batch's cache."""
        import jax
        shapes = cache_shapes(self.model, batch, self.max_length)
        return shapes, None if self.distribution is None else jax.tree.map(
            lambda s: self.distribution.get_data_layout(s.shape).backend_layout, shapes)

    def batch_programs(self, batch, long):
        """(new cache, insert, decode, decode until done or None, next tokens, resizes) for one batch size.
        The cache's layout (and next_tokens' split over the batch) is pinned so that what one program hands
        back is exactly what the next was compiled for."""
        import jax
        shapes, layout = self.cache_layout(batch)
        at = self.batch_buckets.index(batch)
        new_cache = Program(functools.partial(zeros_of, shapes), out_shardings=layout)

        rows = None if self.distribution is None else self.distribution.get_data_layout((batch,)).backend_layout
        # A chunk's tokens [steps, batch] split as the rows are: next_tokens reads them, and the warm-up
        # compiles it ahead from this layout (left to XLA, it is only known once the decode step is compiled).
        tokens = None if rows is None else jax.sharding.NamedSharding(rows.mesh, jax.sharding.PartitionSpec(
            None, *rows.spec))

        def decoder(fn, sampled=None):  # (values, cache, window, steps, ...) -> (outputs, cache), the cache donated
            return Program(functools.partial(fn, self.model, self.variables, self.adapters, self.axes,
                                             batch in self.unrolled),
                           static_argnums=(2, 3), donate_argnums=(1,), out_shardings=((sampled, None), layout))
        return BatchPrograms(
            new_cache, Program(functools.partial(insert, self.axes, by_select=self.distribution is not None),
                               donate_argnums=(0,), out_shardings=layout),
            decoder(decode_chunk, tokens), decoder(decode_until_done) if long else None,
            Program(next_tokens, out_shardings=rows),
            # Copies of chosen rows into a batch of the next smaller or larger size, in that size's layout.
            {size: Program(resize_cache, out_shardings=self.cache_layout(size)[1])
             for size in self.batch_buckets[max(at - 1, 0):at] + self.batch_buckets[at + 1:at + 2]})

    def long_makes_chunks(self, batch):
        """Whether a batch size's single tokens and chunks of DECODE_CHUNK tokens are made by its long decode,
        stopped after as many (DecodeBatch.step), and need no program of their own: where it has one and
        chunks are not dispatched ahead (a CPU), which reads the last token of decode_chunk's output on the
        device. Two programs fewer per window to compile and hold (Gemma 3 270M int8 on a CPU, the one-token
        decode: 18,600 HLO instructions)."""
        return self.programs[batch].decode_long is not None and not self.dispatch_ahead

    def open_masks(self, batch):
        """Grammar masks that allow every token, put on the device once per batch size: what a chunk
        without a grammar row takes."""
        if batch not in self.open_mask_arrays:
            self.open_mask_arrays[batch] = self.put(np.full((batch, self.mask_words), -1, np.int32))
        return self.open_mask_arrays[batch]

    def long_limit(self):
        """How many tokens a long dispatch may make: as many as fit in long_chunk_seconds at the last long
        dispatch's speed, in whole DECODE_CHUNKs, from LONG_CHUNK to LONGEST_CHUNK. A request that arrives
        meanwhile waits for that dispatch: no longer than the larger of that time and LONG_CHUNK tokens,
        while a fast model (a small one, or on a GPU) pays its per-dispatch cost less often."""
        if not self.token_seconds:
            return LONG_CHUNK
        fits = int(self.long_chunk_seconds / self.token_seconds) // DECODE_CHUNK * DECODE_CHUNK
        return min(max(fits, LONG_CHUNK), LONGEST_CHUNK)

    @property
    def lora_tables(self):
        return {} if self.adapters is None else self.adapters.tables

    def put(self, array, replicated=False):
        """Onto the device(s), split along the batch axis when data-parallel (or copied to all)."""
        import jax
        if self.distribution is None:
            return jax.device_put(array)
        if replicated:
            mesh = self.distribution.device_mesh.backend_mesh
            return jax.device_put(array, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        return jax.device_put(array, self.distribution.get_data_layout(array.shape).backend_layout)

    def feed(self, array, replicated=False):
        """A small host array a step takes (tokens, positions, sampling settings). On one device a numpy
        copy goes to the jitted call as it is: the call takes it in C++ in about a microsecond, where
        `device_put` costs 30-200 µs, some 20 times per request. Always a copy, so that the host may change its own
        array while the step it was dispatched to still waits to run: on a CPU mesh `device_put` may read a
        numpy array's memory after it returns (before this copy, 2 runs in 5 of a 2x2-mesh test decoded
        4 of its 8 requests from tokens and positions the host had already moved on)."""
        array = np.array(array)
        return array if self.distribution is None else self.put(array, replicated)

    def block_for(self, prompt_length):
        return next(b for b in self.prompt_blocks if b >= prompt_length)

    def batch_for(self, n_rows):
        """The smallest batch size whose programs are compiled that holds n_rows, or the largest such."""
        return next((b for b in self.ready_batches if b >= n_rows), self.ready_batches[-1])

    def window_for(self, length):
        return next((l for l in self.length_buckets if l >= length), self.max_length)

    def tokens(self, prompts, length):
        """Each of `prompts` (token id lists) padded to `length`, as a [len(prompts), length] array for a
        prefill."""
        tokens = np.full((len(prompts), length), self.pad, np.int32)
        for row, ids in enumerate(prompts):
            tokens[row, :len(ids)] = ids
        return self.feed(tokens, replicated=True)

    @property
    def row_lengths(self):
        """The lengths of the one-row caches prefills make, which batches insert and the pool stores: a
        window's (a lone prompt's) and a block's of group_blocks (a group's)."""
        return sorted(set(self.length_buckets) | set(self.group_blocks))

    def group_sizes_for(self, block):
        return [size for size in self.group_sizes if block <= self.group_limits.get(size, 0)]

    @property
    def group_blocks(self):
        """Each prompt block that has groups, and their sizes."""
        return {block: sizes for block in self.prompt_blocks if (sizes := self.group_sizes_for(block))}

    def warm_up(self):
        """Compiles every program once, so requests never compile (see WarmUp); returns the WarmUp, which
        keeps each program's compile time."""
        warm_up = WarmUp(self)
        warm_up.run()
        return warm_up

    def generate(self, rows, batch):
        """Decodes `rows` (Generation objects) in a batch of `batch` rows (or the smallest compiled size
        above), each taking a row as one frees; returns the batch."""
        decoding = DecodeBatch(self, self.batch_for(batch))
        waiting = list(rows)
        while waiting or decoding.active:
            taken, waiting = waiting[:decoding.free_rows], waiting[decoding.free_rows:]
            decoding.admit_all(taken)
            decoding.step(quiet=not waiting)
        return decoding


class Prefills:
    """How an Engine turns prompts into cache rows: a prompt's longest cached prefix copied from the
    prefix-cache pool and the rest computed after it in its window's row, or all of it computed in an empty
    row; prompts that arrive together and fit a group's block, computed in one dispatch. Each prompt's new
    full blocks go into the pool, held (with the ones it reused) until its generation ends."""

    def __init__(self, engine):
        self.engine = engine

    def keys(self, generation):
        """The prefix-cache key chain of a generation's prompt ([] without a prefix cache)."""
        prefix = self.engine.prefix
        return [] if prefix is None else prefix.keys_of(generation)

    def match(self, generation, keys):
        """PrefixPool.reuse: ([], 0) without a prefix cache."""
        prefix = self.engine.prefix
        return ([], 0) if prefix is None else prefix.reuse(generation, keys)

    def compute(self, generation, reused, start):
        """The cache row of a prompt, of the window that holds its block: the `reused` pool blocks copied and
        the rest computed after them, or all of it computed in an empty row."""
        engine, ids = self.engine, generation.prompt_ids
        suffix = engine.block_for(len(ids) - start)
        window = engine.window_for(start + suffix)
        row = engine.prefix.gather(reused, window) if start else engine._empty_row(window)
        row = engine._prefill(engine.values, row, engine.tokens([ids[start:]], suffix), np.int32(start),
                              engine.lora_tables, np.int32(generation.slot))
        TIMELINE.dispatched("prefill", row)
        return row

    def store(self, generation, keys, start, row):
        if self.engine.prefix is not None:
            self.engine.prefix.store(generation, keys, start, row)

    def row(self, generation, keys=None):
        """The cache row of one prompt and the number of its tokens that were cached. `keys`: its keys(),
        when already known."""
        keys = self.keys(generation) if keys is None else keys
        reused, start = self.match(generation, keys)
        row = self.compute(generation, reused, start)
        self.store(generation, keys, start, row)
        return row, start

    def rows(self, generations):
        """row() for each of `generations`, which arrived together. Prompts that reuse no cached prefix and
        fit one of the engine's group_blocks (up to GROUP_BLOCK tokens; on a CPU GROUP_BLOCKS_CPU) are
        prefilled in groups of one block length (prefill_group), the largest of the block's group sizes that
        fits first. A prompt that shares its first block with an earlier one of these waits until that one is
        in the pool, and reuses it."""
        engine = self.engine
        done, groups, after, firsts = {}, collections.defaultdict(list), [], set()
        twins, copies = {}, []  # the n answers to one prompt: one prefill, its row copied into each
        for generation in generations:
            twin = twins.setdefault((tuple(generation.prompt_ids), generation.slot), generation)
            if twin is not generation:
                copies.append((generation, twin))
                continue
            keys = self.keys(generation)
            if keys and keys[0] in firsts:
                after.append((generation, keys))
                continue
            firsts.update(keys[:1])
            reused, start = self.match(generation, keys)
            block = engine.block_for(len(generation.prompt_ids))
            if not start and engine.grouping and block in engine.group_blocks:
                groups[block].append((generation, keys))
                continue
            row = self.compute(generation, reused, start)
            self.store(generation, keys, start, row)
            done[id(generation)] = row, start
        for block, waiting in groups.items():
            while waiting:
                size = max((s for s in engine.group_sizes_for(block) if s <= len(waiting)), default=1)
                group, waiting = waiting[:size], waiting[size:]
                if size == 1:
                    rows = [self.compute(group[0][0], [], 0)]
                else:
                    slots = engine.feed(np.array([g.slot for g, _ in group], np.int32), replicated=True)
                    rows = engine._prefill_group(engine.values, engine.tokens([g.prompt_ids for g, _ in group], block),
                                                 engine.lora_tables, slots)
                    TIMELINE.dispatched("prefill_group", rows)
                    METRICS.add("prefill_groups")
                    METRICS.add("grouped_prompts", size)
                for (generation, keys), row in zip(group, rows):
                    self.store(generation, keys, 0, row)
                    done[id(generation)] = row, 0
        for generation, keys in after:  # the blocks of the prompts above are in the pool now
            done[id(generation)] = self.row(generation, keys)
        for generation, twin in copies:
            done[id(generation)] = done[id(twin)]
        return [done[id(generation)] for generation in generations]
