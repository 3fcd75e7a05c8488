"""The decode batch: its rows' caches, positions, sampling settings and grammars, admitting prompts into free
rows, dispatching and reading chunks of decode steps, and growing or shrinking in place."""
import time

import numpy as np

from gemma_lora.engine.programs import ADJUST_ARRAYS, Chunk, DECODE_CHUNK, LONGEST_CHUNK, LONG_CHUNK, SAMPLE_ARRAYS
from gemma_lora.interface import BIAS_SLOTS, CANDIDATES, SAMPLER_DEFAULTS, STOP_SLOTS
from gemma_lora.metrics import METRICS, TIMELINE, WORKER_CLOCK


class RowSampling:
    """Each row's sampling settings as the arrays the decode programs take (SAMPLE_ARRAYS, then
    ADJUST_ARRAYS), for a DecodeBatch and for the warm-up that compiles its programs. A free row is
    greedy with nothing to adjust: one left sampling or penalising would keep the rest of its batch off
    the cheap paths (sample()'s argmax, adjust_logits' skipped cond)."""
    NEVER = np.iinfo(np.int32).max  # an id past any vocabulary: adjust_logits' scatters drop it

    def __init__(self, size):
        self.temperature, self.top_p = np.zeros(size, np.float32), np.ones(size, np.float32)
        self.top_k, self.seeds = np.full(size, CANDIDATES, np.int32), np.zeros(size, np.uint32)
        self.alternatives = np.zeros(size, np.int32)  # top log-probabilities each row wants
        self.prompt_lengths, self.min_positions = np.zeros(size, np.int32), np.zeros(size, np.int32)
        self.frequency, self.presence = np.zeros(size, np.float32), np.zeros(size, np.float32)
        self.repetition = np.ones(size, np.float32)
        self.stop_ids = np.full((size, STOP_SLOTS), self.NEVER, np.int32)
        self.bias_ids = np.full((size, BIAS_SLOTS), self.NEVER, np.int32)
        self.bias_values = np.zeros((size, BIAS_SLOTS), np.float32)

    def set(self, row, sampling, seed=0, logprobs=None, prompt_length=0, model_stop_ids=()):
        """A row's settings: `sampling` as parse_sampling makes it (SAMPLER_DEFAULTS' keys at least);
        the stop ids min_tokens holds back are the model's and the request's stop_token_ids."""
        self.temperature[row], self.top_k[row], self.top_p[row] = (sampling["temperature"], sampling["top_k"],
                                                                   sampling["top_p"])
        self.seeds[row], self.alternatives[row] = seed, logprobs or 0
        self.prompt_lengths[row] = prompt_length
        self.frequency[row] = sampling.get("frequency_penalty", 0.0)
        self.presence[row] = sampling.get("presence_penalty", 0.0)
        self.repetition[row] = sampling.get("repetition_penalty", 1.0)
        min_tokens = sampling.get("min_tokens", 0)
        self.min_positions[row] = prompt_length - 1 + min_tokens if min_tokens else 0
        stops = sorted(set(model_stop_ids) | set(sampling.get("stop_token_ids", ()))) if min_tokens else []
        self.stop_ids[row] = self.NEVER
        self.stop_ids[row, :len(stops)] = stops
        bias = sampling.get("logit_bias") or {}
        self.bias_ids[row], self.bias_values[row] = self.NEVER, 0
        self.bias_ids[row, :len(bias)], self.bias_values[row, :len(bias)] = list(bias), list(bias.values())

    def clear(self, row):
        self.set(row, SAMPLER_DEFAULTS["greedy"])

    def plain(self, row):
        """Whether a row is greedy, wants no alternatives and adjusts nothing."""
        return (self.temperature[row] <= 0 and self.alternatives[row] <= 0 and self.min_positions[row] == 0
                and self.frequency[row] == 0 and self.presence[row] == 0 and self.repetition[row] == 1
                and not self.bias_values[row].any())

    def arrays(self):
        return [getattr(self, name) for name in SAMPLE_ARRAYS + ADJUST_ARRAYS]

    def take(self, other, kept):
        """Row i's settings from `other`'s row kept[i]."""
        for name in SAMPLE_ARRAYS + ADJUST_ARRAYS:
            getattr(self, name)[:len(kept)] = getattr(other, name)[kept]


