"""Accelerator measurements (the bench stage of scripts/tpu_check.sh): the Gemma 2B architecture with
random weights, bfloat16, rank-16 LoRA, on one GPU or TPU chip.

    python3 scripts/tpu_check.py [--config gemma_2b|tiny] [--steps 20] [--quantize int8] [--batches 1,8,64]
                                 [--unroll on,off] [--long on,off] [--groups] [--profile DIR]

Measures the product's own code paths: train_local.Trainer's compiled train step at batch 4 x 512
(ms/step after compile, MFU against the chip's bf16 peak), the Engine's batched decode (generated
tokens/s and warm-up seconds at each of --batches, with keras-hub's generate() as a reference when
--reference is given), and peak device memory. Random weights
and pre-tokenized arrays: nothing is downloaded and TensorFlow is not needed. `--config tiny` runs the
same script in seconds on a CPU, to check it before spending device time. `--quantize int8` (or int4)
measures the same with the dense layers quantized before LoRA is enabled (QLoRA, as `train_local.py
--quantize`), and reports the weight memory of each setting. Decode speed is printed next to its limit:
the weight bytes over the read bandwidth a jitted sum measures in the same process (issue #21). Last,
the train step's planned temporaries with and without --remat (gradient checkpointing, which XLA's CPU
backend ignores). Issue #33 item 3, whether a program kind pays on this chip: --unroll on,off (decode chunks
unrolled or looped), --long on,off (a lone request's decodes of up to 64 tokens a dispatch, or 4), and
--groups (a burst of prompts prefilled in groups, or one by one).
"""
import argparse
import contextlib
import math
import os
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_memory import read_bandwidth  # noqa: E402  the limit bench_memory.py divides by
from gemma_lora.engine import engine as engine_module, programs  # noqa: E402
from gemma_lora.engine.engine import GROUP_BLOCK, Engine  # noqa: E402
from gemma_lora.interface import SAMPLER_DEFAULTS, Generation  # noqa: E402
UNROLL_FROM_BYTES, UNROLL_FROM_BATCH_OFF_CPU = engine_module.UNROLL_FROM_BYTES, engine_module.UNROLL_FROM_BATCH_OFF_CPU
WRITE_BY_SELECT_ON, POSITIONS_WRITTEN_BY_SELECT = programs.WRITE_BY_SELECT_ON, programs.positions_written_by_select

CONFIGS = {  # gemma_2b as keras-hub defines it (GemmaBackbone presets)
    "gemma_2b": dict(vocabulary_size=256000, num_layers=18, num_query_heads=8, num_key_value_heads=1,
                     hidden_dim=2048, intermediate_dim=32768, head_dim=256),
    "tiny": dict(vocabulary_size=1024, num_layers=2, num_query_heads=4, num_key_value_heads=1,
                 hidden_dim=64, intermediate_dim=128, head_dim=16),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="gemma_2b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="bf16 dense peak (default: the chip's, e.g. TPU v5e 197, H200 ~790)")
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default="none")
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes to measure (default: %(default)s)")
    p.add_argument("--reference", action="store_true", help="also time keras-hub's generate() (compiles it too)")
    p.add_argument("--skip-train", action="store_true", help="decode only")
    p.add_argument("--unroll", default="auto", help="decode chunks unrolled: auto (serve.py's choice by weight "
                   "bytes), on, off, or both settings side by side: on,off (issue #33: does it pay here?)")
    p.add_argument("--long", default="auto", help="the smallest batch's long decodes (up to 64 tokens a dispatch "
                   "when no request waits): auto (serve.py's choice: on a CPU only), on, off, or on,off side by side")
    p.add_argument("--writes", default="auto", help="how a decode step writes each row's new key and value: auto "
                   "(serve.py's choice by backend), select, scatter, rows (one scatter of whole rows: an experiment), or several "
                   "side by side, e.g. select,rows,scatter (issue #48)")
    p.add_argument("--decode-only", action="store_true", help="no grouped prefills in the engine's warm-up (the "
                   "decode measurement never uses them; they are most of its compile time on a chip)")
    p.add_argument("--profile", default=None, metavar="DIR", help="after each batch's timed run, one more under "
                   "jax.profiler into DIR, and the device's costliest XLA ops printed (issue #48: where a decode step's "
                   "time goes on the chip)")
    p.add_argument("--groups", action="store_true", help="also time a burst of prompts (each batch size of "
                   "--batches above 1) prefilled in groups against one by one, per prompt block")
    return p.parse_args()


PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v4": 275.0, "TPU v6 lite": 918.0, "NVIDIA H200": 790.0,
               "NVIDIA H100 80GB HBM3": 790.0}


