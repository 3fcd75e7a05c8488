"""The engine's compiled functions: prefill, insert, the decode steps and chunks, sampling and logit
adjustments, the KV cache's shapes and layouts. Each is a module-level function of explicit arguments, so a test
can call any one alone; Engine (engine.py) binds and jits them."""
import collections
import contextlib
import functools
import weakref

import numpy as np

from gemma_lora.interface import CANDIDATES, TOP_LOGPROBS


# The per-row arrays the decode programs take after the adapter slots: sample()'s, then adjust_logits'.
SAMPLE_ARRAYS = ("temperature", "top_k", "top_p", "seeds", "alternatives")
ADJUST_ARRAYS = ("prompt_lengths", "frequency", "presence", "repetition", "min_positions", "stop_ids", "bias_ids",
                 "bias_values")
DECODE_CHUNK = 4  # tokens decoded per dispatch to the device
# ...and, when no request waits for a row, in the smallest batch (see decode_until_done), at least
# LONG_CHUNK and at most LONGEST_CHUNK: as many as the last long dispatch says fit in LONG_CHUNK_SECONDS,
# which is how long a request arriving meanwhile may wait for its row (bench_convoy.py: 0.05 s gave 2.8x).
LONG_CHUNK, LONGEST_CHUNK, LONG_CHUNK_SECONDS = 16, 64, 0.02
# Backends on which a decode step writes each row's new key, value and token as a select over the window,
# not a per-row scatter (see positions_written_by_select).
WRITE_BY_SELECT_ON = ("tpu",)


# The engine's steps are module-level functions of explicit arguments, so a test can call any one
# alone: `model` and its `variables` (whose values come in traced, as `values`), `adapters`
# (AdapterSlots or None), `axes` (each cache leaf's position axis). Engine binds them, jits each
# once, and every shape it will ever be called with is compiled at warm-up.
#
# The KV cache is a tuple with one entry per layer (Gemma 1/2: a [batch, 2, length, heads, head_dim]
# array; Gemma 3: a (key, value) pair). Which axis of each leaf is the position one is read off
# abstract shapes, so no layout is assumed; the prefix-cache pool holds the same leaves cut into
# blocks of positions.
def run_stateless(variables, values, fn):
    """fn() with the model's variables read from `values`, as a jitted function must."""
    import keras
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
        return fn()


def with_adapter(adapters, tables, slot, fn):
    """fn() with the LoRA of adapter slot `slot` added (a per-row index under vmap)."""
    if adapters is None:
        return fn()
    with adapters.rows(tables, slot):
        return fn()


def signature(args):
    """What tells one program's calls apart: each argument's shape and dtype (a container's by its first
    leaf), a static argument by its value. A dispatch computes it, so it is cheap, and as fine as the
    engine's programs need: they differ in batch, window, block or steps, all of which show in those."""
    return tuple(shape_of(a) for a in args)


def shape_of(a):
    while isinstance(a, (list, tuple, dict)) and a:
        a = next(iter(a.values())) if isinstance(a, dict) else a[0]
    if isinstance(a, (list, tuple, dict)):
        return ()
    shape = getattr(a, "shape", None)
    return a if shape is None else (tuple(shape), np.dtype(a.dtype))


class Program:
    """One of the engine's jitted programs, and the executables a ProgramStore loaded for it, by call
    signature: a call runs the loaded executable that matches it, else the jit, whose own caches hold
    what the warm-up compiled (until the server hands those here too: Builder.drop_tracing). A loaded
    executable was never traced in this process: a restart skips tracing, which a warm-up does one
    program at a time (see ProgramStore)."""

    def __init__(self, fn, static_argnums=(), **jit_options):
        import jax
        self.jitted = jax.jit(fn, static_argnums=static_argnums, **jit_options)
        self.static = tuple(static_argnums)
        self.loaded = {}

    def __call__(self, *args):
        if self.loaded:
            executable = self.loaded.get(signature(args))
            if executable is not None:
                return executable(*(a for i, a in enumerate(args) if i not in self.static))
        return self.jitted(*args)

    def lower(self, *args):
        return self.jitted.lower(*args)

    def statics(self, args):
        return {i: args[i] for i in self.static}

    def add(self, executable, statics):
        """Takes a loaded executable for the calls it was compiled for: their dynamic arguments are its
        inputs, the static ones `statics` (position -> value)."""
        dynamic = iter(executable.in_avals[0])
        count = len(statics) + len(executable.in_avals[0])
        self.loaded[signature([statics[i] if i in statics else next(dynamic) for i in range(count)])] = executable


