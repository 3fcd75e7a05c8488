"""Training throughput: train_local.py against the article's script, side by side, same model and data.

    python3 scripts/bench_train.py [--small 40 --large 440]
    python3 scripts/bench_train.py --compare OLD_TRAIN_LOCAL_PY   # this train_local.py against an earlier one

Both scripts run twice, at --small and --large examples, and throughput is (tokens at large - tokens at
small) / (time at large - time at small): imports, model loading, compiling and saving cancel out, for
both alike, so what is compared is the training itself. Tokens are the non-pad tokens trained on.
The model is a random Gemma of a few million parameters in hf://google/gemma-2b's layout; the data
mimics Dolly-15k's length mix under the article's template (log-normal, median ~80 tokens, ~2% over
512) since Dolly itself cannot be fetched offline. Peak memory is each process's max RSS.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ARTICLE = REPO.parent / "shared" / "seed" / "train_local_article.py"
WORDS = ("the river valley canal town boats rail museum history people water bridge summer winter market "
         "school train light garden city north south old new small large quiet busy story family road").split()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=40)
    p.add_argument("--large", type=int, default=440)
    p.add_argument("--article", default=str(ARTICLE), help="the article's train_local.py")
    p.add_argument("--compare", default=None, metavar="TRAIN_LOCAL_PY",
                   help="instead of the article's script, another train_local.py (e.g. `git show REV:train_local.py`)")
    return p.parse_args()


def dolly_like(n, seed=0):
    rng = random.Random(seed)
    records = []
    for i in range(n):
        response_words = max(3, int(rng.lognormvariate(np.log(55), 0.9)))
        instruction_words = max(3, int(rng.lognormvariate(np.log(12), 0.5)))
        records.append({"instruction": " ".join(rng.choice(WORDS) for _ in range(instruction_words)) + "?",
                        "context": "", "category": "open_qa",
                        "response": " ".join(rng.choice(WORDS) for _ in range(response_words)) + "."})
    return records


def run(cmd, cwd, env):
    started = time.time()
    process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.time() - started
    if status != 0:
        raise SystemExit(f"{cmd[1]} failed:\n{output[-3000:]}")
    return seconds, usage.ru_maxrss / 2**20


def nonpad_tokens(model_dir, records, seq_len=512):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "tokenizer.model"))
    total = 0
    for r in records:
        n = 2 + len(sp.encode(f"Instruction:\n{r['instruction']}\n\nResponse:\n{r['response']}"))
        total += min(n, seq_len + 1) - 1
    return total


def main():
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    model = work / "model"
    subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_gemma.py"), str(model), "--vocab-size", "4096",
                    "--hidden", "256", "--layers", "4", "--heads", "4", "--kv-heads", "1", "--head-dim", "64",
                    "--intermediate", "1024"], check=True, env=env, capture_output=True)
    records = dolly_like(args.large)
    data = work / "databricks-dolly-15k.jsonl"  # the name the article's script looks for in its cwd
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    lengths = [nonpad_tokens(model, [r]) for r in records]
    print(f"data: {len(records)} records, tokens per example mean {np.mean(lengths):.0f}, median "
          f"{np.median(lengths):.0f}, {np.mean(np.array(lengths) >= 512) * 100:.1f}% truncated at 512")

    results = {}
    other = "article" if args.compare is None else "other"
    for name in (other, "ours"):
        timings = {}
        for n in (args.small, args.large):
            cwd = work / f"{name}-{n}"
            cwd.mkdir()
            shutil.copy(data, cwd / data.name)
            if name == "article":
                cmd = [sys.executable, args.article]
                run_env = dict(env, ARTICLE_MODEL=str(model), ARTICLE_LIMIT=str(n), ARTICLE_SEQ="512")
            else:
                script = str(REPO / "train_local.py") if name == "ours" else args.compare
                cmd = [sys.executable, script, "--model", str(model), "--data", data.name,
                       "--limit", str(n), "--eval-examples", "0", "--compile-cache", ""]
                run_env = env
            timings[n] = run(cmd, cwd, run_env)
            print(f"{name:8} {n:4} examples: {timings[n][0]:6.1f}s wall, peak RSS {timings[n][1]:.2f} GiB", flush=True)
        tokens = nonpad_tokens(model, records[: args.large]) - nonpad_tokens(model, records[: args.small])
        seconds = timings[args.large][0] - timings[args.small][0]
        results[name] = (tokens / seconds, max(t[1] for t in timings.values()))
    print("\n| script | non-pad tokens/s (training) | peak RSS |\n|---|---|---|")
    for name, (tps, rss) in results.items():
        print(f"| {name} | {tps:,.0f} | {rss:.2f} GiB |")
    print(f"\nspeed-up: {results['ours'][0] / results[other][0]:.2f}x; "
          f"memory: {results['ours'][1]:.2f} vs {results[other][1]:.2f} GiB")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
