"""Automatic prefix caching in serve.py, and the engine's steps called one by one."""
import concurrent.futures
import contextlib
import json
import queue
import urllib.request

import numpy as np
import pytest

import serve
from conftest import SERVE_FLAGS, TRANSCENDENTAL_RTOL, http, plain_prefill
from gemma_lora.engine.batch import DecodeBatch
from gemma_lora.engine.compilation import on_compilation
from gemma_lora.engine.engine import Engine, GROUP_BLOCK, GROUP_TOKENS, PREFILL_GROUPS
from gemma_lora.engine.prefix_cache import PrefixCache, gather_blocks, store_blocks
from gemma_lora.engine import programs
from gemma_lora.engine.programs import (DECODE_CHUNK, LONGEST_CHUNK, LONG_CHUNK, by_row, cache_position_axes,
                                        cache_shapes, decode_chunk, forward, from_rows, insert, loop_layouts, prefill,
                                        sample)
from gemma_lora.interface import CANDIDATES, Generation, SAMPLER_DEFAULTS, release_all
from gemma_lora.model import load_model
from gemma_lora.tokens import grammar_tokenizer

# ----------------------------------------------------------------------------- steps alone


@pytest.mark.device
def test_sample_on_hand_made_logits():
    logits = np.log(np.array([[0.1, 0.6, 0.3, 1e-9], [0.25, 0.25, 0.4, 0.1]], np.float32))
    n = len(logits)
    token, (logprob, top_logprobs, top_ids) = sample(
        logits, np.zeros(n, np.int32), np.zeros(n, np.float32), np.full(n, 128, np.int32), np.ones(n, np.float32),
        np.zeros(n, np.uint32))
    assert token.tolist() == [1, 2]  # greedy: the most likely
    np.testing.assert_allclose(logprob, np.log([0.6, 0.4]), rtol=TRANSCENDENTAL_RTOL)
    assert top_ids[:, :2].tolist() == [[1, 2], [2, 0]] or top_ids[:, :2].tolist() == [[1, 2], [2, 1]]
    np.testing.assert_allclose(top_logprobs[0, :3], np.log([0.6, 0.3, 0.1]), rtol=TRANSCENDENTAL_RTOL)
    # All rows greedy, none wanting alternatives: an argmax, with the same token and log-probability.
    args = (logits, np.zeros(n, np.int32), np.zeros(n, np.float32), np.full(n, 128, np.int32), np.ones(n, np.float32),
            np.zeros(n, np.uint32))
    alone, (alone_logprob, alone_top, alone_ids) = sample(*args, np.zeros(n, np.int32))
    assert alone.tolist() == [1, 2] and alone_ids[:, 0].tolist() == [1, 2]
    np.testing.assert_allclose(alone_logprob, logprob, rtol=TRANSCENDENTAL_RTOL / 10)
    assert np.isneginf(alone_top[:, 1:]).all()
    _, (_, asked_top, asked_ids) = sample(*args, np.array([0, 3], np.int32))  # one row wants 3 alternatives
    assert asked_ids.tolist() == top_ids.tolist()
    np.testing.assert_allclose(asked_top, top_logprobs, rtol=1e-6)
    # top_k 1 makes sampling greedy whatever the temperature; top_p keeps just the head of the distribution.
    for top_k, top_p in ((1, 1.0), (128, 0.5)):
        sampled, _ = sample(logits, np.arange(n, dtype=np.int32), np.ones(n, np.float32),
                            np.full(n, top_k, np.int32), np.full(n, top_p, np.float32),
                            np.arange(n, dtype=np.uint32))
        assert sampled.tolist() == [1, 2]


@pytest.mark.device
def test_greedy_rows_wanting_no_alternatives_decode_as_those_that_want_them(engine):
    # logprobs=0 (the token's only) takes the argmax path; 3 alternatives take the top-k path.
    prompt = [engine.bos] + list(range(420, 437))
    plain, asked = (Generation(prompt, 12, SAMPLER_DEFAULTS["greedy"], 0, [], None, logprobs=k)
                    for k in (0, 3))
    for g in (plain, asked):
        without_prefix_cache(engine, lambda: engine.generate([g], 1))
    assert plain.ids == asked.ids and len(plain.ids) == 12
    np.testing.assert_allclose([p for _, p, _ in plain.token_logprobs], [p for _, p, _ in asked.token_logprobs],
                               atol=1e-5)
    assert all(top == [] for _, _, top in plain.token_logprobs)
    assert all(len(top) == 3 for _, _, top in asked.token_logprobs)


@pytest.mark.device
def test_once_a_sampled_row_frees_a_greedy_batch_takes_the_argmax_path(engine):
    """The argmax path runs when every row of the batch, free rows included, is greedy and wants no
    alternatives: a finished sampled request must not leave its settings in its row."""
    programs, tops = engine.programs[2], []

    def decode(*args):  # records each chunk's alternatives: the argmax path leaves them -inf
        (sampled, logprobs), cache = programs.decode(*args)
        tops.append(np.asarray(logprobs[1]))
        return (sampled, logprobs), cache
    engine.programs[2] = programs._replace(decode=decode)
    try:
        sampled = Generation([engine.bos] + list(range(610, 625)), 4,
                             {"temperature": 0.9, "top_k": 40, "top_p": 0.9}, 5, [], None, logprobs=3)
        greedy = Generation([engine.bos] + list(range(640, 655)), 16, SAMPLER_DEFAULTS["greedy"], 0, [],
                            None, logprobs=0)
        without_prefix_cache(engine, lambda: engine.generate([sampled, greedy], 2))
    finally:
        engine.programs[2] = programs
    assert len(sampled.ids) == 4 and len(greedy.ids) == 16 and len(tops) == 4
    assert np.isfinite(tops[0][..., 1]).all()  # the sampled row's chunk: the top-k path, for both rows
    assert all(np.isneginf(top[..., 1:]).all() for top in tops[1:])