def build_model(config, quantize):
    import keras
    from keras_hub.models import GemmaBackbone, GemmaCausalLM
    keras.utils.set_random_seed(0)
    backbone = GemmaBackbone(**CONFIGS[config], dtype="bfloat16")
    model = GemmaCausalLM(backbone=backbone, preprocessor=None)
    if quantize != "none":
        import train_local
        train_local.quantize_base(model, quantize)
    model.backbone.enable_lora(rank=16)
    return model


def train_flops_per_step(model, batch, length):
    """Frozen base: forward (2N) + activation gradients (2N) per token, plus attention scores both ways."""
    b = model.backbone
    n_params = b.count_params()  # the embedding doubles as the output projection, so every weight is a matmul
    attention = 4 * b.num_layers * length * b.num_query_heads * b.head_dim  # QK^T and AV, forward, per token
    return batch * length * (4 * n_params + 2 * attention)


def time_training(model, args):
    import keras
    import numpy as np
    import train_local
    trainer = train_local.Trainer(model, keras.optimizers.AdamW(5e-5), None)
    started = time.time()
    trainer.warm_up([args.sequence_length], args.batch_size, 0, with_eval=False)
    compile_seconds = time.time() - started
    rng = np.random.default_rng(0)
    vocab = model.backbone.vocabulary_size
    batch = (rng.integers(3, vocab, (args.batch_size, args.sequence_length), dtype=np.int32),
             np.ones((args.batch_size, args.sequence_length), bool),
             rng.integers(3, vocab, (args.batch_size, args.sequence_length), dtype=np.int32),
             np.ones((args.batch_size, args.sequence_length), np.float32))
    for _ in range(3):  # settle: first calls include transfers and autotuning
        trainer.train_on([(args.sequence_length, batch)])
    started = time.time()
    for _ in range(args.steps):
        loss_sum, count, _, _ = trainer.train_on([(args.sequence_length, batch)])  # float() syncs every step
    ms = (time.time() - started) / args.steps * 1000
    trainer.write_back()  # the step donates its buffers: give the model its live weights back
    return ms, compile_seconds, loss_sum / count


def train_step_temporaries(model, args):
    """GiB of temporaries XLA plans for the train step, without and with --remat (compiled, not run)."""
    import keras
    import train_local
    sizes = []
    for remat in (False, True):
        if remat:
            train_local.remat_decoder_blocks(model.backbone)
        trainer = train_local.Trainer(model, keras.optimizers.AdamW(5e-5), None)
        batch = train_local.collate([], [], args.sequence_length, args.batch_size, 0)
        compiled = trainer._train_step.lower(trainer.trainable, trainer.opt_state, trainer.non_trainable,
                                             *batch).compile()
        sizes.append(compiled.memory_analysis().temp_size_in_bytes / 2**30)
    return sizes


def bench_engine(model, batch_sizes, length):
    """serve.py's Engine over random weights: never stops early, detokenizes nothing."""
    tokenizer = types.SimpleNamespace(proto=None, start_token_id=2, end_token_id=1, pad_token_id=0,
                                      get_vocabulary=lambda: [], token_to_id=lambda _: None, detokenize=str)
    engine = Engine(model, batch_sizes, [length], None, tokenizer=tokenizer)
    engine.stop_ids = set()  # random weights: never stop early, always generate max_tokens
    engine.decode = lambda ids: ""  # measure the model, not detokenisation
    return engine


