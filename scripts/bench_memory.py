"""Memory and speed per precision on the real Gemma 3 270M, side by side in one run (CPU).

    python3 scripts/bench_memory.py [--settings float32,bfloat16,int8,int4] [--skip-training]

Serving, each setting in a fresh process (serve.py's own loading and engine): weight memory,
resident memory after warm-up and its peak, decode tokens/s at batch 1 and 8 (64 new tokens after
a 32-token prompt, greedy, its prefill included; and decoding alone: the time 64 more tokens a row
take, 80 new tokens against 16), next to the limit decoding one token per row can reach: every step reads
every weight once, so tokens/s <= rows x read bandwidth / weight bytes, with the bandwidth measured in
the same process (a jitted sum over 256 MiB). int8/int4 quantize a float32 load, as `serve.py
--quantize` does.
Training, each setting: train_local.py with the demo's 40 steps (int8/int4: QLoRA, `--quantize`):
ms per step, eval loss after, peak RSS.

    python3 scripts/bench_memory.py --servers [--compare OLD_SERVE_PY] [--repeats N]

The server as users run it (issue #35): `serve.py` with `--length-buckets 128 --max-batch-size 2`,
float32 and int8, the prefix cache off and on, each started fresh, after its warm-up and one request:
its RSS and the memory table it logs (where the RSS went, stage by stage), then its RSS after a request
for JSON (structured output's token table is built by the first that wants it); with --compare, the same
for another serve.py (e.g. an older commit's, `git show 43dff77:serve.py > /tmp/old.py`) side by side.

    python3 scripts/bench_memory.py --restarts

The same server started three times per setting (float32 and int8, prefix cache on) on one compile cache:
cold, then from the program store, then with XLA's compilation cache alone (the program store emptied):
launch to ready and to nothing left compiling, RSS, compilations (issue #33).
"""
import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_TRAINING = ["--data", str(REPO / "tests/data/dolly_sample.jsonl"), "--limit", "160", "--eval-examples", "40",
                 "--max-steps", "40", "--sequence-length", "256", "--loss-on", "response", "--learning-rate", "5e-4"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".demo" / "gemma3-270m"),
                   help="transformers-layout Gemma dir (converted from the PyPI GGUF when missing)")
    p.add_argument("--settings", default="float32,bfloat16,int8,int4")
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--servers", action="store_true", help="measure serve.py itself, run as a server (see above)")
    p.add_argument("--restarts", action="store_true", help="serve.py cold, then from the program store, then "
                   "from XLA's cache alone (see above)")
    p.add_argument("--compare", default=None, metavar="OLD_SERVE_PY", help="with --servers: also this serve.py")
    p.add_argument("--repeats", type=int, default=1, help="with --servers: runs of each server (the same serve.py "
                   "reads 35-90 MiB apart from one run to the next); the table has their medians")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one serving setting, in its own process
    return p.parse_args()