@pytest.mark.device
@pytest.mark.parametrize("by_select", [True, False])  # on a mesh; on one device, the row alone updated
def test_insert_writes_one_row_of_a_hand_made_cache(by_select):
    rng = np.random.default_rng(0)
    cache = (rng.standard_normal((3, 8, 1, 2)).astype(np.float32),  # Gemma 3: (batch, length, …)
             rng.standard_normal((3, 2, 8, 1, 2)).astype(np.float32))  # Gemma 1/2: (batch, 2, length, …)
    row = (np.ones((1, 4, 1, 2), np.float32), np.full((1, 2, 4, 1, 2), 2.0, np.float32))
    out = [np.asarray(a) for a in insert((1, 2), cache, row, np.int32(1), by_select=by_select)]
    assert (out[0][1, :4] == 1).all() and (out[1][1, :, :4] == 2).all()
    np.testing.assert_array_equal(out[0][[0, 2]], cache[0][[0, 2]])  # the other rows, and the row's later positions
    np.testing.assert_array_equal(out[1][[0, 2]], cache[1][[0, 2]])
    np.testing.assert_array_equal(out[0][1, 4:], cache[0][1, 4:])
    np.testing.assert_array_equal(out[1][1, :, 4:], cache[1][1, :, 4:])


def decode_row_by_row_against_the_whole_sequence(model, length=16, starts=(3, 6)):
    """Prefills two rows to different positions, inserts them into one batch cache and decodes token by
    token with forward(): every step's logits must be keras-hub's own full-sequence call. Returns the
    batch cache and what the decode needs to go on."""
    import jax
    backbone = model.backbone
    ids = np.random.default_rng(0).integers(1, 64, (2, 14)).astype(np.int32)
    hidden = backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    expected = np.asarray(backbone.token_embedding(hidden, reverse=True))
    variables = model.variables
    values = [v.value for v in variables]
    rows = [prefill(model, variables, None, values, ids[i:i + 1, :start], {}, np.int32(0))
            for i, start in enumerate(starts)]
    cache = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), cache_shapes(model, 2, length))
    axes = cache_position_axes(model)
    for i, row in enumerate(rows):
        cache = insert(axes, cache, row, i)
    positions = np.array(starts, np.int32)
    for _ in range(14 - max(starts)):
        tokens = ids[[0, 1], positions]
        logits, view = forward(model, variables, None, values, by_row(cache), tokens, positions, {},
                               np.zeros(2, np.int32))
        cache = from_rows(view)
        np.testing.assert_allclose(np.asarray(logits), expected[[0, 1], positions], atol=1e-5)
        positions = positions + 1
    return cache, axes, ids[[0, 1], positions - 1], variables, values


def tiny_gemma3_with_local_layers():
    """A random Gemma 3 of 6 layers, the first 5 local (a window of 4) and one KV head, as Gemma 3 270M's."""
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=64, image_size=16, num_layers=6, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32, head_dim=8, use_sliding_window_attention=True, sliding_window_size=4, dtype="float32")
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.device
def test_decode_with_local_layers_attending_their_window_equals_keras_hub_over_the_whole_sequence():
    """forward() reads only a sliding-window layer's window of the cache; the logits must be keras-hub's
    own full-sequence call, for rows at different positions in one batch, before and past the window."""
    model = tiny_gemma3_with_local_layers()
    backbone = model.backbone
    assert [layer.attention.use_sliding_window_attention for layer in backbone.transformer_layers] == [True] * 5 + [False]
    length, starts = 16, (3, 6)  # row 0 begins inside the window, row 1 past it
    cache, axes, tokens, variables, values = decode_row_by_row_against_the_whole_sequence(model, length, starts)
    assert "_compute_attention" not in vars(backbone.transformer_layers[0].attention)  # the class's own again
    # A decode chunk unrolled (what large models get) samples what the looped one does.
    sampling = (np.zeros(2, np.float32), np.full(2, 128, np.int32), np.ones(2, np.float32), np.zeros(2, np.uint32))
    chunks = [decode_chunk(model, variables, None, axes, unroll, values, cache, length, 2, None, tokens,
                           np.array(starts, np.int32), {}, np.zeros(2, np.int32), *sampling)[0]
              for unroll in (False, True)]
    (looped, looped_logprobs), (unrolled, unrolled_logprobs) = chunks
    assert np.asarray(looped).tolist() == np.asarray(unrolled).tolist()
    np.testing.assert_allclose(np.asarray(looped_logprobs[0]), np.asarray(unrolled_logprobs[0]), atol=1e-5)
    # On a CPU the loop read both attention kernels of every layer laid out for XLA's dots (lay_out_for_loops).
    import collections
    import jax
    laid_out = collections.Counter(v.path.split("/")[-2] for v, p in zip(variables, loop_layouts(variables)) if p)
    assert laid_out == ({"query": 6, "attention_output": 6} if jax.default_backend() == "cpu" else {})


