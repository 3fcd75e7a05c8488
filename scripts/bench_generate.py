"""serve.py's engine (continuous batching) against keras-hub's `generate` in static batches: one
process, no HTTP, both compiled beforehand.

    python3 scripts/bench_generate.py [--runs 5 --requests 64 --batch 16]
    python3 scripts/bench_generate.py --serve /tmp/old_serve.py   # an earlier commit's engine

The workload is bench_serve.py's: prompts of 3-60 random words, max_tokens drawn from {16, 32, 48, 64},
on its model (a random Gemma, 4 layers, 256 wide, one training step), unless --model names another.
Both sides decode greedily and ignore stop tokens, so both produce exactly max_tokens tokens per
request; they differ only in how they batch and in their per-token cost:
1. Mixed: `generate` takes the requests in arrival order, --batch at a time, each batch padded to one
   shape (the workload's longest prompt plus its largest max_tokens) and decoded to its end, so a batch
   lasts as long as its longest row. The engine decodes in --batch rows, and each request takes a free
   row as soon as one opens and leaves it at its own max_tokens.
2. One static batch of --batch equal requests (32-token prompts, 64 new tokens): no batching advantage
   either way, only the cost per token.
3. One request alone (a 32-token prompt, 64 new tokens).
4. A burst: --batch new prompts of the mix at once, 8 new tokens each (fresh prompts every run, so the
   prefix cache has none of them), where the prefill weighs most: `generate` prefills its static batch
   in one call, the engine in groups of prompts that share a block (serve.py's prefill_group).
Reported: each side's median wall time over --runs and the ratio generate / engine (above 1: the
engine is faster). `--dispatch-ahead both` times the engine twice per case, its chunks read as they
are made and dispatched ahead of reading (serve.py does the first on a CPU, the second on a GPU or TPU).
"""
import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import WORDS, make_bench_model, prompts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model dir (default: bench_serve.py's model, built in a temp dir)")
    p.add_argument("--serve", default=str(REPO / "serve.py"), help="the serve.py whose Engine is measured")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--flags", default="", help="extra serve.py flags for the engine, e.g. '--dtype float32'")
    p.add_argument("--cases", default="mixed,equal,one,burst", help="which cases to run (default: %(default)s)")
    p.add_argument("--dispatch-ahead", choices=["auto", "on", "off", "both"], default="auto",
                   help="the engine's chunks dispatched before the one ahead is read (auto: as serve.py, on for "
                        "a GPU or TPU); both: one engine timed each way, side by side")
    return p.parse_args()


def import_serve(path):
    """The engine's parts from a serve.py: the module itself when it is one file (before the gemma_lora
    package), else the package beside it."""
    sys.path.insert(0, str(Path(path).resolve().parent))
    spec = importlib.util.spec_from_file_location("serve_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "Generation"):
        from gemma_lora.engine.core import batch_buckets
        from gemma_lora.engine.engine import Engine
        from gemma_lora.interface import SAMPLER_DEFAULTS, Generation
        from gemma_lora.model import load_model
        module.Engine, module.Generation, module.SAMPLER_DEFAULTS = Engine, Generation, SAMPLER_DEFAULTS
        module.load_model, module.batch_buckets = load_model, batch_buckets
    return module


def workload(encode, bos, n, seed=0):
    """(prompt ids, max_tokens) for n requests of bench_serve.py's mix."""
    rng = random.Random(seed)
    return [([bos] + encode(text), rng.choice([16, 32, 48, 64])) for text, _ in prompts(encode, n, seed)]


def equal_requests(encode, bos, n, prompt_tokens=32, new_tokens=64):
    words = " ".join(WORDS * 8)
    ids = ([bos] + encode(words))[:prompt_tokens]
    return [(ids, new_tokens)] * n


class Static:
    """keras-hub `generate` over batches of `batch` requests, each padded to `length` positions: it
    decodes from the batch's shortest prompt to `length`, so every row gets `length` - its prompt."""

    def __init__(self, model, batch, length, pad):
        self.model, self.batch, self.length, self.pad = model, batch, length, pad

    def inputs(self, requests):
        ids = np.full((self.batch, self.length), self.pad, np.int32)
        mask = np.zeros((self.batch, self.length), bool)
        for row, (prompt, _) in enumerate(requests):
            ids[row, :len(prompt)], mask[row, :len(prompt)] = prompt, True
        for row in range(len(requests), self.batch):  # a partial last batch still runs at the compiled shape
            ids[row], mask[row] = ids[0], mask[0]
        return {"token_ids": ids, "padding_mask": mask}

    def run(self, requests):
        for start in range(0, len(requests), self.batch):
            chunk = requests[start:start + self.batch]
            # Every batch has the one compiled shape: a shape per batch would compile at request time.
            # generate()'s own compiled function: generate() itself also concatenates every output key,
            # and Gemma 3's include image keys that are None without a preprocessor.
            out = self.model.make_generate_function()(self.inputs(chunk), stop_token_ids=None)
            np.asarray(out["token_ids"])


def engine_run(serve, engine, requests, batch):
    rows = [serve.Generation(list(ids), new, serve.SAMPLER_DEFAULTS["greedy"], 0, [], None) for ids, new in requests]
    engine.generate(rows, batch)
    made = sum(len(g.ids) for g in rows)
    assert made == sum(new for _, new in requests), f"the engine made {made} tokens"


def timed(fn, runs):
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times), max(times)


def main():
    args = parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    serve = import_serve(args.serve)
    work = tempfile.TemporaryDirectory()
    model_dir = args.model or str(make_bench_model(Path(work.name), dict(os.environ))[1])
    flags = serve.parse_args(["--model", model_dir, "--max-batch-size", str(args.batch), *args.flags.split()])
    model, dtype, _ = serve.load_model(flags)
    ahead = {} if args.dispatch_ahead == "auto" else {"dispatch_ahead": args.dispatch_ahead != "off"}
    engine = serve.Engine(model, serve.batch_buckets(flags.max_batch_size, 1), flags.length_buckets, None,
                          prefix_blocks=flags.prefix_cache_blocks, block_tokens=flags.prefix_block_tokens, **ahead)
    engine.warm_up()
    engine.stop_ids = set()  # both sides make exactly max_tokens tokens

    mixed = workload(engine.encode, engine.bos, args.requests)
    equal = equal_requests(engine.encode, engine.bos, args.batch)
    longest = max(len(ids) for ids, _ in mixed) + max(new for _, new in mixed)
    model.preprocessor = None  # generate() takes token ids and padding masks as they are
    model.compile(sampler="greedy")  # as the engine decodes here (keras-hub's default is top-k)
    static = Static(model, args.batch, longest, engine.pad)
    alone = Static(model, 1, len(equal[0][0]) + equal[0][1], engine.pad)
    full = Static(model, args.batch, len(equal[0][0]) + equal[0][1], engine.pad)
    # Each side gets the same fresh bursts, one per run, in order.
    bursts = [[(ids, 8) for ids, _ in workload(engine.encode, engine.bos, args.batch, seed=100 + run)]
              for run in range(args.runs)]
    burst = Static(model, args.batch, max(len(ids) for b in bursts for ids, _ in b) + 8, engine.pad)
    cases = args.cases.split(",")
    started = time.time()
    for side, case in ((static, "mixed"), (alone, "one"), (full, "equal"), (burst, "burst")):  # compiles generate()
        if case in cases:
            side.run(equal[:side.batch])
    print(f"{type(model).__name__} from {model_dir}, {dtype}; generate compiled in {time.time() - started:.1f}s; "
          f"the engine's serve.py: {args.serve}", flush=True)

    theirs_bursts, our_bursts = iter(bursts), iter(bursts)
    table = {
        "mixed": (f"mixed: {args.requests} requests, {args.batch} at a time", lambda: static.run(mixed),
                  lambda: engine_run(serve, engine, mixed, args.batch)),
        "equal": (f"one static batch of {args.batch} (32 + 64 tokens each)", lambda: full.run(equal),
                  lambda: engine_run(serve, engine, equal, args.batch)),
        "one": ("one request (32 + 64 tokens)", lambda: alone.run(equal[:1]),
                lambda: engine_run(serve, engine, equal[:1], 1)),
        "burst": (f"a burst of {args.batch} new prompts, 8 new tokens each", lambda: burst.run(next(theirs_bursts)),
                  lambda: engine_run(serve, engine, next(our_bursts), args.batch)),
    }
    both = args.dispatch_ahead == "both"
    if both:
        print(f"\n| case | generate, static (median of {args.runs}, min-max) | engine, chunks read as made | "
              f"engine, dispatched ahead | generate / engine, each way |\n|---|---|---|---|---|")
    else:
        print(f"\n| case | generate, static (median of {args.runs}, min-max) | engine | generate / engine |\n"
              f"|---|---|---|---|")
    for name, theirs, ours in (table[case] for case in cases):
        t_theirs, times = timed(theirs, args.runs), []
        for ahead in ((False, True) if both else (engine.dispatch_ahead,)):
            engine.dispatch_ahead = ahead
            times.append(timed(ours, args.runs))
        cells = " | ".join(f"{t[0]:.2f} s ({t[1]:.2f}-{t[2]:.2f})" for t in times)
        ratios = " / ".join(f"**{t_theirs[0] / t[0]:.2f}×**" for t in times)
        print(f"| {name} | {t_theirs[0]:.2f} s ({t_theirs[1]:.2f}-{t_theirs[2]:.2f}) | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