@contextlib.contextmanager
def positions_written_by_row_scatter(on):
    """`--writes rows`, an experiment beside serve.py's select (issue #48): keras-hub's one-position cache writes
    as a dynamic update slice whose vmap over rows is one scatter of whole rows into the batch's cache flattened
    to (rows x positions, ...): no batching dimensions, which XLA's TPU backend expanded into a loop over rows
    (programs.positions_written_by_select). Whether that backend scatters these natively is what it measures."""
    import jax
    import jax.numpy as jnp
    import keras
    own = keras.ops.slice_update

    @jax.custom_batching.custom_vmap
    def write(cache, update, position):  # one row: cache (1, length, ...), update (1, 1, ...)
        return jax.lax.dynamic_update_slice_in_dim(cache, update, position, axis=1)

    @write.def_vmap
    def write_rows(size, batched, cache, update, position):
        cache, update, position = (x if b else jnp.broadcast_to(x, (size,) + jnp.shape(x))
                                   for x, b in zip((cache, update, position), batched))
        rows, length = cache.shape[0], cache.shape[2]
        flat = cache.reshape((rows * length,) + cache.shape[3:])
        at = jnp.arange(rows) * length + position
        flat = flat.at[at].set(update.reshape((rows,) + cache.shape[3:]).astype(cache.dtype), unique_indices=True,
                               indices_are_sorted=True, mode="promise_in_bounds")
        return flat.reshape(cache.shape), True

    def slice_update(inputs, start_indices, updates):  # a row's (1, length, ...) cache, at its position on axis 1
        if inputs.shape[0] != 1 or programs.one_position_axis(inputs, start_indices, updates) != 1:
            return own(inputs, start_indices, updates)
        return write(inputs, updates, jnp.asarray(start_indices[1], jnp.int32))
    if not on:
        yield
        return
    keras.ops.slice_update = slice_update
    try:
        yield
    finally:
        keras.ops.slice_update = own


def time_generation(model, args, batch_size, unroll="auto", long="auto", writes="auto"):
    import numpy as np
    # `rows` takes serve.py's place for the keys and values (its tokens are written by select).
    programs.WRITE_BY_SELECT_ON = {"scatter": ()}.get(writes, ("cpu", "gpu", "tpu") if writes != "auto"
                                                      else WRITE_BY_SELECT_ON)
    programs.positions_written_by_select = positions_written_by_row_scatter if writes == "rows" \
        else POSITIONS_WRITTEN_BY_SELECT
    engine_module.UNROLL_FROM_BYTES = {"on": 0, "off": float("inf")}.get(unroll, UNROLL_FROM_BYTES)
    engine_module.UNROLL_FROM_BATCH_OFF_CPU = 1 if unroll == "on" else UNROLL_FROM_BATCH_OFF_CPU
    prompt_length = 32
    engine = bench_engine(model, [batch_size], prompt_length + args.new_tokens)
    if args.decode_only:
        engine.group_sizes = []
    if long != "auto":  # built or not whatever the backend; without them every decode is DECODE_CHUNK a dispatch
        engine.programs[batch_size] = engine.batch_programs(batch_size, long=long == "on")
    started = time.time()
    warm_up = engine.warm_up()
    compile_seconds = time.time() - started
    for name, trace_s, compile_s in sorted(warm_up.compiled, key=lambda c: -c[2]):
        print(f"compile: {name}: {compile_s:.1f}s (traced and lowered in {trace_s:.1f}s)", flush=True)
    rng = np.random.default_rng(1)

    def rows():
        return [Generation([2] + rng.integers(3, 1000, prompt_length - 1).tolist(), args.new_tokens,
                           SAMPLER_DEFAULTS["greedy"], 0, [], None) for _ in range(batch_size)]
    engine.generate(rows(), batch_size)
    started = time.time()
    done = rows()
    engine.generate(done, batch_size)
    seconds = time.time() - started
    assert all(len(g.ids) == args.new_tokens for g in done)
    if args.profile:
        import jax
        folder = Path(args.profile) / f"batch{batch_size}-{unroll}-{long}-{writes}"
        with jax.profiler.trace(str(folder)):
            engine.generate(rows(), batch_size)
        print_top_ops(folder, batch_size, args.new_tokens)
    return batch_size * args.new_tokens / seconds, compile_seconds, [g.ids for g in done]


