"""Serving throughput: serve.py against the article's server, side by side, same model dir.

    python3 scripts/bench_serve.py [--seconds 60 --clients 16 --soak-seconds 600]

16 client threads send prompts of varied length with max_tokens drawn from {16, 32, 48, 64}. The
article's server reads max_tokens as total length, so it is sent prompt tokens + new tokens and both
generate the same. Reported: requests/s and tokens/s for each, XLA compilations in serve.py after
warm-up (from /metrics), and serve.py's RSS over a soak at the same load (--soak-seconds 0 skips it).

    python3 scripts/bench_serve.py --adapters 4 [--seconds 60]

instead measures what many adapters cost: serve.py on the base alone, then the same base with 4 LoRA
adapters (trained on different data seeds) and the same load spread evenly over them, so every decode
batch mixes adapters; requests/s, tokens/s, memory per adapter slot and RSS for each.

    python3 scripts/bench_serve.py --compare /tmp/old_serve.py [--seconds 60]

measures another serve.py (an earlier commit's) against this one on the same load, for before/after.
"""
import argparse
import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARTICLE = REPO.parent / "shared" / "seed" / "serve_article.py"
WORDS = "the river valley canal town boats rail museum history people water bridge summer market".split()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60, help="measurement window per server")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--soak-seconds", type=float, default=600)
    p.add_argument("--article", default=str(ARTICLE))
    p.add_argument("--adapters", type=int, default=0, help="measure N adapters mixed vs the base alone instead")
    p.add_argument("--compare", default=None, metavar="SERVE_PY",
                   help="instead of the article's server, measure another serve.py (e.g. an earlier commit's, from "
                        "`git show REV:serve.py > /tmp/old_serve.py`) against this one, one after the other")
    p.add_argument("--this-flags", default="", help="with --compare: extra flags for this serve.py, e.g. "
                                                    "'--prefix-cache-blocks 0' (the load re-sends 64 prompts)")
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=600):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def wait_until_up(url, process, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:  # ready, and nothing left compiling behind it
                if r.status == 200 and (not url.endswith("/health") or "compiling" not in json.loads(r.read())):
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit("server never came up")


def prompts(encode, n=64, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "Instruction:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + "\n\nResponse:\n"
        out.append((text, 1 + len(encode(text))))  # the article's preprocessor adds <bos>
    return out


def load(url, pool, clients, seconds, article, models=(None,)):
    """Runs `clients` threads against url for `seconds`; returns [requests, generated tokens, failures]."""
    stop_at = time.time() + seconds
    counts = [0, 0, 0]  # completed requests, generated tokens, failed requests (reset connections, errors)
    lock = threading.Lock()

    def client(i):
        rng = random.Random(i)
        while time.time() < stop_at:
            text, prompt_tokens = rng.choice(pool)
            new = rng.choice([16, 32, 48, 64])
            body = {"prompt": text, "max_tokens": prompt_tokens + new if article else new}
            model = models[(i + counts[0]) % len(models)]
            if model is not None:
                body["model"] = model
            try:
                answer = post(url, body)
            except OSError:  # the article's single-threaded server resets connections past its backlog
                with lock:
                    counts[2] += 1
                time.sleep(0.2)
                continue
            generated = new if article else answer["completion_tokens"]
            with lock:
                counts[0] += 1
                counts[1] += generated

    with concurrent.futures.ThreadPoolExecutor(clients) as executor:
        list(executor.map(client, range(clients)))
    return counts


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])


def make_bench_model(work, env):
    """The benchmarks' model: a small random Gemma (4 layers, 256 wide), put through one training step."""
    hf_dir, model_dir = work / "hf", work / "model"
    subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_gemma.py"), str(hf_dir), "--vocab-size", "4096",
                    "--hidden", "256", "--layers", "4", "--heads", "4", "--kv-heads", "1", "--head-dim", "64",
                    "--intermediate", "1024"], check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, str(REPO / "train_local.py"), "--model", str(hf_dir), "--data",
                    str(REPO / "tests/data/dolly_sample.jsonl"), "--limit", "8", "--max-steps", "1",
                    "--eval-examples", "0", "--output", str(model_dir)], check=True, env=env, capture_output=True)
    return hf_dir, model_dir


def train_adapters(work, hf_dir, n, env):
    """n adapters over the benchmark's base, each on other data (seed) with a learning rate that moves it."""
    dirs = []
    for i in range(n):
        out = work / f"adapter-{i}"
        subprocess.run([sys.executable, str(REPO / "train_local.py"), "--model", str(hf_dir), "--data",
                        str(REPO / "tests/data/dolly_sample.jsonl"), "--limit", "16", "--max-steps", "4",
                        "--seed", str(i + 1), "--learning-rate", "1e-3", "--eval-examples", "0", "--output", str(out)],
                       check=True, env=env, capture_output=True)
        dirs.append(out)
    return dirs


def serve_and_load(name, flags, env, pool, args, models, script=str(REPO / "serve.py")):
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix=f"serve-{name}-", suffix=".log")[1])
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, script, "--host", "127.0.0.1", "--port", str(port),
                                   "--max-batch-size", str(args.clients), "--compile-cache", "", *flags],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_up(url + "/health", server)
            rss, compiles = rss_mib(server.pid), metric(url, "serve_compilations_total")
            load(url + "/", pool, args.clients, min(10.0, args.seconds), article=False, models=models)  # settle
            started = time.time()
            counts = load(url + "/", pool, args.clients, args.seconds, article=False, models=models)
            seconds = time.time() - started
            compiles = metric(url, "serve_compilations_total") - compiles
        finally:
            server.terminate()
            server.wait()
    slot = next((line.split(": ")[-1] for line in log_path.read_text().splitlines() if "adapter slots" in line), "-")
    print(f"{name}: {counts[0]} requests ({counts[2]} failed) in {seconds:.0f}s", flush=True)
    return counts[0] / seconds, counts[1] / seconds, counts[2], compiles, rss, slot


