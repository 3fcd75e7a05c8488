"""The convoy probe: how long a short request waits when it arrives while a long one decodes.

    python3 scripts/bench_convoy.py [--runs 7] [--compare /tmp/old_serve.py]

On bench_serve.py's model (a random Gemma, 4 layers, 256 wide), serve.py with its default flags over
HTTP. Measured, each the median of --runs:
- alone: a short request (8 new tokens) with nothing else running;
- behind: the same request sent 0.1 s after a long one (490 new tokens) started;
- behind / alone: 1 means the short request never waited for the long one.
With --compare, another serve.py (an earlier commit's) is measured the same way first, side by side.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_bench_model, metric, post, wait_until_up  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--long-tokens", type=int, default=490)
    p.add_argument("--short-tokens", type=int, default=8)
    p.add_argument("--compare", default=None, metavar="SERVE_PY", help="another serve.py, measured first")
    return p.parse_args()


def short_request(url, args, i):
    started = time.perf_counter()
    post(url, {"prompt": f"Name a colour, number {i}.", "max_tokens": args.short_tokens, "temperature": 0})
    return time.perf_counter() - started


def probe(script, model_dir, env, args):
    port = free_port()
    server = subprocess.Popen([sys.executable, script, "--model", str(model_dir), "--host", "127.0.0.1",
                               "--port", str(port), "--length-buckets", "128,640", "--compile-cache", ""],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(base + "/health", server)
        url = base + "/v1/completions"
        compiles = metric(base, "serve_compilations_total")
        for i in range(2):  # first requests settle caches and threads
            short_request(url, args, i)
        alone = [short_request(url, args, i) for i in range(args.runs)]
        behind, long_seconds, long_tokens = [], [], []
        for i in range(args.runs):
            def run_long():
                started = time.perf_counter()
                answer = post(url, {"prompt": f"Tell a long story, number {i}.", "max_tokens": args.long_tokens,
                                    "temperature": 0})
                long_seconds.append(time.perf_counter() - started)
                long_tokens.append(answer["usage"]["completion_tokens"])
            long = threading.Thread(target=run_long)
            long.start()
            time.sleep(0.1)
            behind.append(short_request(url, args, 100 + i))
            long.join()
        compiles = metric(base, "serve_compilations_total") - compiles
    finally:
        server.terminate()
        server.wait()
    return (statistics.median(alone), statistics.median(behind), statistics.median(long_seconds),
            statistics.median(long_tokens), compiles)


def main():
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-convoy-"))
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    _, model_dir = make_bench_model(work, env)
    scripts = [("other (--compare)", args.compare)] if args.compare else []
    scripts.append(("this serve.py", str(REPO / "serve.py")))
    rows = []
    for name, script in scripts:
        rows.append((name, *probe(script, model_dir, env, args)))
        print(f"{name}: done", flush=True)
    print(f"\nshort: {args.short_tokens} new tokens; long: {args.long_tokens}; medians of {args.runs}\n")
    print("| server | short alone | short 0.1 s after a long one | behind / alone | long one | compilations |")
    print("|---|---|---|---|---|---|")
    for name, alone, behind, long, long_tokens, compiles in rows:
        print(f"| {name} | {alone * 1000:.0f} ms | {behind * 1000:.0f} ms | {behind / alone:.2f}x | "
              f"{long:.2f} s ({long_tokens:.0f} tokens) | {compiles:.0f} |")


if __name__ == "__main__":
    main()
