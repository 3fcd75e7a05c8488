"""Streaming clients against two serve.py side by side (issue #48's "no regression on this machine").

    git show REV:serve.py > /tmp/old_serve.py
    python3 scripts/bench_load.py --compare /tmp/old_serve.py [--clients 64] [--repeats 2] [--model DIR]

Each side serves the same model over --uds with the same flags, and scripts/load_check.py's load runs
against it: every client streams --rounds completions of 128 tokens (greedy, ignore_eos) after a 30-60
word prompt. The sides alternate --repeats times; the table gives each run's tokens/s and time to first
token, and the medians. Without --model, the tests' tiny random Gemma (scripts/make_tiny_gemma.py).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from load_check import level  # noqa: E402
from uds_check import request  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", required=True, metavar="SERVE_PY", help="the other serve.py")
    p.add_argument("--model", default=None)
    p.add_argument("--clients", default="64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--flags", default="", help="more serve.py flags for both sides")
    return p.parse_args()


def serve(script, model, flags, env, work):
    sock = Path(tempfile.mkdtemp(prefix="bl-", dir="/tmp")) / "s.sock"
    log = open(work / f"serve-{Path(script).stem}-{time.time():.0f}.log", "w")
    process = subprocess.Popen([sys.executable, script, "--model", str(model), "--uds", str(sock),
                                "--compile-cache", str(work / "xla"), *flags], env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{script} exited {process.returncode}: see {log.name}")
        try:
            status, body = request(str(sock), "GET", "/health")
            if status == 200 and not body.get("compiling"):
                return process, str(sock)
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{script} never became ready")


def main():
    args = parse_args()
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    model = args.model
    if model is None:
        model = work / "tiny"
        subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_gemma.py"), str(model)], check=True, env=env,
                       capture_output=True)
    sides = {"other (--compare)": args.compare, "this serve.py": str(REPO / "serve.py")}
    runs = {name: {c: [] for c in map(int, args.clients.split(","))} for name in sides}
    for repeat in range(args.repeats):
        for name, script in sides.items():
            process, sock = serve(script, model, args.flags.split(), env, work)
            try:
                for clients in runs[name]:
                    level(sock, clients, args.rounds, args.max_tokens)  # settle: first calls, allocator
                    row = level(sock, clients, args.rounds, args.max_tokens)
                    runs[name][clients].append(row)
                    print(f"{name} run {repeat + 1}, {clients} clients: {row['tokens_per_second']:,.0f} tok/s, "
                          f"TTFT p50 {row['ttft_p50_ms']:,.0f} ms, p99 {row['ttft_p99_ms']:,.0f} ms, "
                          f"{row['errors']} failed", flush=True)
            finally:
                process.terminate()
                process.wait(60)
    print("\n| server | clients | tok/s (median; each run) | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|")
    for name, levels in runs.items():
        for clients, rows in levels.items():
            tps = [r["tokens_per_second"] for r in rows]
            print(f"| {name} | {clients} | {statistics.median(tps):,.0f} ({', '.join(f'{t:,.0f}' for t in tps)}) | "
                  f"{statistics.median(r['ttft_p50_ms'] for r in rows):,.0f} ms | "
                  f"{statistics.median(r['ttft_p99_ms'] for r in rows):,.0f} ms |")
    other, this = (statistics.median(r["tokens_per_second"] for rows in runs[n].values() for r in rows) for n in sides)
    print(f"\nthis serve.py: {this / other:.2f}x the other's tokens/s")


if __name__ == "__main__":
    main()