def op_kind(name):
    """An XLA op's event name (its HLO text, or just its name) -> what it is, the same for every layer and step: the
    op's name without its number and the JAX operation it came from without layer numbers, e.g.
    "while <- vmap(decoder_block_N)/attention/vmap()/scatter"."""
    import re
    op = re.sub(r"[.\d]+$", "", name.split(" = ")[0].lstrip("%"))
    source = re.search(r'op_name="([^"]*)"', name)
    return op + (" <- " + re.sub(r"\d+", "N", source.group(1).split("/", 1)[-1])[-90:] if source else "")


def print_top_ops(folder, batch_size, steps, top=20):
    """The device's costliest kinds of op in a jax.profiler trace (op_kind: every layer's and step's together):
    total ms, per decode step, and share of the ops' time. The device's planes are named /device:TPU:0 (or GPU);
    a CPU has none, and then the host's threads are shown."""
    import collections
    from jax.profiler import ProfileData
    paths = sorted(folder.glob("**/*.xplane.pb"))
    if not paths:
        print(f"profile: no trace written under {folder}", flush=True)
        return
    data = ProfileData.from_file(str(paths[-1]))
    planes = [p for p in data.planes if p.name.startswith("/device:TPU") or p.name.startswith("/device:GPU")] \
        or [p for p in data.planes if "CPU" in p.name]
    totals, counts = collections.Counter(), collections.Counter()
    for plane in planes:
        lines = [line for line in plane.lines if line.name == "XLA Ops"] or list(plane.lines)
        for line in lines:
            for event in line.events:
                kind = op_kind(event.name)
                totals[kind] += event.duration_ns
                counts[kind] += 1
    whole = sum(totals.values()) or 1
    print(f"profile: batch {batch_size}, {whole / 1e6:,.1f} ms of ops on {', '.join(p.name for p in planes)} "
          f"({whole / 1e6 / steps:.2f} ms a step over {steps} steps); the {top} costliest kinds:", flush=True)
    for kind, ns in totals.most_common(top):
        print(f"profile:   {ns / 1e6:9.1f} ms  {ns / 1e6 / steps:7.3f} ms/step  {ns / whole:5.1%}  x{counts[kind]:<6} "
              f"{kind[:140]}", flush=True)


def time_grouped_prefills(model, batch_size, best_of=3):
    """{block: (ms grouped, ms one by one)}: a burst of batch_size prompts of each groupable block length,
    admitted at once, to their first token (max_tokens 1), best of `best_of` after a run that warms up."""
    import numpy as np
    engine = bench_engine(model, [batch_size], max(GROUP_BLOCK, 64) + 8)
    engine.warm_up()
    rng = np.random.default_rng(3)
    times = {}
    for block in engine.group_blocks:
        row = []
        for grouping in (True, False):
            engine.grouping = grouping
            best = float("inf")
            for _ in range(best_of + 1):
                rows = [Generation([2] + rng.integers(3, 1000, block - 1).tolist(), 1,
                                   SAMPLER_DEFAULTS["greedy"], 0, [], None) for _ in range(batch_size)]
                started = time.time()
                engine.generate(rows, batch_size)
                best = min(best, time.time() - started)
            row.append(best * 1000)
        times[block] = tuple(row)
    return times


def time_keras_hub_generate(model, args, batch_size):
    import numpy as np
    total = 32 + args.new_tokens
    inputs = {"token_ids": np.zeros((batch_size, total), np.int32), "padding_mask": np.zeros((batch_size, total), bool)}
    inputs["token_ids"][:, :32] = np.random.default_rng(2).integers(3, 1000, (batch_size, 32))
    inputs["padding_mask"][:, :32] = True
    model.generate(inputs, stop_token_ids=None)  # compile
    started = time.time()
    model.generate(inputs, stop_token_ids=None)
    return batch_size * args.new_tokens / (time.time() - started)


def peak_memory_gib():
    import jax
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30