def memory_mib(pid="self"):
    status = Path(f"/proc/{pid}/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}


def read_bandwidth(mib=256):
    """Bytes/s a jitted sum streams from memory (best of 10 over 256 MiB: bigger than any cache; on a GPU,
    pass more, or the dispatch's own microseconds weigh in)."""
    import jax
    import jax.numpy as jnp
    data = jnp.ones(mib << 18, jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        total(data).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def flags_for(setting):
    if setting in ("float32", "bfloat16"):
        return ["--dtype", setting]
    return ["--dtype", "float32", "--quantize", setting]


def serve_worker(model_dir, setting):
    sys.path.insert(0, str(REPO))
    import numpy as np
    import serve
    from gemma_lora.engine.engine import Engine
    from gemma_lora.interface import SAMPLER_DEFAULTS, Generation
    from gemma_lora.model import keep_unused_imports_out, load_model
    keep_unused_imports_out()
    model, _, _ = load_model(serve.parse_args(["--model", model_dir, *flags_for(setting)]))
    weights = sum(w.value.nbytes for w in model.weights)
    engine = Engine(model, [1, 8], [128], None)
    engine.warm_up()
    bandwidth = read_bandwidth()
    row = {"setting": setting, "weights_mib": weights / 2**20, **{k: v for k, v in memory_mib().items()},
           "read_gb_s": bandwidth / 1e9, "limit_tok_s_batch1": bandwidth / weights}
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        def run(new_tokens):  # (seconds, tokens made) for `batch` requests of a 32-token prompt
            gens = [Generation([engine.bos] + rng.integers(1000, 20000, 31).tolist(), new_tokens,
                               SAMPLER_DEFAULTS["greedy"], 0, [], None) for _ in range(batch)]
            started = time.perf_counter()
            # One request in the smallest batch the engine keeps (quantized on the CPU: two rows, one idle).
            engine.generate(gens, engine.batch_for(batch))
            return time.perf_counter() - started, sum(len(g.ids) for g in gens)
        run(64)  # one untimed pass
        seconds, made = run(64)
        row[f"decode_tok_s_batch{batch}"] = made / seconds  # the prompt's prefill included
        # Decoding alone, what the limit bounds: the time 64 more tokens a row take (80 against 16), best of 2.
        (short, short_made), (long, long_made) = (min(run(n) for _ in range(2)) for n in (16, 80))
        row[f"decode_only_tok_s_batch{batch}"] = (long_made - short_made) / (long - short)
    row["VmRSS_after_warm_up"] = row.pop("VmRSS")
    row["VmHWM_peak"] = memory_mib()["VmHWM"]
    print("RESULT " + json.dumps(row), flush=True)


def train(model_dir, setting, work):
    out = work / f"train-{setting}"
    flags = ["--dtype", "bfloat16"] if setting == "bfloat16" else [] if setting == "float32" else \
        ["--quantize", setting]
    result = subprocess.run([sys.executable, str(REPO / "train_local.py"), "--model", model_dir, *DEMO_TRAINING,
                             *flags, "--output", str(out), "--compile-cache", ""], capture_output=True, text=True)
    if result.returncode:
        return {"setting": setting, "error": (result.stdout + result.stderr)[-400:]}
    record = json.loads((out / "training.json").read_text())
    peak = re.search(r"peak host RSS ([\d.]+) GiB", result.stdout)
    return {"setting": setting, "ms_per_step": 1000 * record["seconds"] / len(record["history"]),
            "eval_loss_before": record["eval_loss_before"], "eval_loss_after": record["eval_loss_after"],
            "peak_rss_gib": float(peak.group(1)) if peak else None}


SERVER_SETTINGS = {"float32, prefix cache off": ["--dtype", "float32", "--prefix-cache-blocks", "0"],
                   "float32, prefix cache default": ["--dtype", "float32"],
                   "int8, prefix cache off": ["--quantize", "int8", "--prefix-cache-blocks", "0"],
                   "int8, prefix cache default": ["--quantize", "int8"]}


def request(url, body=None):
    import urllib.error
    import urllib.request
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, {"Content-Type": "application/json"}),
                                    timeout=600) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def measure_server(serve_py, model_dir, flags, env, work, cache=""):
    """(RSS MiB after warm-up and one request, the memory table lines the server logged, its answer, seconds
    from launch to the first /health 200 and to nothing left compiling, its /metrics counters). Over TCP: an
    older serve.py has no --uds."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, log_path = f"http://127.0.0.1:{port}", work / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, serve_py, "--model", model_dir, "--port", str(port),
                                   "--compile-cache", cache, "--length-buckets", "128", "--max-batch-size", "2",
                                   *flags],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    started, ready = time.time(), None
    try:
        deadline = started + 1800
        while time.time() < deadline and server.poll() is None:
            try:
                status, body = request(url + "/health")
                ready = ready or (time.time() - started if status == 200 else None)
                if status == 200 and not body.get("compiling"):
                    break
            except OSError:
                pass
            time.sleep(0.25)
        complete = time.time() - started
        _, answer = request(url + "/v1/completions", {"prompt": "The river", "max_tokens": 16, "temperature": 0})
        rss = memory_mib(server.pid)["VmRSS"]
        import urllib.request
        with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
            metrics = dict(line.split(" ", 1) for line in response.read().decode().splitlines()
                           if line.startswith("serve_") and " " in line)
        request(url + "/v1/completions", {"prompt": "A river as JSON:", "max_tokens": 16, "temperature": 0,
                                          "response_format": {"type": "json_object"}})
        structured_rss = memory_mib(server.pid)["VmRSS"]
    finally:
        server.terminate()
        server.wait(60)
    table = [l.split(" ", 1)[1] for l in log_path.read_text().splitlines() if " memory: " in l]
    counters = {k: float(v) for k, v in metrics.items() if k.endswith("_total")}
    return rss, table, answer["choices"][0]["text"], ready, complete, counters, structured_rss


def servers(args, env):
    work = Path(tempfile.mkdtemp(prefix="bench-memory-servers-"))
    sides = [("this serve.py", str(REPO / "serve.py"))] + ([("--compare", args.compare)] if args.compare else [])
    rows = collections.defaultdict(list)  # (setting, side) -> [(RSS, RSS after a JSON request)] per repeat
    for repeat in range(args.repeats):  # the sides alternate, so a slower or busier spell falls on both
        for name, flags in SERVER_SETTINGS.items():
            for side, serve_py in sides:
                rss, table, text, ready, complete, _, structured = measure_server(serve_py, args.model, flags, env,
                                                                                  work)
                rows[name, side].append((rss, structured))
                print(f"{name}, {side}: RSS {rss:,.0f} MiB after warm-up and one request, {structured:,.0f} after a "
                      f"structured one; ready {ready:.1f}s after launch, nothing left compiling after {complete:.1f}s; "
                      f"answer {text!r}", flush=True)
                for line in table:
                    print(f"    {line}", flush=True)

    def cell(runs):
        median = [statistics.median(run[i] for run in runs) for i in (0, 1)]
        spread = "" if len(runs) == 1 else f" ({'/'.join(f'{rss:,.0f}' for rss, _ in runs)})"
        return f"{median[0]:,.0f}{spread} | {median[1]:,.0f}"
    print(f"\n{'Medians of ' + str(args.repeats) + ' runs, each run in brackets.' if args.repeats > 1 else ''}\n"
          "| setting | " + " | ".join(f"RSS MiB ({side}) | after a JSON request" for side, _ in sides)
          + " |\n|---|" + "---|---|" * len(sides))
    for name in SERVER_SETTINGS:
        print(f"| {name} | " + " | ".join(cell(rows[name, side]) for side, _ in sides) + " |")
    for side, _ in sides:
        ratios = [i / f for (f, _), (i, _) in zip(rows["float32, prefix cache default", side],
                                                  rows["int8, prefix cache default", side])]
        print(f"int8 / float32, prefix cache default ({side}): {statistics.median(ratios):.3f}"
              f"{'' if len(ratios) == 1 else ' (' + ', '.join(f'{r:.3f}' for r in ratios) + ')'}")


def restarts(args, env):
    """serve.py started three times per setting on one compile cache: cold, then from the program store,
    then with XLA's compilation cache alone (the program store emptied) (issue #33)."""
    import shutil
    work = Path(tempfile.mkdtemp(prefix="bench-memory-restarts-"))
    rows = []
    for name in ("float32, prefix cache default", "int8, prefix cache default"):
        cache = work / name.split(",")[0]
        for start in ("cold", "program store", "XLA's cache"):  # on a CPU, XLA's cache hits are not stored
            if start == "XLA's cache":
                shutil.rmtree(cache / "programs")
            rss, _, text, ready, complete, metrics, _ = measure_server(str(REPO / "serve.py"), args.model,
                                                                    SERVER_SETTINGS[name], env, work, cache=str(cache))
            rows.append((name, start, ready, complete, rss, metrics.get("serve_compilations_total", 0),
                         metrics.get("serve_compile_cache_hits_total", 0), text))
            print(rows[-1], flush=True)
    print("\n| setting | start | ready after launch | nothing left compiling | RSS MiB | XLA compilations (from its cache) "
          "| answer |\n|---|---|---|---|---|---|---|")
    for name, start, ready, complete, rss, compiled, hits, text in rows:
        print(f"| {name} | {start} | {ready:.1f} s | {complete:.1f} s | {rss:,.0f} | {compiled:.0f} ({hits:.0f}) "
              f"| {text[:24]!r} |")


