"""Automatic prefix caching on the real Gemma 3 270M (CPU): serve.py with the cache on and off,
side by side in one run, the same three workloads against each, float32 weights (bfloat16 is slow on CPUs).

    python3 scripts/bench_prefix_cache.py [--seconds 60]

1. Shared system prompt: a ~1,000-token system message and short user questions, 8 clients, streamed
   (16 new tokens each): time to the first token (p50, p90) and requests/s.
2. Multi-turn: one 6-turn conversation that re-sends its history each turn (32 new tokens a turn, the
   answer appended): time to the first token per turn.
3. No shared prefix: bench_serve.py's mix (prompts of 3-60 random words, 16-64 new tokens), 8 clients:
   requests/s.
Each server's XLA compilations after warm-up are read from /metrics, and the cached prompt tokens.
"""
import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import WORDS, free_port, metric, wait_until_up  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RULES = ["Greet the customer by name when the name is known.", "Never promise a delivery date the system does not show.",
         "Refunds over 200 euros need a supervisor's approval.", "Quote prices with VAT included.",
         "Offer the loyalty discount only to members of at least one year.", "Escalate safety complaints at once.",
         "Keep answers under three sentences unless asked for detail.", "Do not share other customers' orders.",
         "Returns are accepted within 30 days with the receipt.", "Gift cards cannot be exchanged for cash."]
QUESTIONS = ["Can I return a lamp after 20 days?", "Do prices include VAT?", "Can I get cash for a gift card?",
             "Who approves a 300 euro refund?", "How long may answers be?", "Can you tell me my neighbour's order?",
             "When will my sofa arrive?", "Am I owed the loyalty discount after six months?"]
TURNS = ["Hello, I bought a lamp three weeks ago.", "It flickers. Can I return it?", "I lost the receipt though.",
         "What if I paid by card?", "Could I get a gift card instead?", "Thanks. Anything else I should know?"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".demo" / "gemma3-270m"),
                   help="transformers-layout Gemma dir (converted from the PyPI GGUF when missing)")
    p.add_argument("--seconds", type=float, default=60, help="measurement window of each load")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--mixed-only", action="store_true",
                   help="only the no-shared-prefix load, on fresh servers: off, on, off again (the cache's overhead, "
                        "with the machine's drift over the run)")
    return p.parse_args()


def system_prompt():
    """About 1,000 tokens of store policy: numbered rules, repeated with section headings."""
    lines = ["You are the support assistant of a furniture store. Follow the policy below exactly."]
    for section in range(1, 8):
        lines.append(f"Section {section}.")
        lines += [f"{section}.{i + 1} {rule}" for i, rule in enumerate(RULES)]
    return "\n".join(lines)


def stream_chat(url, messages, max_tokens):
    """(seconds to the first content token, seconds to the end, text) of a streamed chat completion."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started, first, text = time.time(), None, ""
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            piece = delta[0]["delta"].get("content") if delta else None
            if piece:
                first = first or time.time() - started
                text += piece
    return first if first is not None else time.time() - started, time.time() - started, text


def shared_system_load(url, clients, seconds):
    system, stop_at, ttfts, done = system_prompt(), time.time() + seconds, [], [0]
    lock = threading.Lock()

    def client(i):
        rng = random.Random(i)
        while time.time() < stop_at:
            ttft, _, _ = stream_chat(url, [{"role": "system", "content": system},
                                           {"role": "user", "content": rng.choice(QUESTIONS)}], 16)
            with lock:
                ttfts.append(ttft)
                done[0] += 1
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return ttfts, done[0] / (time.time() - started)


def multi_turn(url):
    messages, ttfts = [{"role": "system", "content": system_prompt()}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ttft, _, text = stream_chat(url, messages, 32)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": text})
    return ttfts


def mixed_load(url, clients, seconds):
    """bench_serve.py's workload: no two prompts share a whole block beyond <bos> and 'Instruction:'."""
    stop_at, done = time.time() + seconds, [0]
    lock = threading.Lock()

    def client(i):
        rng = random.Random(100 + i)
        while time.time() < stop_at:
            text = "Instruction:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + "\n\nResponse:\n"
            body = {"prompt": text, "max_tokens": rng.choice([16, 32, 48, 64])}
            request = urllib.request.Request(url + "/", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=900) as response:
                json.load(response)
            with lock:
                done[0] += 1
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return done[0] / (time.time() - started)