def stacks_its_cache(model):
    """Gemma 1/2: keras-hub keeps every layer's cache in one stacked array."""
    import keras_hub
    return isinstance(model, keras_hub.models.GemmaCausalLM)


def cached_call(model, token_ids, cache, index):
    """keras-hub's `call_with_cache` -> (logits, hidden states, cache), with Gemma 1/2's cache per layer,
    as Gemma 3's already is. keras-hub slices Gemma 1/2's stacked cache and stacks it anew on every call,
    so each decoded token copies the whole cache (gemma_2b, 16 rows over 1,536 positions: 450 MB)."""
    if not stacks_its_cache(model):
        return model.call_with_cache(token_ids, cache, index)
    import keras
    backbone = model.backbone
    x = backbone.token_embedding(token_ids)
    x = x * keras.ops.cast(keras.ops.sqrt(backbone.hidden_dim), x.dtype)
    caches = []
    for layer, layer_cache in zip(backbone.transformer_layers, cache):
        x, layer_cache = layer(x, cache=layer_cache, cache_update_index=index)
        caches.append(layer_cache)
    hidden_states = backbone.layer_norm(x)
    return backbone.token_embedding(hidden_states, reverse=True), hidden_states, tuple(caches)


def build_cache(model, token_ids):
    """keras-hub's prefill: the KV cache of `token_ids` from position 0."""
    import inspect
    if stacks_its_cache(model):
        import keras
        backbone = model.backbone
        shape = (token_ids.shape[0], 2, token_ids.shape[1], backbone.num_key_value_heads, backbone.head_dim)
        empty = tuple(keras.ops.zeros(shape, model.compute_dtype) for _ in backbone.transformer_layers)
        return cached_call(model, token_ids, empty, 0)[2]
    if len(inspect.signature(model._build_cache).parameters) > 1:  # Gemma 3 takes image inputs too
        return model._build_cache(token_ids, None, None, None, None)[1]
    return model._build_cache(token_ids)[1]


def prompt_cache(model, token_ids):
    """A batch's cache as the engine keeps it: (keras-hub's KV cache, the token at each position). The
    tokens are what a row's penalties count (adjust_logits); kept as a cache leaf, every program that
    copies, resizes, pools or windows the KV cache carries them along by the same position axis."""
    return build_cache(model, token_ids), token_ids


CACHE_TEMPLATES = weakref.WeakKeyDictionary()  # model -> (its one-row abstract cache of 8 positions, position axes)


def cache_template(model):
    """A model's abstract cache of one row and 8 positions, and each leaf's position axis: traced once per
    model (each trace runs the model's prefill abstractly, 0.45 s for Gemma 3 270M on a CPU), where an
    engine asks for a dozen shapes on the start-up path. The axes are the ones that grow with the length,
    after the batch axis, which must be the first."""
    if model not in CACHE_TEMPLATES:
        import jax
        import jax.numpy as jnp
        one, two = (jax.eval_shape(functools.partial(prompt_cache, model), jax.ShapeDtypeStruct(size, jnp.int32))
                    for size in ((1, 8), (2, 16)))
        if any(a.shape[0] != 1 or b.shape[0] != 2 for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two))):
            raise ValueError(f"{type(model).__name__}'s cache is not batch-major; serve.py cannot batch it")
        CACHE_TEMPLATES[model] = one, jax.tree.map(
            lambda a, b: next(i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if i and m != n), one, two)
    return CACHE_TEMPLATES[model]


def cache_shapes(model, batch, length):
    import jax
    one, axes = cache_template(model)
    return jax.tree.map(lambda s, axis: jax.ShapeDtypeStruct(
        (batch,) + s.shape[1:axis] + (length,) + s.shape[axis + 1:], s.dtype), one, axes)