def test_a_decode_loop_on_a_cpu_copies_no_cache_leaf():
    """The decode loops carry each row's cache as keras-hub's call takes it (by_row). Reshaped at every step
    instead, XLA's CPU backend copied every cache leaf twice a token in the loop's body (issue #35): no
    array of a cache leaf's shape may be copied there (before and after the loop, once a chunk, is allowed)."""
    import functools
    import re
    import jax
    model = tiny_gemma3_with_local_layers()
    variables = model.variables
    cache = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), cache_shapes(model, 2, 16))
    leaf = jax.tree.leaves(cache[0])[0].shape  # (2, 16, 1, 8): rows, positions, heads, dim
    sampling = (np.zeros(2, np.float32), np.full(2, 64, np.int32), np.ones(2, np.float32), np.zeros(2, np.uint32))
    chunk = jax.jit(functools.partial(decode_chunk, model, variables, None, cache_position_axes(model),
                                      False), static_argnums=(2, 3), donate_argnums=(1,))  # as the Engine's
    text = chunk.lower([v.value for v in variables], cache, 16, 4, None, np.zeros(2, np.int32),
                       np.array([3, 6], np.int32), {}, np.zeros(2, np.int32), *sampling).compile().as_text()
    computations = {block.split(" ", 1)[0].lstrip("%"): block for block in re.split(r"\n(?=\S)", text)}
    bodies = [computations[name] for name in re.findall(r" while\(.*?body=%([\w.\-]+)", text)]
    assert bodies  # a loop, not unrolled
    # A copy in the body, or a fusion of one (XLA wraps a lone copy in a computation of its own).
    copied = [tuple(int(d) for d in dims.split(",") if d != "1") for body in bodies
              for dims in re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} (?:copy\(|fusion\(.*calls=%wrapped_copy)", body)]
    assert tuple(d for d in leaf if d != 1) not in copied


def tiny_gemma(family):
    """A random Gemma 1 (or 2: logit soft-caps, post-norms and every other layer local) of 4 layers."""
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    gemma2 = dict(query_head_dim_normalize=False, use_post_ffw_norm=True, use_post_attention_norm=True,
                  final_logit_soft_cap=30.0, attention_logit_soft_cap=50.0, use_sliding_window_attention=True,
                  sliding_window_size=4)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=4, num_query_heads=2, num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
        head_dim=8, dtype="float32", **(gemma2 if family == "gemma2" else {}))
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.device
@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_gemma_1_and_2_decode_over_a_cache_per_layer_as_keras_hub_computes_the_sequence(family):
    """keras-hub stacks Gemma 1/2's layers into one cache array; the engine keeps one per layer (no
    restacking per token). Gemma 2 adds logit soft-caps, post-norms and local layers (every other one)."""
    model = tiny_gemma(family)
    shapes, tokens = cache_shapes(model, 2, 16)
    assert isinstance(shapes, tuple) and [s.shape for s in shapes] == [(2, 2, 16, 1, 8)] * 4
    assert tokens.shape == (2, 16)  # the token at each position, beside the cache (for penalties)
    decode_row_by_row_against_the_whole_sequence(model)


@pytest.mark.device
@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_a_decode_step_writing_by_select_decodes_as_the_scatter_does(family, monkeypatch):
    """On a TPU a decode step writes each row's new key, value and token as a select over the window (issue #48:
    vmapped, the scatter was a loop over the rows there). Both ways every step's logits are keras-hub's over
    the whole sequence and the caches are equal; the select's step scatters nothing, and keras' own
    slice_update is back after tracing it."""
    import jax
    import keras
    own = keras.ops.slice_update
    caches, scatters = {}, {}
    for select in (False, True):
        monkeypatch.setattr(programs, "WRITE_BY_SELECT_ON", (jax.default_backend(),) if select else ())
        model = tiny_gemma3_with_local_layers() if family == "gemma3" else tiny_gemma(family)
        cache, _, tokens, variables, values = decode_row_by_row_against_the_whole_sequence(model)
        caches[select] = cache
        step = jax.make_jaxpr(lambda c: forward(model, variables, None, values, by_row(c), tokens,
                                                np.array([7, 9], np.int32), {}, np.zeros(2, np.int32)))(cache)
        scatters[select] = str(step).count("scatter")
    assert keras.ops.slice_update is own
    jax.tree.map(np.testing.assert_array_equal, caches[False], caches[True])
    assert scatters[True] == 0 and scatters[False] > 0


@pytest.mark.parametrize("axis, shape", [(1, (1, 32, 2, 3)),           # Gemma 3: per-layer (batch, length, heads, dim)
                                         (2, (1, 2, 32, 1, 3))])       # Gemma 1/2: per-layer (batch, 2, length, …)
@pytest.mark.device
def test_pool_blocks_store_and_gather_back_exactly(axis, shape):
    rng = np.random.default_rng(0)
    row = rng.standard_normal(shape).astype(np.float32)
    block = 8
    pool_shape = (5,) + shape[1:axis] + (block,) + shape[axis + 1:]  # 4 blocks + scratch
    pool = np.zeros(pool_shape, np.float32)
    # Row blocks 0, 1, 2 into pool blocks 3, 0, 2; the fourth pair writes to the scratch block (4).
    pool = store_blocks(axis, pool, row, np.array([0, 1, 2, 0]), np.array([3, 0, 2, 4]))
    gathered = np.asarray(gather_blocks(axis, pool, np.array([3, 0, 2, 4])))
    assert gathered.shape == shape
    np.testing.assert_array_equal(np.take(gathered, range(24), axis=axis), np.take(row, range(24), axis=axis))


@pytest.mark.device
def test_hash_chains_match_whole_blocks_of_the_same_tokens_and_adapter():
    cache = PrefixCache(blocks=8, block_tokens=4)
    ids = list(range(100, 111))  # 11 tokens: 2 full blocks
    keys = cache.keys(ids, adapter=0)
    assert len(keys) == 2 and cache.match(keys) == []
    written = cache.allocate(keys)
    assert [index for index, _ in written] == [0, 1]
    cache.release([b for _, b in written])
    assert cache.match(cache.keys(ids[:8] + [7, 7, 7, 7], 0)) == [b for _, b in written]  # shares both blocks
    assert cache.match(cache.keys(ids[:6], 0)) == [written[0][1]]  # a partial block is never matched
    assert cache.match(cache.keys([99] + ids[1:], 0)) == []  # a change early breaks the whole chain
    assert cache.match(cache.keys(ids, adapter=3)) == []  # another adapter's K/V are other K/V
    assert cache.allocate(keys) == []  # cached already: nothing to write


@pytest.mark.device
def test_one_prompt_longer_than_the_pool_never_gets_a_block_twice():
    cache = PrefixCache(blocks=3, block_tokens=2)
    written = cache.allocate(cache.keys(list(range(10)), 0))  # 5 blocks into a pool of 3
    blocks = [b for _, b in written]
    assert len(set(blocks)) == len(blocks) == 3
    assert cache.allocate(cache.keys([50, 51], 0)) == []  # all three held by that prompt
    cache.release(blocks)
    assert len(cache.allocate(cache.keys([50, 51], 0))) == 1


@pytest.mark.device
def test_eviction_takes_the_least_recently_used_and_never_a_held_block():
    cache = PrefixCache(blocks=3, block_tokens=2)
    a, b, c, d = ([i, i] for i in (1, 2, 3, 4))
    blocks = {name: cache.allocate(cache.keys(ids, 0))[0][1] for name, ids in (("a", a), ("b", b), ("c", c))}
    cache.release([blocks["b"], blocks["c"]])  # their requests ended; a's still runs
    cache.match(cache.keys(b, 0))  # b is now more recently used than c
    [(_, reused)] = cache.allocate(cache.keys(d, 0))  # full: evicts c (a is held, b was used later)
    assert reused == blocks["c"] and cache.match(cache.keys(c, 0)) == []
    assert cache.match(cache.keys(a, 0)) == [blocks["a"]]
    cache.hold([blocks["b"]])  # d's request still holds its block too
    assert cache.allocate(cache.keys([9, 9], 0)) == []  # every block held: nothing stored, nothing broken
    cache.release([blocks["a"]])
    assert cache.allocate(cache.keys([9, 9], 0)) == [(0, blocks["a"])]


@pytest.fixture(scope="module")
def engine(trained_model):
    model, _, _ = load_model(serve.parse_args(["--model", str(trained_model)]))
    engine = Engine(model, [1, 2], [64, 128], None, prefix_blocks=16, block_tokens=16)
    engine.long_chunk_seconds = 0  # long dispatches of LONG_CHUNK tokens, whatever the machine's speed
    engine.group_limits[2] = 64  # pairs in every block, as on an accelerator (a CPU pairs in blocks of 16 only)
    if engine.programs[1].decode_long is None:  # off a CPU they are not built by default, but still checked
        engine.programs[1] = engine.batch_programs(1, long=True)
    return engine


def greedy_rows(engine, prompts, max_tokens=8):
    rows = [Generation(p, max_tokens, SAMPLER_DEFAULTS["greedy"], 0, [], None, logprobs=0)
            for p in prompts]
    engine.generate(rows, len(rows))
    return rows


@pytest.mark.device
def test_a_cached_prefix_gives_the_same_cache_and_tokens_as_computing_it(engine):
    prompt = [engine.bos] + list(range(40, 80))  # 41 tokens: 2 full blocks of 16
    first, = greedy_rows(engine, [prompt])
    assert first.cached_tokens == 0 and engine.prefix.used() == 2
    again, = greedy_rows(engine, [prompt])
    assert again.cached_tokens == 32  # both full blocks; the last 9 tokens are computed
    assert again.ids == first.ids
    np.testing.assert_allclose([lp for _, lp, _ in again.token_logprobs], [lp for _, lp, _ in first.token_logprobs],
                               atol=1e-4)
    row = Generation(prompt, 1, SAMPLER_DEFAULTS["greedy"], 0, [], None)
    cached_row, start = engine.prefills.row(row)
    plain = plain_prefill(engine, prompt, 64)
    assert start == 32
    import jax
    for c, p, axis in zip(jax.tree.leaves(cached_row), jax.tree.leaves(plain), jax.tree.leaves(engine.axes)):
        np.testing.assert_allclose(np.take(c, range(41), axis), np.take(p, range(41), axis), atol=1e-5)
    release_all([row])


@contextlib.contextmanager
def counting(engine, name):
    """Counts the calls of one of the engine's programs: yields the list they go into."""
    calls, program = [], getattr(engine, name)

    def counted(*args):
        calls.append(args)
        return program(*args)
    setattr(engine, name, counted)
    try:
        yield calls
    finally:
        setattr(engine, name, program)


def without_prefix_cache(engine, fn):
    saved, engine.prefix = engine.prefix, None
    try:
        return fn()
    finally:
        engine.prefix = saved


@pytest.mark.parametrize("sampling, seed", [(SAMPLER_DEFAULTS["greedy"], 0),
                                            ({"temperature": 0.9, "top_k": 40, "top_p": 0.9}, 11)])
@pytest.mark.device
def test_prompts_admitted_together_are_prefilled_as_a_group_and_answer_as_alone(engine, sampling, seed):
    # Both in 32-token blocks, and new to the pool (a prompt with a cached prefix is prefilled after it).
    prompts = [[engine.bos] + list(range(start + seed, start + seed + 20)) for start in (800, 900)]
    together = [Generation(p, 12, sampling, seed, [], None, logprobs=3) for p in prompts]
    with counting(engine, "_prefill_group") as groups:
        engine.generate(together, 2)
    assert len(groups) == 1 and groups[0][1].shape == (2, 32)  # one dispatch for both prompts
    release_all(together)
    for prompt, grouped in zip(prompts, together):
        alone = Generation(prompt, 12, sampling, seed, [], None, logprobs=3)
        without_prefix_cache(engine, lambda: engine.generate([alone], 1))
        assert grouped.ids == alone.ids and len(alone.ids) == 12
        for (t1, lp1, top1), (t2, lp2, top2) in zip(grouped.token_logprobs, alone.token_logprobs):
            assert t1 == t2 and [i for i, _ in top1] == [i for i, _ in top2]
            np.testing.assert_allclose([lp1] + [p for _, p in top1], [lp2] + [p for _, p in top2], atol=1e-5)


@pytest.mark.device
def test_a_group_prefills_what_each_prompt_gets_alone_and_a_shared_prefix_waits_for_the_pool(engine):
    """Three prompts admitted together: two fresh ones of one block go in a group; a third that begins
    with the first one's two full blocks is prefilled after the group, from the pool."""
    first = [engine.bos] + list(range(1000, 1040))  # 41 tokens: 2 full blocks, a 64-token block
    other = [engine.bos] + list(range(1100, 1145))
    sharing = first[:32] + list(range(1200, 1215))
    rows = [Generation(p, 1, SAMPLER_DEFAULTS["greedy"], 0, [], None) for p in (first, other, sharing)]
    with counting(engine, "_prefill_group") as groups:
        caches = engine.prefills.rows(rows)
    assert len(groups) == 1 and groups[0][1].shape == (2, 64)
    assert [start for _, start in caches] == [0, 0, 32]
    import jax
    for prompt, (cache, _) in zip((first, other, sharing), caches):
        plain = plain_prefill(engine, prompt, 64)
        for c, p, axis in zip(jax.tree.leaves(cache), jax.tree.leaves(plain), jax.tree.leaves(engine.axes)):
            assert c.shape == p.shape
            np.testing.assert_allclose(np.take(c, range(len(prompt)), axis), np.take(p, range(len(prompt)), axis),
                                       atol=1e-5)
    release_all(rows)


# ----------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def nocache_server(trained_model, start_server):
    return start_server(trained_model, *SERVE_FLAGS, "--prefix-cache-blocks", "0")


@pytest.fixture(scope="module")
def small_pool_server(trained_model, start_server):
    """A pool of 6 blocks: every long prompt evicts the last one's."""
    return start_server(trained_model, *SERVE_FLAGS, "--prefix-cache-blocks", "6")


SYSTEM = "You answer questions about rivers, canals and the towns along them, briefly and kindly. " * 3
QUESTIONS = ["Name a fruit.", "What is 2 plus 2?", "Spell 'plum' backwards.", "Say hi.", "Name a colour."]


def ask(server, question, system=SYSTEM, **extra):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, "logprobs": True} | extra
    status, answer, _ = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 200, answer
    return answer