def bench_compare(args, env, model_dir, pool):
    """This serve.py against another one (--compare), same model, load and window, one after the other."""
    rows = {}
    for name, script, extra in (("other (--compare)", args.compare, []),
                                (f"this serve.py {args.this_flags}".strip(), str(REPO / "serve.py"),
                                 args.this_flags.split())):
        rows[name] = serve_and_load(name.split()[0], ["--model", str(model_dir), *extra], env, pool, args, (None,),
                                    script=script)
    print("\n| server | requests/s | generated tokens/s | failed | compilations under load |\n|---|---|---|---|---|")
    for name, (rps, tps, failed, compiles, _, _) in rows.items():
        print(f"| {name} | {rps:.2f} | {tps:.1f} | {failed} | {compiles:.0f} |")
    (other, *_), (this, *_) = rows.values()
    print(f"\nthis serve.py: {100 * this / other:.1f}% of the other's requests/s")


def bench_adapters(args, work, env, hf_dir, pool):
    adapters = train_adapters(work, hf_dir, args.adapters, env)
    names = [f"a{i}" for i in range(len(adapters))]
    base_flags = ["--model", str(hf_dir)]
    with_adapters = base_flags + [f for n, d in zip(names, adapters) for f in ("--adapter", f"{n}={d}")]
    own = sum((d / "adapter.lora.h5").stat().st_size for d in adapters) / len(adapters) / 2**20
    rows = {"base alone": serve_and_load("base", base_flags, env, pool, args, (None,)),
            f"base + {len(names)} adapters, requests spread over them": serve_and_load(
                "adapters", with_adapters, env, pool, args, tuple(names))}
    print("\n| server | requests/s | generated tokens/s | failed | compilations under load | RSS after warm-up "
          "| memory per adapter slot |\n|---|---|---|---|---|---|---|")
    for name, (rps, tps, failed, compiles, rss, slot) in rows.items():
        print(f"| {name} | {rps:.2f} | {tps:.1f} | {failed} | {compiles:.0f} | {rss:.0f} MiB | {slot} |")
    (base_rps, *_), (mixed_rps, *_) = rows.values()
    print(f"\nmixed adapters keep {100 * mixed_rps / base_rps:.0f}% of the base's requests/s; each adapter file "
          f"{own:.2f} MiB; base weights {sum(f.stat().st_size for f in hf_dir.glob('*.safetensors')) / 2**20:.1f} MiB")


def main():
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    hf_dir, model_dir = make_bench_model(work, env)
    import sentencepiece as spm
    encode = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model")).encode
    pool = prompts(encode)
    if args.adapters:
        return bench_adapters(args, work, env, hf_dir, pool)
    if args.compare:
        return bench_compare(args, env, model_dir, pool)
    results = {}

    port = free_port()
    article = subprocess.Popen([sys.executable, args.article], env=dict(env, ARTICLE_MODEL_DIR=str(model_dir),
                               ARTICLE_PORT=str(port)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 600
        while time.time() < deadline:  # the article's server has no health check: poll with a request
            try:
                post(url, {"prompt": "hi", "max_tokens": 8}, timeout=600)
                break
            except Exception:
                time.sleep(1)
        started = time.time()
        results["article"] = load(url, pool, args.clients, args.seconds, article=True) + [time.time() - started]
    finally:
        article.terminate()
        article.wait()
    print(f"article: {results['article'][0]} requests ({results['article'][2]} failed) in "
          f"{results['article'][3]:.0f}s", flush=True)

    port = free_port()
    ours = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", str(model_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--max-batch-size", str(args.clients), "--compile-cache", ""],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(base + "/health", ours)
        compiles_after_warm_up = metric(base, "serve_compilations_total")
        started = time.time()
        results["ours"] = load(base + "/", pool, args.clients, args.seconds, article=False) + [time.time() - started]
        print(f"ours: {results['ours'][0]} requests ({results['ours'][2]} failed) in {results['ours'][3]:.0f}s",
              flush=True)
        rss = []
        if args.soak_seconds:
            sampler_done = threading.Event()

            def sample():
                while not sampler_done.wait(10):
                    rss.append((time.time(), rss_mib(ours.pid)))
            threading.Thread(target=sample, daemon=True).start()
            soak = load(base + "/", pool, args.clients, args.soak_seconds, article=False)
            sampler_done.set()
            print(f"soak: {soak[0]} requests ({soak[2]} failed) in {args.soak_seconds:.0f}s", flush=True)
        compiles_at_end = metric(base, "serve_compilations_total")
    finally:
        ours.terminate()
        ours.wait()

    print("\n| server | requests/s | generated tokens/s | failed requests |\n|---|---|---|---|")
    for name, (requests, tokens, failed, seconds) in results.items():
        print(f"| {name} | {requests / seconds:.2f} | {tokens / seconds:.1f} | {failed} |")
    speedup = (results["ours"][0] / results["ours"][3]) / (results["article"][0] / results["article"][3])
    print(f"\nspeed-up: {speedup:.1f}x requests/s; compilations after warm-up: "
          f"{compiles_at_end - compiles_after_warm_up:.0f}")
    if rss:
        first = rss[min(5, len(rss) - 1)][1]  # after the first minute, once allocator pools have grown
        last, peak = rss[-1][1], max(r for _, r in rss)
        print(f"RSS over {args.soak_seconds:.0f}s soak: {first:.0f} MiB at 1 min -> {last:.0f} MiB at end "
              f"(peak {peak:.0f} MiB, {100 * (last - first) / first:+.1f}%)")


if __name__ == "__main__":
    main()