def run_server(name, flags, args, env):
    port = free_port()
    log_path = REPO / "bench-out" / f"prefix-{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", args.model, "--host", "127.0.0.1",
                                   "--port", str(port), "--max-batch-size", str(args.clients), "--dtype", "float32", "--length-buckets",
                                   "256,1536", "--compile-cache", str(REPO / "bench-out" / "xla-cache"), *flags],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            started = time.time()
            wait_until_up(url + "/health", server, timeout=3600)
            warm_up = time.time() - started
            compiles = metric(url, "serve_compilations_total")
            stream_chat(url, [{"role": "user", "content": "Hi"}], 4)  # settle
            if args.mixed_only:
                mixed = mixed_load(url, args.clients, args.seconds)
                print(f"{name}: no shared prefix {mixed:.3f} requests/s", flush=True)
                return {"mixed": mixed}
            ttfts, rps = shared_system_load(url, args.clients, args.seconds)
            print(f"{name}: shared system prompt {rps:.3f} requests/s, TTFT p50 {statistics.median(ttfts):.2f}s",
                  flush=True)
            turns = multi_turn(url)
            print(f"{name}: multi-turn TTFT {[round(t, 2) for t in turns]}", flush=True)
            mixed = mixed_load(url, args.clients, args.seconds)
            print(f"{name}: no shared prefix {mixed:.3f} requests/s", flush=True)
            result = {"ttfts": ttfts, "rps": rps, "turns": turns, "mixed": mixed, "warm_up": warm_up,
                      "compiles": metric(url, "serve_compilations_total") - compiles,
                      "cached": metric(url, "serve_cached_prompt_tokens_total"),
                      "prompt": metric(url, "serve_prompt_tokens_total")}
        finally:
            server.terminate()
            server.wait()
    return result


def main():
    args = parse_args()
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "gguf_to_hf.py"), args.model], check=True, env=env)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(Path(args.model) / "tokenizer.model"))
    print(f"system prompt: {len(sp.encode(system_prompt()))} tokens", flush=True)
    if args.mixed_only:  # off, on, off again: the machine's drift over the run shows in the two offs
        rates = [run_server(name, flags, args, env)["mixed"] for name, flags in (
            ("off", ["--prefix-cache-blocks", "0"]), ("on", []), ("off-again", ["--prefix-cache-blocks", "0"]))]
        print(f"\nno shared prefix, fresh servers: off {rates[0]:.3f}, on {rates[1]:.3f}, off again {rates[2]:.3f} "
              f"requests/s: on / mean off {2 * rates[1] / (rates[0] + rates[2]):.3f}×")
        return
    results = {"off": run_server("off", ["--prefix-cache-blocks", "0"], args, env),
               "on": run_server("on", [], args, env)}
    off, on = results["off"], results["on"]

    def p(values, q):
        return sorted(values)[int(q * (len(values) - 1))]
    print(f"\n{args.clients} clients, {args.seconds:.0f} s per load, greedy; length buckets 256,1536\n")
    print("| workload | measure | cache off | cache on | on / off |\n|---|---|---|---|---|")
    for label, key in (("TTFT p50", 0.5), ("TTFT p90", 0.9)):
        a, b = p(off["ttfts"], key), p(on["ttfts"], key)
        print(f"| shared ~1,000-token system prompt | {label} | {a:.2f} s | {b:.2f} s | {b / a:.3f}× |")
    print(f"| shared system prompt | requests/s | {off['rps']:.3f} | {on['rps']:.3f} | {on['rps'] / off['rps']:.2f}× |")
    for turn, (a, b) in enumerate(zip(off["turns"], on["turns"]), 1):
        print(f"| 6-turn conversation | TTFT, turn {turn} | {a:.2f} s | {b:.2f} s | {b / a:.3f}× |")
    print(f"| no shared prefix (bench_serve mix) | requests/s | {off['mixed']:.3f} | {on['mixed']:.3f} | "
          f"{on['mixed'] / off['mixed']:.3f}× |")
    print(f"| all | compilations after warm-up | {off['compiles']:.0f} | {on['compiles']:.0f} | |")
    print(f"| all | warm-up | {off['warm_up']:.0f} s | {on['warm_up']:.0f} s | |")
    print(f"\ncache on: {on['cached']:.0f} of {on['prompt']:.0f} prompt tokens served from the cache "
          f"({100 * on['cached'] / on['prompt']:.0f}%)")


if __name__ == "__main__":
    main()
