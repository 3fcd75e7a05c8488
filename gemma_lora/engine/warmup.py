"""The warm-up: compiles every program the Engine runs before a request can need it, the smallest batch
first (the server is ready then) and the rest in the background, each part serving as soon as it is compiled."""
import collections
import functools
import os
import threading
import time

import numpy as np

from gemma_lora.engine.batch import RowSampling
from gemma_lora.engine.compilation import XLA_CACHE, abstract
from gemma_lora.engine.programs import DECODE_CHUNK, LONGEST_CHUNK, LONG_CHUNK
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.log import log


# An argument that is another program's output (`pick`: which part of it), for WarmUp.submit.
Output = collections.namedtuple("Output", "program args pick", defaults=(lambda out: out,))


class WarmUpCalls:
    """What a WarmUp compiles, as (name, Program, arguments) calls: each program with the very arguments its
    caller passes (abstract where lowering reads no values), and per part of the warm-up the calls it needs."""

    def __init__(self, engine, prefix):
        self.engine, self.prefix = engine, prefix  # the prefix pool, held back from the Engine meanwhile
        # One arguments object per row length, (block, window), (batch, window, steps) and batch size, and per
        # (program, arguments) one lowering, however often used.
        self.rows, self.prefills, self.decodes, self.caches = {}, {}, {}, {}

    def prefill_calls(self):
        """(name, jitted program, arguments) of what a lone prompt with no cached prefix needs: per window an
        empty row, per block its prefill in the window that holds it."""
        engine = self.engine
        return ([(f"empty row window {window}", *self.row(window)[:2]) for window in engine.length_buckets]
                + [self.prefill_call(block, engine.window_for(block)) for block in engine.prompt_blocks])

    def row(self, length):
        """An Output that stands for a one-row cache of `length` positions, as every prefill hands one over."""
        if length not in self.rows:
            self.rows[length] = Output(self.engine._empty_row, (length,))
        return self.rows[length]

    def prefill_call(self, block, window):
        """A lone prompt's prefill of `block` tokens in a row of `window` positions: from an empty row or after
        a cached prefix, one program."""
        engine = self.engine
        if (block, window) not in self.prefills:
            self.prefills[block, window] = Output(engine._prefill, (
                engine.values, self.row(window), engine.tokens([[engine.bos]], block), np.int32(0),
                engine.lora_tables, np.int32(0)))
        return (f"prefill block {block} in window {window}", *self.prefills[block, window][:2])

    def decode_args(self, batch, window, steps):
        """A decode program's arguments as its DecodeBatch passes them (the cache as an abstract shape and
        layout: lowering reads no values), one object per (batch, window, steps)."""
        if (batch, window, steps) not in self.decodes:
            engine, int32 = self.engine, np.int32
            feed = lambda dtype: engine.feed(np.zeros(batch, dtype))  # noqa: E731
            sampling = [feed(int32)] + [engine.feed(array) for array in RowSampling(batch).arrays()]  # slots first
            cache = self.batch_cache(batch)
            if steps == LONGEST_CHUNK:
                inputs = (engine.open_masks(batch), feed(int32), feed(int32), feed(int32),
                          engine.feed(np.full(8, -1, int32), replicated=True),
                          engine.feed(int32(LONG_CHUNK), replicated=True))
            else:
                inputs = (engine.open_masks(batch), feed(int32), feed(int32))
            self.decodes[batch, window, steps] = (engine.values, cache, window, steps, *inputs, engine.lora_tables,
                                                  *sampling)
        return self.decodes[batch, window, steps]

    def batch_cache(self, batch):
        """A batch's cache as an abstract shape and layout, traced once per batch size (cache_layout runs
        the model's prefill abstractly: on the start-up path, not to be repeated per program)."""
        if batch not in self.caches:
            self.caches[batch] = abstract(*self.engine.cache_layout(batch))
        return self.caches[batch]

    def chunk_calls(self, batch):
        """A batch size's multi-token decodes: DECODE_CHUNK tokens (and on a CPU, in the smallest batch, up
        to LONGEST_CHUNK) a dispatch, over each window, and with dispatch-ahead the next chunk's input tokens."""
        engine, programs = self.engine, self.engine.programs[batch]
        if engine.long_makes_chunks(batch):
            return []  # the long decodes, compiled with the one-token ones (token_calls), make every chunk
        calls = [(f"decode batch {batch} window {window} chunk {DECODE_CHUNK}", programs.decode,
                  self.decode_args(batch, window, DECODE_CHUNK)) for window in engine.length_buckets]
        if programs.decode_long is not None:
            calls += self.long_calls(batch)
        if engine.dispatch_ahead:  # a chunk's input tokens, from the chunk before it still on the device
            sampled = Output(programs.decode, self.decode_args(batch, engine.length_buckets[0], DECODE_CHUNK),
                             lambda out: out[0][0])
            calls.append((f"next tokens batch {batch}", programs.next_tokens,
                          (sampled, engine.feed(np.zeros(batch, bool)), engine.feed(np.zeros(batch, np.int32)))))
        return calls

    def long_calls(self, batch):
        return [(f"decode batch {batch} window {window} long", self.engine.programs[batch].decode_long,
                 self.decode_args(batch, window, LONGEST_CHUNK)) for window in self.engine.length_buckets]

    def token_calls(self, batch):
        """What decodes a token a step, over each window: the one-token decode, or the long decode that makes
        one token as well (Engine.long_makes_chunks)."""
        engine = self.engine
        if engine.long_makes_chunks(batch):
            return self.long_calls(batch)
        return [(f"decode batch {batch} window {window} chunk 1", engine.programs[batch].decode,
                 self.decode_args(batch, window, 1)) for window in engine.length_buckets]

    def batch_calls(self, batch, chunks=True):
        """The programs of one batch size (with `chunks`, its multi-token decodes too) and the copies
        between it and the next smaller size, both ways."""
        engine, int32 = self.engine, np.int32
        programs, cache = engine.programs[batch], self.batch_cache(batch)
        calls = [(f"new cache batch {batch}", programs.new_cache, ())] + self.token_calls(batch)
        calls += self.chunk_calls(batch) if chunks else []
        for length in engine.row_lengths:
            calls.append((f"insert batch {batch} row of {length}", programs.insert, (cache, self.row(length), int32(0))))
        at = engine.batch_buckets.index(batch)
        if at:
            smaller = engine.batch_buckets[at - 1]
            calls += [(f"resize batch {batch} to {smaller}", programs.resize[smaller], (cache, np.zeros(smaller, int32))),
                      (f"resize batch {smaller} to {batch}", engine.programs[smaller].resize[batch],
                       (self.batch_cache(smaller), np.zeros(batch, int32)))]
        return calls

    def group_calls(self):
        engine = self.engine
        return [(f"prefill {size} prompts block {block}", engine._prefill_group,
                 (engine.values, engine.tokens([[engine.bos]] * size, block), engine.lora_tables,
                  engine.feed(np.zeros(size, np.int32), replicated=True)))
                for block, sizes in engine.group_blocks.items() for size in sizes]

    def prefix_calls(self):
        """Per row length a pool write; per window a gather, and a prefill after each prefix length that fits
        (those of the blocks it holds are compiled already, for prompts with no cached prefix)."""
        engine, prefix, calls, int32 = self.engine, self.prefix, [], np.int32
        size, scratch = prefix.block_tokens, prefix.scratch
        for length in engine.row_lengths:
            calls.append((f"pool store row of {length}", prefix.store_program,
                          (prefix.pool, self.row(length), np.zeros(length // size, int32),
                           np.full(length // size, scratch, int32))))
        for window in engine.length_buckets:
            calls.append((f"pool gather window {window}", prefix.gather_program,
                          (prefix.pool, np.full(window // size, scratch, int32))))
            calls += [self.prefill_call(suffix, window) for suffix in engine.prompt_blocks
                      if suffix <= window - size and engine.window_for(suffix) != window]
        return calls

    def adapter_calls(self):
        """The slot update adapters are loaded with."""
        slots = self.engine.adapters
        return [] if slots is None else [("adapter slot update", slots._write, self.empty_slot())]

    def empty_slot(self):
        import jax
        slots = self.engine.adapters
        return slots.tables, np.int32(0), slots.put(jax.tree.map(lambda t: np.zeros(t.shape[1:], t.dtype), slots.tables))


class WarmUp:
    """Compiles every program an Engine runs, so requests never compile: per batch size, decode over
    each window (a chunk of DECODE_CHUNK tokens, a single token and, in the smallest batch, up to
    LONG_CHUNK tokens; the first two under grammar masks), an insert for each row length prefills make
    and the copies that grow and shrink a batch to its neighbouring sizes; per window an empty row, per
    prompt block a prefill in the window that holds it, and per block of group_blocks one per group size it
    has; with a prefix cache, per window a gather and a prefill after each prefix length that fits, per row
    length a pool write; with adapters, the slot update.

    first() compiles what the smallest batch needs to answer, a token a step (its one-token decodes,
    inserts and prefills; on a CPU its long decode, which makes its chunks too), and runs each of those
    programs once: the server can answer after it. rest() compiles the other parts, each taking effect in
    the Engine only once all its programs exist (the smallest batch's multi-token decodes where they are
    programs of their own, a batch size in batch_for, the prefix cache, grouped prefills), so a request is
    never routed to a program that is not compiled; the server runs it on a background thread. The
    multi-token decodes are the slowest programs to compile (unrolled, or a loop of chunks): left out of
    first(), they no longer hold back the first answer."""

    def __init__(self, engine, threads=None, store=None):
        self.engine = engine
        self.build = Builder(threads or min(os.cpu_count() or 1, 16), store)
        self.pending = []  # the parts rest() has still to compile, by name (for /health and /metrics)
        self.prefix = engine.prefix  # held back from the Engine until its programs exist
        self.calls = WarmUpCalls(engine, self.prefix)
        self.first_names = []

    @property
    def compiled(self):
        return self.build.compiled

    def run(self):
        """Everything, in this thread."""
        self.first()
        self.rest()

    def first(self):
        engine, started = self.engine, time.time()
        smallest = engine.batch_buckets[0]
        # Where the long decode makes the chunks, compiled here for its single tokens, they serve at once.
        engine.ready_batches, engine.grouping, engine.prefix = [smallest], False, None
        engine.chunked = engine.long_makes_chunks(smallest)
        self.pending = self.parts()
        calls = self.calls
        self.build.run(calls.prefill_calls() + calls.batch_calls(smallest, chunks=False) + calls.adapter_calls())
        self.first_names = list(self.build.order)  # what the server needs to be ready (see Prefetch)
        self.decode(smallest)
        log(f"warm-up: batch {smallest}: decode over windows {','.join(map(str, engine.length_buckets))}"
            f" and prompt blocks {','.join(map(str, engine.prompt_blocks))} in {time.time() - started:.1f}s"
            f" ({self.build.counts()}{'' if engine.chunked else ', a token a step for now'})"
            f"{'; still to compile: ' + ', '.join(self.pending) if self.pending else ''}")
        self.adapter_slots()

    def parts(self):
        """The parts in the order they are compiled and take effect: batch sizes in increasing order (a batch
        grows through each size on its way), then the prefix cache, then grouped prefills."""
        engine = self.engine
        return (([] if engine.chunked else [f"chunks batch {engine.batch_buckets[0]}"])
                + [f"batch {batch}" for batch in engine.batch_buckets[1:]]
                + (["prefix cache"] if self.prefix else []) + (["grouped prefills"] if engine.group_sizes else []))

    def rest(self):
        engine, started = self.engine, time.time()
        smallest = engine.batch_buckets[0]
        work = {f"batch {batch}": functools.partial(self.calls.batch_calls, batch) for batch in engine.batch_buckets}
        work.update({f"chunks batch {smallest}": functools.partial(self.calls.chunk_calls, smallest),
                     "prefix cache": self.calls.prefix_calls, "grouped prefills": self.calls.group_calls})
        effects = {f"batch {batch}": functools.partial(engine.ready_batches.append, batch)
                   for batch in engine.batch_buckets}
        effects.update({f"chunks batch {smallest}": lambda: setattr(engine, "chunked", True),
                        "prefix cache": lambda: setattr(engine, "prefix", self.prefix),
                        "grouped prefills": lambda: setattr(engine, "grouping", True)})
        from concurrent.futures import ThreadPoolExecutor

        def take_effect(queued, wait):  # in order: a batch grows through every smaller size
            while queued and (wait or all(job.done() for job in queued[0][1])):
                part, jobs = queued.pop(0)
                for job in jobs:
                    job.result()
                effects[part]()
                self.pending.remove(part)
                log(f"warm-up: {self.describe(part)} ready after {time.time() - started:.1f}s more")
        parts, queued = list(self.pending), []
        with ThreadPoolExecutor(self.build.threads, thread_name_prefix="warm-up") as pool:
            # Each part is traced and queued while the ones before it compile: the compiler threads stay busy.
            for part in parts:
                queued.append((part, self.build.submit(pool, work[part]())))
                take_effect(queued, wait=False)
            take_effect(queued, wait=True)
        if parts:
            log(f"warm-up: {self.build.counts()}{self.build.times()}")

    def describe(self, part):
        engine = self.engine
        if part == "prefix cache":
            return (f"prefix cache of {self.prefix.blocks} blocks of {self.prefix.block_tokens} tokens "
                    f"({self.prefix.pool_bytes / 2**20:,.1f} MiB)")
        if part == "grouped prefills":
            by_blocks = collections.defaultdict(list)  # sizes formed in the same blocks, said once
            for size in engine.group_sizes:
                blocks = tuple(b for b, sizes in engine.group_blocks.items() if size in sizes)
                if blocks:
                    by_blocks[blocks].append(size)
            return "prefills of " + "; ".join(f"{','.join(map(str, sizes))} prompts at once in blocks "
                                              f"{','.join(map(str, blocks))}" for blocks, sizes in by_blocks.items())
        if part.startswith("chunks"):
            smallest = engine.batch_buckets[0]
            return (f"batch {smallest}'s decodes of {DECODE_CHUNK}"
                    f"{f' and up to {LONGEST_CHUNK}' if engine.programs[smallest].decode_long else ''} tokens a "
                    f"dispatch{', unrolled' if smallest in engine.unrolled else ''}"
                    f"{', dispatched ahead' if engine.dispatch_ahead else ''}")
        return part + " (decode, inserts, the copies to and from the next smaller size)"

    def decode(self, batch):
        """Runs the batch's programs once each (compiled above): a first run can still cost, e.g. the
        device's memory for the cache."""
        engine = self.engine
        # The longest prompt that leaves room for one new token is prefilled in the largest block.
        rows = [Generation([engine.bos] * min(block, engine.max_length - 1), 1, SAMPLER_DEFAULTS["greedy"], 0, [],
                           None) for block in engine.prompt_blocks]
        decoding = engine.generate(rows, batch)
        for window in engine.length_buckets:
            decoding.step(window, 1)
            if engine.chunked:
                for steps in (DECODE_CHUNK,) + ((LONG_CHUNK,) if decoding.decode_long is not None else ()):
                    decoding.step(window, steps)
        if engine.dispatch_ahead and engine.chunked:
            for _ in range(2):  # the second chunk is dispatched ahead of reading the first: next_tokens
                decoding.step(engine.length_buckets[0], DECODE_CHUNK)
            decoding.settle()

    def adapter_slots(self):
        slots = self.engine.adapters
        if slots is None:
            return
        import jax  # run once, on a copy (the tables stay)
        jax.block_until_ready(slots._write(*self.calls.empty_slot()))
        log(f"warm-up: {slots.max_adapters} adapter slots of rank {slots.max_rank} on "
            f"{','.join(slots.modules)}: {slots.slot_bytes / 2**20:,.1f} MiB each")


class Builder:
    """Makes the warm-up's programs exist. Each call (name, Program, arguments) is loaded from the
    ProgramStore when it holds it; else it is lowered here, one at a time (tracing runs Python, under the
    GIL, and briefly patches the model's layers), compiled on a thread pool (XLA's compiler releases the
    GIL) and saved to the store. A compiled program lands in its jit's caches and a loaded one in its
    Program, so the call that runs it later compiles nothing. An Output argument stands for that
    program's output, as an abstract value. Keeps each program's times."""

    def __init__(self, threads, store=None):
        self.threads, self.store = threads, store
        self.compiled = []  # (program, seconds to trace and lower, seconds to compile)
        self.loaded = []  # (program, seconds to load)
        self.lowered = {}  # one lowering per (program, arguments) object, however often used
        self.executables = []  # (program, compiled, static arguments) of each program compiled here
        self.order = []  # every program's name, in the order submitted
        self.tracing = threading.RLock()  # an Output's program is lowered inside its consumer's lowering

    def lower(self, program, args):
        with self.tracing:
            if (id(program), id(args)) not in self.lowered:
                self.lowered[id(program), id(args)] = program.lower(
                    *(a.pick(self.lower(a.program, a.args).out_info) if isinstance(a, Output) else a for a in args))
            return self.lowered[id(program), id(args)]

    def submit(self, pool, calls):
        """Queues each call's loading or compiling on `pool`; returns the futures."""
        jobs = []
        for name, program, args in calls:
            self.order.append(name)
            if self.store is not None and self.store.has(name):
                jobs.append(pool.submit(self.load_one, name, program, args))
            else:
                began = time.time()
                jobs.append(pool.submit(self.compile_one, name, program, args, self.lower(program, args),
                                        time.time() - began))
        return jobs

    def load_one(self, name, program, args):
        began = time.time()
        if self.store.load(name, program):
            self.loaded.append((name, time.time() - began))
        else:  # unreadable (and removed): compiled as on a first start
            began = time.time()
            self.compile_one(name, program, args, self.lower(program, args), time.time() - began)

    def compile_one(self, name, program, args, lowered, trace_seconds):
        began = time.time()
        XLA_CACHE.hit = False
        compiled = lowered.compile()
        self.compiled.append((name, trace_seconds, time.time() - began))
        self.executables.append((program, compiled, program.statics(args)))
        if self.store is not None:
            self.store.save(name, compiled, program.statics(args), from_xla_cache=XLA_CACHE.hit)

    def run(self, calls):
        """Every call's program, before this returns."""
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(self.threads, thread_name_prefix="warm-up") as pool:
            for job in self.submit(pool, calls):
                job.result()

    def drop_tracing(self):
        """Hands each program compiled here to its Program, as a loaded one is kept, and empties the lowerings
        and JAX's caches: what tracing left there, about 5 MiB a program on XLA's CPU backend (Gemma 3 270M
        int8, 23 programs: 106-126 MiB). Only for a process whose every program came from this Builder (the
        server, after its warm-up): anything else jitted would compile again at its next call."""
        import jax
        for program, compiled, statics in self.executables:
            program.add(compiled, statics)
        self.executables, self.lowered = [], {}
        jax.clear_caches()

    def counts(self):
        loaded, compiled, where = len(self.loaded), len(self.compiled), f"compiled on {self.threads} threads"
        if loaded and compiled:
            return f"{loaded + compiled} programs: {loaded} loaded from the program store, {compiled} {where}"
        return f"{loaded + compiled} programs {'loaded from the program store' if loaded else where}"

    def times(self):
        parts = []
        if self.compiled:
            slowest = max(self.compiled, key=lambda c: c[2])
            parts.append(f"{sum(c for _, _, c in self.compiled):.1f}s of compiling, "
                         f"{sum(t for _, t, _ in self.compiled):.1f}s of tracing; the slowest, {slowest[0]}: "
                         f"{slowest[2]:.1f}s")
        if self.loaded:
            parts.append(f"{sum(t for _, t in self.loaded):.1f}s of loading")
        return f": {'; '.join(parts)}" if parts else ""