class RowGrammars:
    """Each row's grammar mask for its next token (llguidance's bitmask, made on the host), and the check
    that lets a grammar row keep a chunk's later tokens, drawn without it. Free rows allow every token."""

    def __init__(self, engine, size):
        self.engine = engine
        self.masks = np.full((size, engine.mask_words), -1, np.int32)
        self.masked_rows = False  # whether `masks` still holds a grammar's mask
        self.open_masks = engine.open_masks(size)  # on the device: every token allowed, for chunks without a grammar

    def fill(self, rows):
        """Each grammar row's mask for its next token (llguidance, on the host); False when no row of
        `rows` (generations, None for a free row) has a grammar."""
        constrained = [(row, g.matcher) for row, g in enumerate(rows) if g is not None and g.matcher is not None]
        if self.masked_rows:  # a finished grammar's last mask must not reach the row's next request
            self.masks.fill(-1)
            self.masked_rows = False
        if not constrained:
            return False
        import llguidance.numpy
        started = time.time()
        for row, matcher in constrained:
            llguidance.numpy.fill_next_token_bitmask(matcher, self.masks, row)
        self.masked_rows = True
        METRICS.observe_masks(len(constrained), time.time() - started)
        return True

    def inputs(self, masked):
        """The masks a decode chunk takes: the rows' own when `masked` (fill() said a row has a grammar)."""
        return self.engine.feed(self.masks) if masked else self.open_masks

    def candidates(self, row, generation, sampler):
        """How many of the most likely tokens a grammar row's draw picks among: 1 when greedy, top_k when
        top-p cuts none of them (top_p 1) and the step lists them (engine.top_logprobs); 0 when its
        later tokens are never kept (any other sampler, or log-probabilities to report, which must be
        the masked distribution's)."""
        if generation.logprobs is not None:
            return 0
        if sampler.temperature[row] <= 0:
            return 1
        k = int(sampler.top_k[row])
        return k if sampler.top_p[row] >= 1 and k <= self.engine.top_logprobs else 0

    @staticmethod
    def keeps_free_draw(generation, candidates, token, top_ids):
        """Whether a token drawn without the grammar's mask (a chunk's later token) is the one the masked
        draw makes: it is when the grammar allows each of the draw's `candidates` (`top_ids()`: the most
        likely ids at that step, fetched only for a sampled row). The mask then removes none of them, so
        the masked draw sees the same candidates in the same order and, keyed by (seed, position), picks
        the same one; for a greedy row, an argmax the grammar allows is the masked argmax."""
        if not candidates:
            return False
        ids = [token] if candidates == 1 else top_ids()[:candidates].tolist()
        return all(generation.matcher.validate_tokens([i]) == 1 for i in ids)

    def take(self, other, kept):
        """Row i's mask from `other`'s row kept[i]."""
        self.masks[:len(kept)] = other.masks[kept]
        self.masked_rows = other.masked_rows