def main():
    args = parse_args()
    if args.worker:
        return serve_worker(args.model, args.worker)
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    if not (Path(args.model) / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "gguf_to_hf.py"), args.model], check=True, env=env)
    if args.servers:
        return servers(args, env)
    if args.restarts:
        return restarts(args, env)
    settings = args.settings.split(",")
    serving = []
    for setting in settings:
        result = subprocess.run([sys.executable, __file__, "--model", args.model, "--worker", setting],
                                capture_output=True, text=True, env=env)
        line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
        serving.append(json.loads(line[7:]) if line else {"setting": setting, "error": result.stderr[-400:]})
        print(serving[-1], flush=True)
    training = []
    if not args.skip_training:
        work = Path(tempfile.mkdtemp(prefix="bench-memory-"))
        for setting in settings:
            training.append(train(args.model, setting, work))
            print(training[-1], flush=True)

    print("\n| serving | weights MiB | RSS after warm-up MiB | peak RSS MiB | limit, batch 1 (read GB/s) "
          "| tok/s batch 1, with prefill | decoding alone | of limit | batch 8, with prefill | decoding alone "
          "| of 8x limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in serving:
        if "error" in row:
            print(f"| {row['setting']} | failed: {row['error'][-120:]!r} ||||||||||")
            continue
        limit = row["limit_tok_s_batch1"]
        print(f"| {row['setting']} | {row['weights_mib']:,.0f} | {row['VmRSS_after_warm_up']:,.0f} | "
              f"{row['VmHWM_peak']:,.0f} | {limit:.1f} ({row['read_gb_s']:.1f}) | {row['decode_tok_s_batch1']:.1f} | "
              f"{row['decode_only_tok_s_batch1']:.1f} | {row['decode_only_tok_s_batch1'] / limit:.0%} | "
              f"{row['decode_tok_s_batch8']:.1f} | {row['decode_only_tok_s_batch8']:.1f} | "
              f"{row['decode_only_tok_s_batch8'] / (8 * limit):.0%} |")
    if training:
        print("\n| training (demo's 40 steps) | ms/step | eval loss before -> after | peak RSS GiB |\n|---|---|---|---|")
        for row in training:
            if "error" in row:
                print(f"| {row['setting']} | failed: {row['error'][-120:]!r} |||")
                continue
            print(f"| {row['setting']} | {row['ms_per_step']:.0f} | {row['eval_loss_before']:.3f} -> "
                  f"{row['eval_loss_after']:.3f} | {row['peak_rss_gib']} |")


if __name__ == "__main__":
    main()
