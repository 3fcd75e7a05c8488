"""Penalties inside the compiled step (issue #34), side by side in one process: what they cost a batch, and
what they do to a small model's loops.

    python3 scripts/bench_sampling.py [--model .demo/gemma3-270m] [--runs 3] [--answers 50]

1. Throughput: serve.py's engine, warmed up once, decodes bench_serve.py's mix of requests (prompts of
   3-60 words, 16-64 new tokens, greedy, stop tokens ignored) in --batch rows: with no row penalised,
   with every other row penalised (frequency 0.5, presence 0.5, repetition 1.1, a logit_bias of 8 ids)
   and with every row penalised. Reported: median wall time over --runs, tokens/s, the ratio to the
   plain batch, and the XLA compilations during the timed runs (0: the settings are the step's inputs).
2. Loops: --answers greedy answers (up to --max-tokens tokens) to Dolly instructions in Gemma's turn
   format, with and without frequency_penalty 0.5: the share of each answer's 4-grams that repeat an
   earlier 4-gram of the same answer, and how many answers ran to --max-tokens.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from gemma_lora.interface import SAMPLER_DEFAULTS, Generation  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".demo" / "gemma3-270m"))
    p.add_argument("--flags", default="", help="extra serve.py flags, e.g. '--dtype bfloat16'")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--answers", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--skip-loops", action="store_true")
    return p.parse_args()


PENALISED = {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
             "logit_bias": {i: -1.0 for i in range(1000, 1008)}}


def throughput(serve, engine, requests, batch, runs, every):
    """Median seconds to decode `requests` with every `every`-th row penalised (0: none)."""
    def rows():
        return [Generation(list(ids), new, dict(SAMPLER_DEFAULTS["greedy"],
                                                **(PENALISED if every and i % every == 0 else {})), 0, [], None)
                for i, (ids, new) in enumerate(requests)]
    engine.generate(rows(), batch)  # untimed: the first run of a setting also sends its arrays' first copies
    times = []
    for _ in range(runs):
        work = rows()
        started = time.perf_counter()
        engine.generate(work, batch)
        times.append(time.perf_counter() - started)
        assert sum(len(g.ids) for g in work) == sum(new for _, new in requests)
    return statistics.median(times)


def repeated_share(ids, n=4):
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def loops(serve, engine, answers, max_tokens, frequency):
    rows = []
    with open(REPO / "tests" / "data" / "dolly_sample.jsonl") as f:
        examples = [json.loads(line) for line in f][:answers]
    for example in examples:
        prompt = f"<start_of_turn>user\n{example['instruction']}<end_of_turn>\n<start_of_turn>model\n"
        sampling = dict(SAMPLER_DEFAULTS["greedy"], **({"frequency_penalty": frequency} if frequency else {}))
        rows.append(Generation([engine.bos] + engine.encode(prompt), max_tokens, sampling, 0, [], None))
    started = time.perf_counter()
    engine.generate(rows, len(rows))
    seconds = time.perf_counter() - started
    shares = [repeated_share(g.ids) for g in rows]
    return (statistics.mean(shares), sum(s > 0.2 for s in shares), sum(g.finish_reason == "length" for g in rows),
            statistics.mean(len(g.ids) for g in rows), seconds)


def main():
    args = parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import serve
    from gemma_lora.engine.compilation import on_compilation
    from gemma_lora.engine.core import batch_buckets
    from gemma_lora.engine.engine import Engine
    from gemma_lora.model import keep_unused_imports_out, load_model
    from bench_generate import workload
    flags = serve.parse_args(["--model", args.model, "--max-batch-size", str(args.batch), "--length-buckets", "256",
                              *args.flags.split()])
    keep_unused_imports_out()
    model, dtype, _ = load_model(flags)
    engine = Engine(model, batch_buckets(args.batch, 1), flags.length_buckets, None)
    started = time.time()
    engine.warm_up()
    print(f"{type(model).__name__} from {args.model}, {dtype}, batch {args.batch}; warm-up {time.time() - started:.0f}s",
          flush=True)
    compilations = []
    on_compilation(lambda: compilations.append(1))

    stops, engine.stop_ids = engine.stop_ids, set()  # every request makes exactly its max_tokens
    requests = workload(engine.encode, engine.bos, args.requests)
    tokens = sum(new for _, new in requests)
    print(f"\n| {args.requests} requests ({tokens} tokens) in {args.batch} rows | median of {args.runs} | tok/s | "
          f"of plain |\n|---|---|---|---|")
    plain = None
    for name, every in (("no row penalised", 0), ("every other row penalised", 2), ("every row penalised", 1)):
        seconds = throughput(serve, engine, requests, args.batch, args.runs, every)
        plain = plain or seconds
        print(f"| {name} | {seconds:.2f} s | {tokens / seconds:,.0f} | {plain / seconds:.0%} |", flush=True)
    print(f"\nXLA compilations during the timed runs: {len(compilations)}")
    engine.stop_ids = stops

    if args.skip_loops:
        return
    print(f"\n| {args.answers} greedy answers, up to {args.max_tokens} tokens | repeated 4-grams (mean share) | "
          f"answers over 20% repeated | ran to max_tokens | mean tokens | seconds |\n|---|---|---|---|---|---|")
    for frequency in (0.0, 0.5):
        share, loopy, long, length, seconds = loops(serve, engine, args.answers, args.max_tokens, frequency)
        print(f"| frequency_penalty {frequency} | {share:.1%} | {loopy} | {long} | {length:.0f} | {seconds:.0f} |",
              flush=True)
    print(f"XLA compilations in all: {len(compilations)}")


if __name__ == "__main__":
    main()