class DecodeBatch:
    """`size` rows over one cache. Each row holds one generation at its own position; a row frees up
    the moment its generation ends and can take the next one. With Engine.dispatch_ahead (a GPU or TPU)
    a chunk goes to the device before the tokens of the one ahead of it are read, so the host's work
    (reading tokens, stop strings, streaming, admitting) overlaps the device's instead of idling it."""

    def __init__(self, engine, size, cache=None):
        """`cache`: the batch's KV cache when it has one already (a resized batch's copy); else a new one."""
        self.engine, self.size, self.length = engine, size, engine.max_length
        self.new_cache, self.insert, self.decode, self.decode_long, self.next_tokens, _ = engine.programs[size]
        self.cache = self.new_cache() if cache is None else cache
        self.rows = [None] * size
        self.positions = np.zeros(size, np.int32)  # where each row's next input token goes
        self.tokens = np.full(size, engine.pad, np.int32)
        self.stale = np.zeros(size, bool)  # rows whose next input token is still on the device (see `pending`)
        self.sampler = RowSampling(size)
        self.slots = np.zeros(size, np.int32)  # each row's adapter slot (0: the base alone)
        self.sampling = None  # the slots and the sampler's arrays on the device; re-sent when a row changes hands
        self.grammars = RowGrammars(engine, size)
        self.first_token_due = False  # a one-token chunk next, for a streamed first token (admit_all)
        # The last chunk dispatched whose tokens are not read yet (a Chunk). Its rows' last tokens feed the next
        # chunk on the device.
        self.pending = None
        # Every generation admitted and not yet seen to finish. A row whose generation ends in the pending
        # chunk is refilled before that chunk is read: from then on only this set (and the chunk) holds
        # it, and fail() must still finish it.
        self.taken = set()

    @property
    def free_rows(self):
        return len(self.free_row_ids())

    @property
    def active(self):
        """Rows holding a generation, those that end in the pending chunk included."""
        return self.size - self.rows.count(None)

    def free_row_ids(self):
        """Empty rows, and rows whose generation is sure to end in the pending chunk (its max_tokens or the
        end of the cache, both known before its tokens are read): a request admitted there decodes from
        the next chunk on, as it would have after reading the tokens."""
        return [row for row, g in enumerate(self.rows) if g is None] + self.ending_rows()

    def ending_rows(self):
        """A grammar row is never sure to: the pending chunk's tokens may be dropped for it (hand_out)."""
        if self.pending is None:
            return []
        busy, start, steps = self.pending.busy, self.pending.start, self.pending.steps
        return [row for row, g in busy if self.rows[row] is g and g.finish_reason is None and g.matcher is None
                and (len(g.ids) + steps >= g.max_tokens or start[row] + steps >= self.length)]

    def admit(self, generation):
        self.admit_all([generation])

    def admit_all(self, generations):
        """Prefills the prompts (together where they can be: Prefills.rows) into free rows; a row's
        first decode step re-reads its last prompt token."""
        rows = self.free_row_ids()[:len(generations)]
        assert len(rows) == len(generations), "more generations than free rows"
        decoding = self.active > len(self.ending_rows())  # rows that go on decoding wait for these prefills
        TIMELINE.stalling = decoding
        self.taken = {g for g in self.taken if g.finish_reason is None}
        for row, generation in zip(rows, generations):
            self.rows[row] = generation  # held by the batch from here: a failure below finishes it
            self.taken.add(generation)
            generation.started = time.time()
            self.slots[row] = generation.slot
        # A streamed request's first token comes after a one-token chunk, read at once, only where no other row
        # decodes: under load newcomers arrive every few tokens, and a one-token chunk read before the next is
        # dispatched would stop the dispatching ahead for the whole batch each time (issue #48); they then get
        # it with the next chunk, dispatched ahead like any other.
        for row, generation, (row_cache, cached) in zip(rows, generations, self.engine.prefills.rows(generations)):
            generation.cached_tokens = cached
            self.cache = self.insert(self.cache, row_cache, np.int32(row))
            TIMELINE.dispatched("insert")
            ids = generation.prompt_ids
            self.positions[row], self.tokens[row], self.stale[row] = len(ids) - 1, ids[-1], False
            self.sampler.set(row, generation.sampling, generation.seed, generation.logprobs, len(ids),
                             self.engine.stop_ids)
            self.sampling = None
            self.first_token_due |= generation.events is not None and not decoding

    def chunk_length(self, steps, quiet):
        """One token when a streamed request waits for its first token, when no busy row can keep a
        chunk's later tokens (each has a grammar whose sampler keeps only masked draws), or while the
        batch's multi-token programs are still compiling; up to Engine.long_limit() tokens
        (decode_until_done) when `quiet` (no request waits), no row streams or has a grammar, and one
        still has more than DECODE_CHUNK tokens to make; DECODE_CHUNK otherwise.
        `steps` forces one of the three (the warm-up compiles each)."""
        busy = [g for g in self.rows if g is not None]
        if steps is not None:
            return steps
        if not self.engine.chunked or self.first_token_due or (busy and not any(
                g.matcher is None or self.grammars.candidates(row, g, self.sampler)
                for row, g in enumerate(self.rows) if g is not None)):
            return 1
        # Streamed rows keep DECODE_CHUNK: a long chunk would hold back their text for up to LONGEST_CHUNK
        # tokens. Grammar rows do: their masks are made between chunks.
        long = (quiet and self.decode_long is not None and all(g.events is None and g.matcher is None for g in busy)
                and max((g.max_tokens - len(g.ids) for g in busy), default=0) > DECODE_CHUNK)
        return LONG_CHUNK if long else DECODE_CHUNK

    def step(self, window=None, steps=None, quiet=False):
        with WORKER_CLOCK.part("dispatch"):
            return self.dispatch(window, steps, quiet)

    def dispatch(self, window, steps, quiet):
        """Decodes a chunk (chunk_length) in every row and hands each generation its own tokens: those of
        the chunk before, when this one could be dispatched ahead of reading them. A one-token or a long
        chunk needs the tokens before it first (for the first token's event, or how far each row has got)
        and is read as soon as it is made, as is a chunk with grammar rows (their next masks)."""
        engine = self.engine
        if self.pending is not None:
            held = set(row for row, g in enumerate(self.rows) if g is not None)
            if held and not held - set(self.ending_rows()):
                return self.settle()  # every row ends in the pending chunk: nothing more to dispatch
            if self.chunk_length(steps, quiet) != DECODE_CHUNK:
                self.settle()
        steps = self.chunk_length(steps, quiet)
        with WORKER_CLOCK.part("grammar"):
            # A grammar row whose last tokens are still on the device (this chunk is dispatched ahead of reading
            # them) draws this chunk's first token without its mask too, checked when it is read (hand_out):
            # its mask needs those tokens, and waiting for them would stop the whole batch. The others' masks
            # are made now.
            masked = self.grammars.fill([None if g is None or self.stale[row] else g for row, g in enumerate(self.rows)])
        unmasked = {row for row, g in enumerate(self.rows) if g is not None and g.matcher is not None and self.stale[row]}
        self.first_token_due = False
        busy = [(row, g) for row, g in enumerate(self.rows) if g is not None]
        for row in self.ending_rows():  # what this chunk makes there is dropped: let it not cost the cheap paths
            if not self.sampler.plain(row):
                self.vacate_settings(row)
        if self.sampling is None:
            self.sampling = [engine.feed(a) for a in (self.slots, *self.sampler.arrays())]
        limit = engine.long_limit() if steps == LONG_CHUNK else steps  # the most tokens this dispatch makes
        if window is None:  # one that holds every row's last position of the dispatch
            window = engine.window_for(max((self.positions[row] for row, _ in busy), default=0) + limit)
        tokens = engine.feed(self.tokens)
        if self.pending is not None and self.stale.any():  # rows that carry on: from the pending chunk's tokens
            tokens = self.next_tokens(self.pending[0], engine.feed(self.stale), tokens)
        inputs = tokens, engine.feed(self.positions)
        looped = steps == LONG_CHUNK or engine.long_makes_chunks(self.size)
        # A grammar row that cannot keep a token drawn without its mask (RowGrammars.candidates) is read, and its
        # next mask made, before the next chunk is dispatched.
        must_read = any(g.matcher is not None and not self.grammars.candidates(row, g, self.sampler) for row, g in busy)
        start, read_now = self.positions.copy(), looped or steps != DECODE_CHUNK or must_read or not engine.dispatch_ahead
        if looped:
            remaining = np.zeros(self.size, np.int32)  # free rows: none
            for row, g in busy:  # a row also ends where the cache does; at its end it still runs one chunk,
                # after which settle() finishes it, as after a short chunk
                remaining[row] = max(1, min(g.max_tokens - len(g.ids), self.length - 1 - self.positions[row]))
            stop_ids = np.full(8, -1, np.int32)  # one shape, whatever the model's stop tokens
            stop_ids[:len(engine.stop_ids)] = sorted(engine.stop_ids)
            started = time.perf_counter()
            ((sampled, logprobs), made), self.cache = self.decode_long(
                engine.values, self.cache, window, LONGEST_CHUNK, self.grammars.inputs(masked), *inputs,
                engine.feed(remaining), engine.feed(stop_ids, replicated=True),
                engine.feed(np.int32(limit), replicated=True), engine.lora_tables, *self.sampling)
            TIMELINE.dispatched("decode_long", sampled)
            with WORKER_CLOCK.part("read"):
                made = int(made)
            long, steps = steps == LONG_CHUNK, made
            if long and steps:  # none when no row is busy (the warm-up's)
                engine.token_seconds = (time.perf_counter() - started) / steps
        else:
            (sampled, logprobs), self.cache = self.decode(engine.values, self.cache, window, steps,
                                                          self.grammars.inputs(masked),
                                                          *inputs, engine.lora_tables, *self.sampling)
            TIMELINE.dispatched("decode", sampled)
        self.positions += steps
        self.stale[:] = True
        previous, self.pending = self.pending, Chunk(sampled, logprobs, busy, start, steps, unmasked, set())
        if previous is not None:
            self.settle(previous)
        if read_now:
            self.settle()

    def settle(self, chunk=None):
        """Reads a dispatched chunk's tokens (by default the pending one's, which then feed no other chunk)
        and hands each generation its own; rows whose generation ends free up."""
        with WORKER_CLOCK.part("settle"):
            self.hand_out(chunk)

    def hand_out(self, chunk):
        engine = self.engine
        if chunk is None:
            chunk, self.pending = self.pending, None
            if chunk is None:
                return
        sampled, logprobs, busy, start, made, unmasked, voided = chunk
        with WORKER_CLOCK.part("read"):
            sampled = np.asarray(sampled)
        if self.pending is None:
            self.tokens = np.where(self.stale, sampled[made - 1], self.tokens)
            self.stale[:] = False
        METRICS.add("grammar_dropped", made * len(voided))
        # Not cancelled meanwhile, nor voided: dispatched ahead after tokens of the chunk before it were dropped.
        busy = [(row, g) for row, g in busy if g.finish_reason is None and row not in voided]
        drawn_from = {row: self.grammars.candidates(row, g, self.sampler) for row, g in busy if g.matcher is not None}
        if any(g.logprobs is not None for _, g in busy) or max(drawn_from.values(), default=0) > 1:
            with WORKER_CLOCK.part("read"):
                logprobs = [np.asarray(a) for a in logprobs]  # fetched only when asked for
        for row, generation in busy:
            for offset in range(made):
                if start[row] + offset >= self.length - 1:  # the cache is full (validation prevents it)
                    generation.finish("length", engine)
                    break
                token = int(sampled[offset, row])
                if (offset or row in unmasked) and row in drawn_from and not self.grammars.keeps_free_draw(
                        generation, drawn_from[row], token, lambda: logprobs[2][offset, row]):
                    self.rewind(row, generation, start[row] + offset)
                    METRICS.add("grammar_dropped", made - offset)
                    break
                alternatives = None if generation.logprobs is None else [a[offset, row] for a in logprobs]
                if generation.accept(token, engine, alternatives, emit=False):
                    break
            if generation.finish_reason is None:
                generation.emit(final=False, engine=engine)
            elif self.rows[row] is generation:
                self.vacate(row)

    def rewind(self, row, generation, position):
        """The rest of a grammar row's chunk is dropped: it decodes on from its last kept token at `position`,
        under its mask (what the cache holds past it is overwritten as it goes). A chunk already dispatched
        after this one carried the row on from the dropped tokens: its tokens there are void."""
        self.positions[row], self.tokens[row] = position, (generation.ids or generation.prompt_ids)[-1]
        if self.pending is not None:
            self.pending.voided.add(row)
            self.stale[row] = False

    def release_cancelled(self):
        """Frees the rows of generations whose clients left, before the next chunk decodes for them."""
        for row, generation in enumerate(self.rows):
            if generation is not None and generation.cancelled:
                generation.finish("cancelled")
                self.vacate(row)

    def vacate(self, row):
        """Frees a row; a free row still decodes, with plain settings (RowSampling.clear)."""
        self.rows[row] = None
        self.vacate_settings(row)

    def vacate_settings(self, row):
        self.sampler.clear(row)
        self.sampling = None

    def fail(self, reason):
        self.pending = None
        for generation in self.taken:
            if generation.finish_reason is None:
                generation.finish(reason)
        self.taken = set()
        self.rows = [None] * self.size