def main():
    args = parse_args()
    import jax
    try:
        import tensorflow as tf
        tf.config.set_visible_devices([], "GPU")
    except Exception:
        pass
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    started = time.time()
    model = build_model(args.config, args.quantize)
    weights = sum(w.value.nbytes for w in model.weights) / 2**30
    print(f"model: {args.config}, {model.backbone.count_params() / 1e9:.2f}B parameters, bfloat16"
          f"{'' if args.quantize == 'none' else ' with ' + args.quantize + ' dense layers'}, {weights:.2f} GiB of "
          f"weights, LoRA rank 16 ({sum(math.prod(v.shape) for v in model.trainable_variables) / 1e6:.2f}M "
          f"trainable), built in {time.time() - started:.0f}s", flush=True)

    peak = args.peak_tflops or PEAK_TFLOPS.get(device.device_kind, 1.0)
    if not args.skip_train:
        ms, compile_s, loss = time_training(model, args)
        flops = train_flops_per_step(model, args.batch_size, args.sequence_length)
        mfu = flops / (ms / 1000) / (peak * 1e12)
        print(f"train: {ms:.1f} ms/step at batch {args.batch_size} x {args.sequence_length} (compile "
              f"{compile_s:.0f}s), {args.batch_size * args.sequence_length / ms * 1000:,.0f} tok/s, "
              f"{flops / 1e12:.1f} TFLOP/step, MFU {mfu * 100:.1f}% of {peak:.0f} TFLOP/s, loss {loss:.2f}", flush=True)
    train_peak = peak_memory_gib()
    # Decoding reads every weight once a step: tokens/s a row <= read bandwidth / weight bytes (issue #21).
    bandwidth = read_bandwidth(256 if jax.default_backend() == "cpu" else 4096)
    limit = bandwidth / sum(w.value.nbytes for w in model.weights)
    print(f"limit: {limit:,.0f} tok/s a row ({bandwidth / 1e9:,.0f} GB/s read by a jitted sum over "
          f"{weights:.2f} GiB of weights)", flush=True)
    tokens = {}
    for batch_size in map(int, args.batches.split(",")):
        for unroll, long, writes in [(u, lo, w) for u in args.unroll.split(",") for lo in args.long.split(",")
                                     for w in args.writes.split(",")]:
            tps, compile_s, made = time_generation(model, args, batch_size, unroll, long, writes)
            first = tokens.setdefault(batch_size, made)  # every setting must decode the same greedy tokens
            reference = time_keras_hub_generate(model, args, batch_size) if args.reference else None
            print(f"generate: batch {batch_size}: {tps:,.0f} tok/s with serve.py's engine "
                  f"({'' if unroll == 'auto' else 'unroll ' + unroll + ', '}"
                  f"{'' if args.long == 'auto' else 'long decodes ' + long + ', '}"
                  f"{'' if writes == 'auto' else 'writes by ' + writes + ', '}warm-up {compile_s:.0f}s), "
                  f"{tps / (batch_size * limit):.0%} of {batch_size} x the limit"
                  + (f"; keras-hub generate(): {reference:,.0f} tok/s" if reference else "")
                  + f" ({args.new_tokens} new tokens after a 32-token prompt, its prefill included)"
                  + ("" if first is made else "; the same tokens as the first setting" if made == first
                     else f"; tokens DIFFER from the first setting's in {sum(a != b for a, b in zip(made, first))} rows"),
                  flush=True)
    for batch_size in (b for b in map(int, args.batches.split(",")) if args.groups and b > 1):
        for block, (grouped, alone) in time_grouped_prefills(model, batch_size).items():
            print(f"prefill: {batch_size} prompts of {block} tokens to their first token: {grouped:,.0f} ms in "
                  f"groups, {alone:,.0f} ms one by one ({alone / grouped:.2f}x)", flush=True)
    print(f"memory: peak {peak_memory_gib():.1f} GiB on device (after training: {train_peak:.1f} GiB)")
    if args.quantize == "none" and not args.skip_train:  # last: it wraps the model's decoder blocks
        plain, rematted = train_step_temporaries(model, args)
        print(f"remat: train step temporaries {plain:.2f} GiB without --remat, {rematted:.2f} GiB with it "
              f"(batch {args.batch_size} x {args.sequence_length})", flush=True)


if __name__ == "__main__":
    main()