def cache_bytes(model, batch, length):
    import jax
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(cache_shapes(model, batch, length)))


def cache_position_axes(model):
    """Each cache leaf's position axis."""
    return cache_template(model)[1]


def prefill(model, variables, adapters, values, token_ids, tables, slot):
    """A prompt block's cache (one row, block positions); positions past the prompt hold padding that
    decoding overwrites before any query can see it."""
    return run_stateless(variables, values, lambda: with_adapter(adapters, tables, slot,
                                                                 lambda: prompt_cache(model, token_ids)))


def prefill_group(model, variables, adapters, values, token_ids, tables, slots):
    """Several prompts in blocks of one length, a row each with its own adapter slot -> a tuple of one-row
    caches, each what `prefill` makes of its row alone (to float rounding). A short block is too few
    rows for the CPU's matrix products to run at speed, so rows prefilled together cost far less than
    one at a time (Gemma 3 270M bfloat16 on 2 CPU cores, 16 prompts in blocks of 64: 3.2 s one by one,
    1.7 s four at a time)."""
    import jax
    rows = range(token_ids.shape[0])
    if adapters is None:  # one batch, no per-row LoRA to trace
        cache = prefill(model, variables, adapters, values, token_ids, tables, 0)
        return tuple(jax.tree.map(lambda c: c[row:row + 1], cache) for row in rows)
    cache = jax.vmap(lambda ids, slot: prefill(model, variables, adapters, values, ids[None], tables, slot))(
        token_ids, slots)
    return tuple(jax.tree.map(lambda c: c[row], cache) for row in rows)


def prefill_after_prefix(model, variables, adapters, values, row_cache, token_ids, start, tables, slot):
    """The cache of a prompt whose first `start` positions are already in `row_cache` (copied from the
    prefix-cache pool; none: an empty_row): keras-hub's cached call writes the rest as one chunk at `start`,
    and its causal mask and RoPE follow that index. The logits are dropped, so XLA never computes them.
    From 0 in an empty row it is `prefill` in a longer row (positions past the block stay zero)."""
    import jax
    kv, history = row_cache

    def run():
        return cached_call(model, token_ids, kv, start)[2]
    kv = run_stateless(variables, values, lambda: with_adapter(adapters, tables, slot, run))
    return kv, jax.lax.dynamic_update_slice_in_dim(history, token_ids, start, axis=1)


def zeros_of(shapes):
    """Zeros of each leaf's shape and dtype: a batch's new cache, or an empty row."""
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def empty_row(model, length):
    """A one-row cache of `length` positions, zeros: where a prompt with no cached prefix is prefilled."""
    return zeros_of(cache_shapes(model, 1, length))