class ResizeFailed(Exception):
    """A batch could not be copied into one of another size; `batch` is the last one that holds the rows."""

    def __init__(self, batch):
        super().__init__("resize failed")
        self.batch = batch


def resized_batch(batch, size):
    """A DecodeBatch's rows in a batch of `size` (the next compiled size at a time): the pending chunk is read
    first, then every held row's cache, position and settings are copied. Growing keeps each row
    where it is; shrinking packs the held rows first. ResizeFailed holds the last batch that has them."""
    batch.settle()
    while batch.size != size:
        neighbours = batch.engine.programs[batch.size].resize
        step = max(neighbours) if size > batch.size else min(neighbours)
        kept = list(range(batch.size)) if step > batch.size else [
            row for row, g in enumerate(batch.rows) if g is not None]
        try:
            batch = copied_batch(batch, step, kept)
        except Exception as e:
            raise ResizeFailed(batch) from e
    METRICS.add("batch_resizes")
    return batch


def copied_batch(batch, size, kept):
    """A batch of `size` whose row i is row kept[i] of `batch` (rows past them free); `batch` is left whole if
    the copy fails. The copy is the new batch's cache: at its peak the device holds the old cache and one new
    one, never a fresh zeroed one besides."""
    index = np.array(kept + [0] * (size - len(kept)), np.int32)
    new = DecodeBatch(batch.engine, size, cache=batch.engine.programs[batch.size].resize[size](batch.cache, index))
    TIMELINE.dispatched("resize")
    for name in ("positions", "tokens", "slots"):
        getattr(new, name)[:len(kept)] = getattr(batch, name)[kept]
    new.sampler.take(batch.sampler, kept)
    new.grammars.take(batch.grammars, kept)
    new.rows[:len(kept)] = [batch.rows[row] for row in kept]
    new.first_token_due, new.taken = batch.first_token_due, batch.taken
    batch.cache = None  # copied whole: that batch is done, and its cache's memory may go before the next copy
    return new
