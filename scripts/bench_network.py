"""Network conditions: serve.py against the article's server, side by side, same model dir.

    python3 scripts/bench_network.py [--bursts 120,500 --idle 300 --abandon 16]

For each server, in turn:
- bursts: N clients connect at once, each sending one short request; counted by outcome (200, 503,
  connection error: reset, refused or timed out);
- the latency of one short request (16 new tokens) on an idle server, then while --idle connections
  sit open sending nothing, then right after --abandon clients sent a 400-token request and hung up
  (median over --rounds).
The article's server reads max_tokens as total length, so it is sent prompt tokens + new tokens.
"""
import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import ARTICLE, REPO, free_port, make_bench_model, wait_until_up  # noqa: E402

SHORT = "Instruction:\nSay hi.\n\nResponse:\n"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bursts", default="120,500")
    p.add_argument("--idle", type=int, default=300)
    p.add_argument("--abandon", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5, help="abandon-then-time rounds (default: 5)")
    p.add_argument("--timeout", type=float, default=60, help="client timeout for each request")
    p.add_argument("--article", default=str(ARTICLE))
    return p.parse_args()


def post(url, body, timeout):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def burst(url, n, body, timeout):
    """n clients released at once; {outcome: count}."""
    start = threading.Barrier(n)

    def client(_):
        start.wait()
        try:
            return post(url, body, timeout)
        except OSError as e:
            reason = getattr(e, "reason", e)
            return "timeout" if isinstance(reason, TimeoutError) else "connection error"

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(client, range(n)))
    return {k: outcomes.count(k) for k in sorted(set(outcomes), key=str)}


def latency(url, body, timeout, repeats=5):
    times = []
    for _ in range(repeats):
        started = time.time()
        try:
            post(url, body, timeout)
        except OSError:
            return float("inf")
        times.append(time.time() - started)
    return statistics.median(times)


def abandon(port, n, body):
    raw = json.dumps(body).encode()
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(raw), raw))


def measure(name, port, short, long, args):
    url = f"http://127.0.0.1:{port}/"
    row = {}
    for n in map(int, args.bursts.split(",")):
        row[f"burst {n}"] = burst(url, n, short, args.timeout)
        print(f"{name}: burst of {n}: {row[f'burst {n}']}", flush=True)
        time.sleep(2)
    row["idle server"] = latency(url, short, args.timeout)
    idle = []
    try:
        for _ in range(args.idle):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
    row[f"{args.idle} idle connections open"] = latency(url, short, args.timeout, repeats=3)
    for s in idle:
        s.close()
    time.sleep(1)
    after = []
    for _ in range(args.rounds):  # each round: the clients leave, then the short request is timed
        abandon(port, args.abandon, long)
        after.append(latency(url, short, args.timeout, repeats=1))
        time.sleep(1)
    row[f"after {args.abandon} abandoned 400-token requests (median of {args.rounds})"] = statistics.median(after)
    print(f"{name}: {row}", flush=True)
    return row


def main():
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-network-"))
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    hf_dir, model_dir = make_bench_model(work, env)
    import sentencepiece as spm
    prompt_tokens = 1 + len(spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model")).encode(SHORT))
    results = {}

    port = free_port()
    article = subprocess.Popen([sys.executable, args.article], env=dict(env, ARTICLE_MODEL_DIR=str(model_dir),
                               ARTICLE_PORT=str(port)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        short = {"prompt": SHORT, "max_tokens": prompt_tokens + 16}
        long = {"prompt": SHORT, "max_tokens": prompt_tokens + 400}
        deadline = time.time() + 600
        while time.time() < deadline:  # no health check: poll with requests, which also compile both lengths
            try:
                post(f"http://127.0.0.1:{port}/", short, 600)
                post(f"http://127.0.0.1:{port}/", long, 600)
                break
            except OSError:
                time.sleep(1)
        results["article"] = measure("article", port, short, long, args)
    finally:
        article.kill()
        article.wait()

    port = free_port()
    ours = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", str(model_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--compile-cache", ""],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", ours)
        results["ours"] = measure("ours", port, {"prompt": SHORT, "max_tokens": 16, "temperature": 0},
                                  {"prompt": SHORT, "max_tokens": 400, "temperature": 0}, args)
    finally:
        ours.terminate()
        ours.wait()

    keys = list(results["ours"])
    print("\n| measure | article | serve.py |\n|---|---|---|")
    for key in keys:
        cells = []
        for name in ("article", "ours"):
            value = results[name][key]
            if isinstance(value, dict):
                cells.append(", ".join(f"{v} × {k}" for k, v in value.items()))
            else:
                cells.append("no answer (timed out)" if value == float("inf") else f"{value * 1000:.0f} ms")
        print(f"| {key} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