def same_answer(a, b):
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    np.testing.assert_allclose([t["logprob"] for t in a["choices"][0]["logprobs"]["content"]],
                               [t["logprob"] for t in b["choices"][0]["logprobs"]["content"]], atol=1e-4)


def test_cache_on_and_off_answer_alike_and_usage_counts_cached_tokens(tiny_server, nocache_server):
    compiled = tiny_server.metric("serve_compilations_total")
    cached_before = tiny_server.metric("serve_cached_prompt_tokens_total")
    reference = [ask(nocache_server, q) for q in QUESTIONS]
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in reference)
    first = ask(tiny_server, QUESTIONS[0])
    # The system prompt's blocks are reused by every later question, alone and in a batch.
    alone = [ask(tiny_server, q) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        batched = list(pool.map(lambda q: ask(tiny_server, q), QUESTIONS))
    for got in (alone, batched):
        for answer, want in zip(got, reference):
            same_answer(answer, want)
            details = answer["usage"]["prompt_tokens_details"]
            assert details["cached_tokens"] >= answer["usage"]["prompt_tokens"] - 30, answer["usage"]
    same_answer(first, reference[0])
    assert tiny_server.metric("serve_cached_prompt_tokens_total") > cached_before
    assert tiny_server.metric("serve_compilations_total") == compiled
    text = http("GET", tiny_server.url + "/metrics")[1]
    assert "serve_prefix_cache_bytes " in text and 'serve_prefix_cache_blocks{state="used"}' in text
    assert tiny_server.metric("serve_prefix_cache_bytes") > 0
    assert "prefix cache of" in tiny_server.output()


def test_streaming_and_completions_hit_the_cache_with_the_same_text(tiny_server, nocache_server):
    prompt = "Instruction:\n" + SYSTEM + "\n\nResponse:\n"
    for _ in range(2):  # the second time from the cache
        request = urllib.request.Request(tiny_server.url + "/v1/completions", method="POST", headers={
            "Content-Type": "application/json"}, data=json.dumps({
                "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            chunks = [json.loads(e[6:]) for e in response.read().decode().split("\n\n") if e and e != "data: [DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    plain = http("POST", nocache_server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                  "temperature": 0})[1]
    assert text == plain["choices"][0]["text"]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "cached=" in tiny_server.output()


def test_a_small_pool_evicts_and_keeps_answering_alike(small_pool_server, nocache_server):
    systems = [f"Context {i}: " + SYSTEM for i in range(4)]  # 7 blocks each: the pool holds at most one
    for _ in range(2):
        for system in systems:
            same_answer(ask(small_pool_server, "Say hi.", system), ask(nocache_server, "Say hi.", system))
    assert small_pool_server.metric("serve_prefix_cache_blocks", labels='state="used"') <= 6
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # held blocks and a full pool under load
        answers = list(pool.map(lambda i: ask(small_pool_server, QUESTIONS[i % 5], systems[i % 4]), range(8)))
    for i, answer in enumerate(answers):
        same_answer(answer, ask(nocache_server, QUESTIONS[i % 5], systems[i % 4]))


def test_adapters_never_share_cached_blocks_with_the_base(adapter_server):
    prompt = "<start_of_turn>user\nQuestion 9: is the sky blue today?<end_of_turn>\n<start_of_turn>model\n"

    def complete(model=None):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
        status, answer, _ = http("POST", adapter_server.url + "/v1/completions", body | ({"model": model} if model else {}))
        assert status == 200, answer
        return answer
    base = complete()
    yes = complete("yes")  # the base computed these blocks, but the adapter changes K and V
    assert yes["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    yes_again, base_again = complete("yes"), complete()
    assert yes_again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for a, b in ((yes, yes_again), (base, base_again)):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        np.testing.assert_allclose(a["choices"][0]["logprobs"]["token_logprobs"],
                                   b["choices"][0]["logprobs"]["token_logprobs"], atol=1e-4)
    assert yes["choices"][0]["text"] != base["choices"][0]["text"]


@pytest.mark.device
def test_near_the_end_of_the_cache_fewer_blocks_are_reused_so_the_rest_fits(engine):
    """Length 128, blocks 16: with 5 blocks (80 tokens) reused, the 45 left would need a 64-token block
    (80 + 64 > 128), so 4 are reused and the rest is one 64-token block."""
    first = [engine.bos] + list(range(100, 189))  # 90 tokens: 5 full blocks stored
    greedy_rows(engine, [first], max_tokens=1)
    second = first[:80] + list(range(300, 345))  # 125 tokens
    [cached] = greedy_rows(engine, [second], max_tokens=2)
    assert cached.cached_tokens == 64
    [plain] = without_prefix_cache(engine, lambda: greedy_rows(engine, [second], max_tokens=2))
    assert cached.ids == plain.ids


@pytest.mark.device
def test_blocks_whose_write_failed_are_forgotten_and_reused():
    cache = PrefixCache(blocks=2, block_tokens=2)
    keys = cache.keys([1, 2, 3, 4], 0)
    written = [b for _, b in cache.allocate(keys)]
    cache.forget(written)  # the pool write raised: these keys must not match KV that was never stored
    assert cache.match(keys) == [] and cache.used() == 0
    cache.release(written)
    assert sorted(b for _, b in cache.allocate(cache.keys([5, 6, 7, 8], 0))) == sorted(written)


# ----------------------------------------------------------------------------- long chunks (no one waits)

def decode_alone(engine, generation, steps=None, batch=1):
    """Decodes one generation alone in a batch of `batch`, every chunk `steps` long (None: as a quiet worker
    chooses); returns the positions each chunk advanced the row by."""
    decoding = DecodeBatch(engine, batch)
    decoding.admit(generation)
    advanced = []
    while decoding.active:
        before = int(decoding.positions[0])
        decoding.step(steps=steps, quiet=steps is None)
        if decoding.positions[0] > before:  # not the last step, which only reads the chunk dispatched ahead
            advanced.append(int(decoding.positions[0]) - before)
    release_all([generation])
    return advanced


@pytest.mark.parametrize("sampling, seed", [(SAMPLER_DEFAULTS["greedy"], 0),
                                            ({"temperature": 0.9, "top_k": 40, "top_p": 0.9}, 7)])
@pytest.mark.device
def test_a_lone_request_in_long_chunks_gets_the_tokens_and_logprobs_of_short_ones(engine, sampling, seed):
    prompt = [engine.bos] + list(range(500, 520))
    short, long, chunks = (Generation(prompt, 37, sampling, seed, [], None, logprobs=3) for _ in range(3))
    # Batch 2's chunks are decode_chunk's. On a CPU batch 1 makes its own DECODE_CHUNKs with its long decode,
    # stopped after as many tokens, and so stops on the last token a row needs; where chunks are dispatched
    # ahead (a TPU or GPU) they are decode_chunk's too, which makes the whole chunk (Engine.long_makes_chunks).
    assert engine.programs[2].decode_long is None
    assert decode_alone(engine, short, DECODE_CHUNK, batch=2) == [DECODE_CHUNK] * 10
    last = 1 if engine.long_makes_chunks(1) else DECODE_CHUNK
    assert decode_alone(engine, chunks, DECODE_CHUNK) == [DECODE_CHUNK] * 9 + [last]
    # 37 tokens: two full long chunks, then one of the last 5 (a long dispatch makes a token at a time).
    assert decode_alone(engine, long) == [LONG_CHUNK, LONG_CHUNK, 5]
    for got in (long, chunks):
        assert got.ids == short.ids and len(got.ids) == 37 and got.finish_reason == "length"
        for (t1, lp1, top1), (t2, lp2, top2) in zip(got.token_logprobs, short.token_logprobs):
            assert t1 == t2 and [i for i, _ in top1] == [i for i, _ in top2]
            np.testing.assert_allclose([lp1] + [p for _, p in top1], [lp2] + [p for _, p in top2], atol=1e-5)


@pytest.mark.device
def test_a_fast_model_makes_longer_long_chunks_with_the_same_tokens(engine):
    """A long dispatch may make more tokens than LONG_CHUNK: it attends over a window that holds them all (in
    the window of position + LONG_CHUNK, the rows went past its end with wrong log-probabilities)."""
    prompt = [engine.bos] + list(range(520, 540))
    short, long = (Generation(prompt, 90, SAMPLER_DEFAULTS["greedy"], 0, [], None, logprobs=1)
                   for _ in range(2))
    decode_alone(engine, short, DECODE_CHUNK)
    engine.long_chunk_seconds, engine.token_seconds = 1000.0, None  # any speed fits LONGEST_CHUNK tokens
    try:
        # Nothing measured yet: LONG_CHUNK; then the longest (positions 36-99, past the 64 window), then what
        # remains (90 - 16 - 64 = 10).
        assert engine.length_buckets == [64, 128]
        assert decode_alone(engine, long) == [LONG_CHUNK, LONGEST_CHUNK, 10]
        assert 0 < engine.token_seconds < 1
        engine.long_chunk_seconds = engine.token_seconds * (LONG_CHUNK + DECODE_CHUNK + 1)
        assert engine.long_limit() == LONG_CHUNK + DECODE_CHUNK  # whole chunks that fit the time
        engine.long_chunk_seconds = engine.token_seconds
        assert engine.long_limit() == LONG_CHUNK  # never fewer
    finally:
        engine.long_chunk_seconds = 0
    assert long.ids == short.ids and len(long.ids) == 90
    np.testing.assert_allclose([p for _, p, _ in long.token_logprobs], [p for _, p, _ in short.token_logprobs],
                               atol=1e-5)


@pytest.mark.device
def test_a_long_chunk_ends_with_the_token_on_which_its_row_stopped(engine):
    prompt = [engine.bos] + list(range(600, 630))
    sampling = {"temperature": 1.0, "top_k": CANDIDATES, "top_p": 1.0}  # varied tokens, seeded
    reference = Generation(prompt, 12, sampling, 3, [], None)
    decode_alone(engine, reference, DECODE_CHUNK)
    # A token first made in the second short chunk (positions 4-7) becomes a stop token.
    at = next(k for k in range(4, 8) if reference.ids[k] not in reference.ids[:k])
    stop = reference.ids[at]
    saved = engine.stop_ids
    engine.stop_ids = saved | {stop}
    try:
        stopped = Generation(prompt, 40, sampling, 3, [], None)
        assert decode_alone(engine, stopped) == [at + 1]  # not LONG_CHUNK: it stopped on the stop token
    finally:
        engine.stop_ids = saved
    assert stopped.ids == reference.ids[:at] and stopped.finish_reason == "stop"


@pytest.mark.device
def test_streamed_and_waited_on_rows_keep_short_chunks(engine):
    prompt = [engine.bos] + list(range(700, 710))
    streamed = Generation(prompt, 20, SAMPLER_DEFAULTS["greedy"], 0, [], queue.Queue())
    first, *rest = decode_alone(engine, streamed)
    last = 3 if engine.long_makes_chunks(1) else DECODE_CHUNK  # as in the test above
    assert first == 1 and rest == [DECODE_CHUNK] * 4 + [last]  # the first token alone, as soon as it is made
    decoding = DecodeBatch(engine, 1)
    waited_on = Generation(prompt, 20, SAMPLER_DEFAULTS["greedy"], 0, [], None)
    decoding.admit(waited_on)
    decoding.step(quiet=False)  # a request waits for a row: it gets one after a short chunk
    assert decoding.positions[0] == len(prompt) - 1 + DECODE_CHUNK
    release_all([waited_on])


# ----------------------------------------------------------------------------- chunks dispatched ahead

def mixed_generations(engine):
    """Six requests for a batch of 2: prompts of 6-21 tokens, greedy and seeded, with and without
    log-probabilities, one streamed; max_tokens not all multiples of DECODE_CHUNK, so rows end inside
    chunks."""
    seeded = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}
    greedy = SAMPLER_DEFAULTS["greedy"]
    specs = [(5, 7, greedy, None), (20, 9, seeded, 3), (9, 12, greedy, 2), (14, 5, seeded, None),
             (11, 10, greedy, 3), (7, 6, seeded, None)]
    return [Generation([engine.bos] + list(range(300 + 40 * i, 300 + 40 * i + n)), max_tokens, sampling, i,
                       [], queue.Queue() if i == 4 else None, logprobs=logprobs)
            for i, (n, max_tokens, sampling, logprobs) in enumerate(specs)]


def answers(generations):
    """Each request's tokens, text, finish and top log-probabilities' ids (their values: logprobs_of)."""
    return [(g.ids, g.text, g.finish_reason, [(t, [i for i, _ in top]) for t, _, top in g.token_logprobs])
            for g in generations]


def logprobs_of(generations):
    """Every log-probability the requests were answered, the token's and its alternatives': equal to float
    rounding only where a prompt was prefilled alone in one run and in a group in the other."""
    return [q for g in generations for _, p, top in g.token_logprobs for q in (p, *(q for _, q in top))]


@pytest.mark.device
def test_chunks_dispatched_ahead_answer_as_chunks_read_one_by_one_and_compile_nothing(engine, monkeypatch):
    ahead = Engine(engine.model, [2], [64], None, dispatch_ahead=True)
    ahead.warm_up()
    ahead.dispatch_ahead = False
    reference = mixed_generations(ahead)
    ahead.generate(reference, 2)
    ids = reference[1].ids  # seeded: varied tokens
    fresh = [k for k in range(2, 8) if ids[k] not in ids[:k]]
    assert fresh, f"the seeded request repeats its first tokens: {ids}"
    at = fresh[0]
    ahead.stop_ids = ahead.stop_ids | {ids[at]}  # the second request then ends on a stop token, inside a chunk
    reference = mixed_generations(ahead)
    ahead.generate(reference, 2)
    assert reference[1].finish_reason == "stop" and reference[1].ids == ids[:at]

    next_tokens = ahead.programs[2].next_tokens
    merged, early, compiled = [], [], []
    ahead.programs[2] = ahead.programs[2]._replace(next_tokens=lambda *a: merged.append(1) or next_tokens(*a))
    admit_all = DecodeBatch.admit_all

    def counted_admit_all(self, generations):  # rows still held by a generation that ends in the pending chunk
        early.append(sum(self.rows[row] is not None for row in self.free_row_ids()[:len(generations)]))
        return admit_all(self, generations)
    monkeypatch.setattr(DecodeBatch, "admit_all", counted_admit_all)
    on_compilation(lambda: compiled.append(1))
    ahead.dispatch_ahead = True
    generations = mixed_generations(ahead)
    ahead.generate(generations, 2)
    assert not compiled, "a chunk dispatched ahead compiled at request time"
    assert merged and sum(early) > 0  # chunks started from the device's tokens; rows were handed on before reading
    assert answers(generations) == answers(reference)
    np.testing.assert_allclose(logprobs_of(generations), logprobs_of(reference), atol=1e-5)
    assert all(g.done.is_set() for g in generations)


@pytest.mark.device
def test_a_finished_grammars_last_mask_does_not_reach_the_next_request_in_its_row(engine):
    import llguidance
    tokenizer = engine.model.preprocessor.tokenizer
    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, engine.vocabulary_size, engine.stop_ids),
                                   llguidance.LLMatcher.grammar_from_regex("ab"), log_level=0)
    prompt = [engine.bos] + list(range(600, 612))
    greedy = SAMPLER_DEFAULTS["greedy"]

    def run():
        alone = Generation(prompt, 4, greedy, 0, [], queue.Queue())
        decode_alone(engine, alone)
        decoding = DecodeBatch(engine, 1)
        constrained = Generation(prompt, 8, greedy, 0, [], None)
        constrained.matcher = matcher
        decoding.admit(constrained)
        while decoding.active:
            decoding.step()
        # The next request in that row streams: its first token comes from a one-token (masked) step.
        after = Generation(prompt, 4, greedy, 0, [], queue.Queue())
        decoding.admit(after)
        while decoding.active:
            decoding.step()
        return constrained, after, alone
    constrained, after, alone = without_prefix_cache(engine, run)
    assert constrained.text == "ab" and constrained.finish_reason == "stop"
    assert after.ids == alone.ids


@pytest.mark.device
def test_an_accelerator_s_large_groups_give_each_prompt_its_own_prefill(engine, monkeypatch):
    """Off a CPU a wave of newcomers is prefilled in groups of up to 64 (GROUP_TOKENS): 21 prompts go as
    16 + 4 + 1, and each row holds what keras-hub's prefill of that prompt alone makes."""
    monkeypatch.setattr(engine, "group_sizes", [2, 4, 8, 16])
    monkeypatch.setattr(engine, "group_limits", {size: min(GROUP_BLOCK, GROUP_TOKENS // size)
                                                 for size in PREFILL_GROUPS})
    assert engine.group_sizes_for(16) == [2, 4, 8, 16]
    prompts = [[engine.bos] + list(range(2000 + 20 * i, 2000 + 20 * i + 5 + i % 9)) for i in range(21)]
    rows = [Generation(p, 1, SAMPLER_DEFAULTS["greedy"], 0, [], None) for p in prompts]
    groups = []
    with counting(engine, "_prefill_group") as calls:
        made = without_prefix_cache(engine, lambda: engine.prefills.rows(rows))
        groups = [len(args[1]) for args in calls]
    assert groups == [16, 4]  # and the last one alone
    import jax
    for prompt, (row, cached) in zip(prompts, made):
        assert cached == 0
        for got, want, axis in zip(jax.tree.leaves(row), jax.tree.leaves(plain_prefill(engine, prompt, 16)),
                                   jax.tree.leaves(engine.axes)):
            np.testing.assert_allclose(np.take(got, range(len(prompt)), axis), np.take(want, range(len(prompt)), axis),
                                       atol=1e-5)
    release_all(rows)