def insert(axes, cache, row_cache, row, by_select=True):
    """Writes a one-row cache into row `row` of a batch's cache: on a mesh as a select, which splits cleanly
    along a sharded batch axis; on one device (not `by_select`) as an update of that row alone. The select
    reads and writes every row's positions up to the row cache's length, once per prompt admitted: gemma_2b in
    a batch of 256 rows, 0.6 GB for a 64-token block and 4.8 GB for a 512-position window, up to 7 ms of a TPU
    v5e's bandwidth each (by arithmetic; a wave of 256 newcomers, up to 1.8 s)."""
    import jax
    import jax.numpy as jnp
    if not by_select:
        return jax.tree.map(lambda big, small: jax.lax.dynamic_update_slice(
            big, small.astype(big.dtype), (row,) + (0,) * (big.ndim - 1)), cache, row_cache)

    def put(big, small, axis):
        region = jax.lax.slice_in_dim(big, 0, small.shape[axis], axis=axis)
        is_row = (jnp.arange(big.shape[0]) == row).reshape((-1,) + (1,) * (big.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(big, jnp.where(is_row, small, region), 0, axis=axis)
    return jax.tree.map(put, cache, row_cache, axes)


@contextlib.contextmanager
def local_attention_in_its_window(model):
    """While tracing a one-token step: each sliding-window layer (Gemma 2's every other layer, five in six
    of Gemma 3's) attends over only the sliding_window_size cache positions its mask lets through, not
    the whole cache with the rest masked off. keras-hub reads every position and masks; the keys and
    values it reads are most of a long decode step (Gemma 3 270M, 8 rows over 1,536 positions)."""
    import jax
    import jax.numpy as jnp
    layers = [layer.attention for layer in getattr(model.backbone, "transformer_layers", [])
              if getattr(getattr(layer, "attention", None), "use_sliding_window_attention", False)]

    def windowed(layer, compute):
        def compute_attention(q, k, v, attention_mask, training=False, cache_update_index=0):
            size, keys = layer.sliding_window_size, k.shape[1]
            if q.shape[1] != 1 or attention_mask is None or keys <= size:
                return compute(q, k, v, attention_mask, training=training, cache_update_index=cache_update_index)
            # The window ends at the token itself (or, early on, starts at 0); keras-hub's band mask over
            # the slice, at the index within it, lets exactly these keys through.
            start = jnp.clip(cache_update_index - size + 1, 0, keys - size)
            k, v = (jax.lax.dynamic_slice_in_dim(a, start, size, axis=1) for a in (k, v))
            attention_mask = jax.lax.dynamic_slice_in_dim(attention_mask, start, size, axis=2)
            return compute(q, k, v, attention_mask, training=training, cache_update_index=cache_update_index - start)
        return compute_attention

    own = [vars(layer).get("_compute_attention") for layer in layers]
    for layer in layers:
        layer._compute_attention = windowed(layer, layer._compute_attention)
    try:
        yield
    finally:
        for layer, compute in zip(layers, own):
            if compute is None:
                del layer._compute_attention  # the class's own again
            else:
                layer._compute_attention = compute


def one_position_axis(inputs, start_indices, updates):
    """The axis along which `ops.slice_update(inputs, start_indices, updates)` writes a single position (its
    start there may be traced, every other start is 0), or None for any other write."""
    differ = [a for a, (n, m) in enumerate(zip(inputs.shape, updates.shape)) if n != m]
    fixed = all(isinstance(start, int) and start == 0 for a, start in enumerate(start_indices) if a not in differ)
    return differ[0] if len(differ) == 1 and updates.shape[differ[0]] == 1 and fixed else None


def write_one_position(array, value, position, axis):
    """`array` with `value` (length 1 along `axis`) at `position` on that axis, as a select over the axis:
    elementwise, so vmapped over rows it stays one pass over the batch's array (see
    positions_written_by_select)."""
    import jax.numpy as jnp
    at = jnp.arange(array.shape[axis]).reshape((-1,) + (1,) * (array.ndim - axis - 1)) == position
    return jnp.where(at, value.astype(array.dtype), array)


@contextlib.contextmanager
def positions_written_by_select(on):
    """While tracing a decode step (`on`): keras-hub's one-position cache writes (`ops.slice_update` of a key or
    value at the row's own index) made as selects over the window. Vmapped over rows, a dynamic update slice is
    a scatter, which XLA's TPU backend makes a loop over the rows, one per layer, key and value: on a v5e that
    loop was most of a 256-row step (gemma_2b, window 160: 36 loops of 256 iterations a token; 39 ms a step
    where the weights' read takes 7.5). The select reads and writes the window once instead."""
    if not on:
        yield
        return
    import keras
    own = keras.ops.slice_update

    def slice_update(inputs, start_indices, updates):
        axis = one_position_axis(inputs, start_indices, updates)
        if axis is None:
            return own(inputs, start_indices, updates)
        return write_one_position(inputs, updates, start_indices[axis], axis)
    keras.ops.slice_update = slice_update
    try:
        yield
    finally:
        keras.ops.slice_update = own


def forward(model, variables, adapters, values, cache, tokens, positions, tables, slots):
    """One token per row, each at its own position and with its own adapter: keras-hub's cached call,
    vmapped over rows so the write index, causal mask and LoRA slot are per row. `cache`: a decode view
    in by_row form, as it returns it."""
    import jax
    select = jax.default_backend() in WRITE_BY_SELECT_ON

    def one_row(row_cache, token, position, slot):
        kv, history = row_cache
        logits, _, kv = with_adapter(adapters, tables, slot, lambda: cached_call(model, token[None, None], kv, position))
        history = write_one_position(history, token, position, 0) if select else history.at[position].set(token)
        return logits[0, 0], (kv, history)
    with local_attention_in_its_window(model), positions_written_by_select(select):
        return run_stateless(variables, values, lambda: jax.vmap(one_row)(cache, tokens, positions, slots))


def sample(logits, positions, temperature, top_k, top_p, seeds, alternatives=None):
    """Per row: the next token (greedy where temperature is 0) and log-probabilities (the token's, and
    the TOP_LOGPROBS most likely with their ids). `alternatives`: how many of those each row wants
    (None: some may). When every row is greedy and wants none, an argmax stands in for the top-k and
    the random draw, which cost more than a small model's step (test model: 40 µs a token for top-k)."""
    import jax
    if alternatives is None:
        return sample_candidates(logits, positions, temperature, top_k, top_p, seeds)
    greedy = ((temperature <= 0) & (alternatives <= 0)).all()
    return jax.lax.cond(greedy, pick_greedy, sample_candidates, logits, positions, temperature, top_k, top_p, seeds)


def pick_greedy(logits, *_):
    """sample_candidates' outputs for rows that are all greedy: the token, its log-probability, and in
    place of the alternatives no one asked for, the token alone."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token_logprob = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
    keep_top = min(TOP_LOGPROBS, CANDIDATES, logits.shape[-1])
    top_logprobs = jnp.full((logits.shape[0], keep_top), -jnp.inf).at[:, 0].set(token_logprob)
    return token, (token_logprob, top_logprobs, jnp.zeros((logits.shape[0], keep_top), jnp.int32).at[:, 0].set(token))


def sample_candidates(logits, positions, temperature, top_k, top_p, seeds):
    """sample() over the CANDIDATES most likely tokens of each row: temperature, top-k, top-p and a
    seeded draw."""
    import jax
    import jax.numpy as jnp
    candidates = min(CANDIDATES, logits.shape[-1])
    logits = logits.astype(jnp.float32)
    # The barrier keeps top_k's outputs from being fused into their users; otherwise XLA's CPU backend
    # lowers top_k to a full sort of the vocabulary, several times the model's own cost.
    top_logits, top_ids = jax.lax.optimization_barrier(jax.lax.top_k(logits, candidates))
    scaled = top_logits / jnp.maximum(temperature, 1e-6)[:, None]
    keep = jnp.arange(candidates)[None, :] < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    # Keyed by (seed, position): a seeded request samples the same tokens whatever it is batched with.
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds, positions)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
    choice = jnp.where(temperature <= 0, 0, choice)
    token = jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    # Log-probabilities of the distribution after temperature (greedy: temperature 1), before top-k/top-p
    # truncation; always computed, so asking for them never compiles anything.
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    top_logprobs_all = top_logits / t - jax.nn.logsumexp(logits / t, axis=-1, keepdims=True)
    token_logprob = jnp.take_along_axis(top_logprobs_all, choice[:, None], axis=-1)[:, 0]
    keep_top = min(TOP_LOGPROBS, candidates)
    return token, (token_logprob, top_logprobs_all[:, :keep_top], top_ids[:, :keep_top])


def adjust_logits(logits, at, history, prompt_lengths, frequency, presence, repetition, min_positions, stop_ids,
                  bias_ids, bias_values):
    """A row's logits for the token after position `at`, adjusted as vLLM's sampler does, in its order:
    `logit_bias` added (bias_ids padded with ids past the vocabulary, which are dropped); the stop ids
    masked while `at` < min_positions (min_tokens); repetition_penalty over every token the row has seen
    (positive logits divided by it, negative ones multiplied); then OpenAI's frequency and presence
    penalties over the tokens it has made: logit - frequency x count - presence x (count > 0). The counts
    come from `history` (the token at each cache position): positions from prompt_lengths up to `at` are
    made, those before are the prompt. Skipped (a cond) when no row asks for any of it."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)

    def adjust(logits):
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, bias_ids].add(bias_values, mode="drop")
        banned = jnp.zeros(logits.shape, bool).at[rows, stop_ids].set(True, mode="drop")
        logits = jnp.where(banned & (at < min_positions)[:, None], -jnp.inf, logits)
        place = jnp.arange(history.shape[1])[None, :]
        # One scatter counts both: a prompt token adds 1, a made one 1 << 16 (a window holds < 65,536).
        weight = jnp.where(place > at[:, None], 0, jnp.where(place >= prompt_lengths[:, None], 1 << 16, 1))
        counts = jnp.zeros(logits.shape, jnp.int32).at[rows, history].add(weight, mode="drop")
        made = (counts >> 16).astype(jnp.float32)
        penalty = repetition[:, None]
        logits = jnp.where(counts > 0, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
        return logits - frequency[:, None] * made - presence[:, None] * (made > 0)
    wanted = adjustments_wanted(at, prompt_lengths, frequency, presence, repetition, min_positions, stop_ids,
                                bias_ids, bias_values)
    return jax.lax.cond(wanted, adjust, lambda logits: logits, logits)


def adjustments_wanted(at, prompt_lengths, frequency, presence, repetition, min_positions, stop_ids, bias_ids,
                       bias_values):
    """Whether any row asks adjust_logits for anything."""
    return ((bias_values != 0).any() | (at < min_positions).any() | (frequency != 0).any() | (presence != 0).any()
            | (repetition != 1).any())


def apply_token_mask(logits, masks):
    """-inf for the tokens a row's grammar forbids: masks is llguidance's [batch, ceil(vocab/32)] int32
    bitmask, bit i of word w allowing token 32w + i (all ones for a free row)."""
    import jax.numpy as jnp
    bits = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(masks.shape[0], -1)[:, :logits.shape[-1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


# The attention kernels XLA's CPU backend transposes for its dots (query [heads, d, head_dim] and output
# [heads, head_dim, d]: heads moved second). It decides those layouts after its loop-invariant code motion,
# which leaves a transpose in the loop as cheap, so a decode loop copied both kernels of every layer on every
# step (Gemma 3 270M: 22.5 MiB a token in int8, 90 in float32); unrolling the chunks did it once per chunk.
LOOP_TRANSPOSED = ("attention/query/kernel", "attention/attention_output/kernel")


def loop_layouts(variables):
    """Each variable's transpose for lay_out_for_loops (None: as it is); on a CPU only, where it was measured."""
    import jax
    cpu = jax.default_backend() == "cpu"
    return [(1, 0, 2) if cpu and v.path.endswith(LOOP_TRANSPOSED) and len(v.shape) == 3 and v.shape[0] > 1 else None
            for v in variables]


def lay_out_for_loops(variables, values, back=False):
    """The values with those kernels transposed as XLA's dots want them, once, before a decode loop; `back`:
    their own shapes again, inside the loop, which XLA then reads as a layout, not a copy. Rolled, a 4-token
    chunk then decodes as fast as unrolled in int8, at a third of the instructions (BENCHMARKS.md)."""
    import jax.numpy as jnp
    return [v if p is None else jnp.transpose(v, np.argsort(p) if back else p)
            for v, p in zip(values, loop_layouts(variables))]


def decode_steps(model, variables, adapters, unroll, values, view, window, offsets, masks, tokens, positions,
                 tables, slots, sampling, laid_out=False):
    """One token per row for each of `offsets` (positions + offset), over a cache `view` of `window`
    positions (by_row) -> (view, last tokens), (tokens, log-probabilities) stacked per step. `laid_out`: `values`
    come through lay_out_for_loops already (a loop around this one did it)."""
    import jax
    import jax.numpy as jnp
    constrained = masks is not None and (masks != -1).any()  # a free row's mask allows everything
    if not laid_out:
        values = lay_out_for_loops(variables, values)

    def step(carry, offset):
        view, tokens = carry
        at = jnp.minimum(positions + offset, window - 1)  # only idle rows get this far
        logits, view = forward(model, variables, adapters, lay_out_for_loops(variables, values, back=True), view,
                               tokens, at, tables, slots)
        adjusting = len(sampling) > len(SAMPLE_ARRAYS)  # a test may call a step with sample()'s arrays alone
        # At the dispatch's first token only: the next mask depends on the token before it. A row's later
        # tokens are drawn free and kept by the host only where the mask could not have changed them.
        masked = masks is not None and constrained & (offset == 0)

        def adjust_mask_sample(logits):
            if adjusting:
                logits = adjust_logits(logits, at, view[1], *sampling[len(SAMPLE_ARRAYS):])
            if masks is not None:  # last: a grammar's mask holds whatever the penalties and biases did
                logits = jax.lax.cond(masked, apply_token_mask, lambda l, _: l, logits, masks)
            return sample(logits, at, *sampling[:len(SAMPLE_ARRAYS)])
        if len(sampling) < len(SAMPLE_ARRAYS):
            tokens, logprobs = adjust_mask_sample(logits)
        else:
            # A batch of greedy rows that adjust nothing, want no alternatives and have no mask to apply (the
            # common case) takes its tokens straight from the logits. Each branch of the steps' separate conds
            # handed the whole [rows, vocabulary] logits on, and on a TPU v5e each cond copied them to and from
            # another layout (gemma_2b at 64 rows: some 0.6 ms a step, by the HLO 1.5 ms at 256 rows).
            temperature, alternatives = (sampling[SAMPLE_ARRAYS.index(name)] for name in ("temperature", "alternatives"))
            plain = ((temperature <= 0) & (alternatives <= 0)).all() & ~jnp.asarray(masked)
            if adjusting:
                plain &= ~adjustments_wanted(at, *sampling[len(SAMPLE_ARRAYS):])
            tokens, logprobs = jax.lax.cond(plain, pick_greedy, adjust_mask_sample, logits)
        return (view, tokens), (tokens, logprobs)
    # `unroll`: XLA lays out the weights and the cache for its dots after it has looked for loop-invariant
    # code. In a loop on a CPU it transposed the query/output kernels on every step (until lay_out_for_loops)
    # and copied each cache leaf twice (until by_row); unrolled, it did each once per chunk, for four times
    # the instructions and twice the compile time. With both, a CPU decodes as fast in loops (Engine).
    return jax.lax.scan(step, (view, tokens), offsets, unroll=unroll)


def by_row(view):
    """A decode view with each row's cache as keras-hub's call takes it, a batch of one (an axis after the
    rows), as the decode loops carry it. Reshaped at every step instead, a loop copied each cache leaf twice
    a token on XLA's CPU backend: the carry and the row's update got layouts that differ in where the axes
    of one lie, and the update was not made in place (Gemma 3 270M float32, 36 leaves, BENCHMARKS.md)."""
    import jax
    kv, history = view
    return jax.tree.map(lambda c: c[:, None], kv), history


def from_rows(view):
    """by_row undone."""
    import jax
    kv, history = view
    return jax.tree.map(lambda c: c[:, 0], kv), history


def window_view(axes, cache, window):
    import jax
    return jax.tree.map(lambda c, axis: jax.lax.slice_in_dim(c, 0, window, axis=axis), cache, axes)


def write_view(axes, cache, view):
    import jax
    return jax.tree.map(lambda c, v, axis: jax.lax.dynamic_update_slice_in_dim(c, v, 0, axis=axis), cache, view, axes)


def decode_chunk(model, variables, adapters, axes, unroll, values, cache, window, steps, masks, tokens, positions,
                 tables, slots, *sampling):
    """`steps` tokens per dispatch (the host pays its per-call cost once every few tokens), attending over
    only the first `window` positions: attention and cache traffic grow with the window, and no row in
    the batch has got further than it yet. Grammar `masks` (all ones for a free row) hold for the
    chunk's first token, before top-k, temperature and top-p, so its draw and log-probabilities are the
    masked distribution's; DecodeBatch.settle keeps a later token only when that mask's draw would have
    been the same token (RowGrammars.keeps_free_draw)."""
    import jax.numpy as jnp
    (view, _), outputs = decode_steps(model, variables, adapters, unroll, values,
                                      by_row(window_view(axes, cache, window)), window, jnp.arange(steps), masks,
                                      tokens, positions, tables, slots, sampling)
    return outputs, write_view(axes, cache, from_rows(view))


def decode_until_done(model, variables, adapters, axes, unroll, values, cache, window, steps, masks, tokens, positions,
                      remaining, stop_ids, limit, tables, slots, *sampling):
    """Up to `limit` tokens (at most `steps`, the size of the outputs) in one dispatch, a token at a time,
    stopping after the token with which the last row ended: sampled one of `stop_ids`, or made its
    `remaining` tokens (0 for a free row). The Engine runs it when no request waits for a row, so a lone
    request pays the per-dispatch cost (the host's, and the weight-layout copies XLA makes once per run of
    a program) once every `limit` tokens instead of every DECODE_CHUNK (Gemma 3 270M float32 on 2 CPU
    cores, batch 1, 16 tokens: 18.7 -> 21.0 tokens/s). `limit` is an input, so the host can size it to the
    model's speed without compiling anything (Engine.long_limit); at a `limit` of 1 or DECODE_CHUNK it
    makes what decode_chunk does, grammar `masks` on the first token included, so the batch that has it
    needs no decode_chunk at all (Engine.long_makes_chunks). `unroll` is there for decode_chunk's
    signature: the one step an iteration makes is traced unrolled (a scan of one step is a loop in the
    loop, which copies the cache at its edges: 10-16% slower).
    -> ((tokens, log-probabilities) per step, the number of steps made), cache."""
    import jax
    import jax.numpy as jnp
    view = by_row(window_view(axes, cache, window))
    values = lay_out_for_loops(variables, values)
    shapes = jax.eval_shape(lambda: decode_steps(model, variables, adapters, True, values, view, window,
                                                 jnp.arange(1), masks, tokens, positions, tables, slots,
                                                 sampling, laid_out=True)[1])
    outputs = jax.tree.map(lambda s: jnp.zeros((steps,) + s.shape[1:], s.dtype), shapes)
    alive = remaining > 0

    def more(carry):
        _, _, made, alive, _ = carry
        return (made < jnp.minimum(limit, steps)) & alive.any()

    def token(carry):
        view, tokens, made, alive, outputs = carry
        (view, tokens), out = decode_steps(model, variables, adapters, True, values, view, window,
                                           made + jnp.arange(1), masks, tokens, positions, tables, slots,
                                           sampling, laid_out=True)
        outputs = jax.tree.map(lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part, made, axis=0),
                               outputs, out)
        stopped = (out[0][:, :, None] == stop_ids[None, None, :]).any(axis=(0, 2))
        alive &= ~stopped & (remaining > made + 1)
        return view, tokens, made + 1, alive, outputs
    view, _, made, _, outputs = jax.lax.while_loop(more, token, (view, tokens, jnp.int32(0), alive, outputs))
    return (outputs, made), write_view(axes, cache, from_rows(view))


def next_tokens(sampled, stale, tokens):
    """The input tokens of a chunk dispatched before the one ahead of it is read: a row's last token
    sampled there, or (not `stale`) the host's, the last prompt token of a row admitted since."""
    import jax.numpy as jnp
    return jnp.where(stale, sampled[-1], tokens)


# A chunk dispatched and not read yet (DecodeBatch.pending): the tokens and log-probabilities on the device, the
# [(row, generation)] it decodes for, each row's position at its start, its steps; the grammar rows whose first
# token it draws without their mask, and the rows whose tokens in it are void (DecodeBatch.rewind).
Chunk = collections.namedtuple("Chunk", "sampled logprobs busy start steps unmasked voided")


def resize_cache(cache, index):
    """A cache whose row i is row index[i] of `cache`: a batch grown or shrunk in place."""
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda c: jnp.take(c, index, axis=0), cache)


def cache_length(cache, axes):
    """The number of positions a cache holds."""
    import jax
    leaf, axis = jax.tree.leaves(cache)[0], jax.tree.leaves(axes)[0]
    return leaf.shape[axis]
