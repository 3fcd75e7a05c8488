"""A mixed soak: every endpoint at once for a long while, and the server's memory over it (issue #50).

    python3 scripts/bench_soak.py [--minutes 30] [--clients 12] [--no-cycle] [--out soak.csv]

serve.py on the benchmarks' small random Gemma (bench_serve.make_bench_model) with --enable-lora, driven
by `--clients` threads that each pick, request after request: the article's POST /, completions with
n > 1, log-probabilities and penalties, chat with a JSON schema and with a required tool, streams that
are read and streams abandoned after their first event, tokenize/detokenize, models, metrics, health,
requests to the adapter (which may just have been unloaded: then a 404 is expected), and bad requests
(each must get its own 4xx). One more thread loads and unloads the adapter every 2 seconds (--no-cycle:
never; the two runs side by side tell what adapter cycling adds).

Every answer is checked against what that kind of request may get; anything else counts as an unexpected
error and is printed. RSS is read from /proc every 15 s and written to --out as a curve; the closing lines
say how many requests ran, the unexpected errors, the compilations after warm-up, and the RSS after the
first minute (what the warm-up and the first requests leave), at the end, and its slope over the second
half, in MiB per 10 minutes: growth that flattens is the allocator settling, growth that keeps its slope
is a leak.
"""
import argparse
import http.client
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_serve import WORDS, free_port, make_bench_model, metric, rss_mib, train_adapters, wait_until_up  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "visits": {"type": "integer"}},
          "required": ["city", "visits"]}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--no-cycle", action="store_true", help="never load or unload the adapter")
    p.add_argument("--out", default=None, help="the RSS curve as CSV (default: a temp file, printed)")
    p.add_argument("--work", default=None, help="where the model and adapter are made (reused when there)")
    return p.parse_args()


def words(rng, low=3, high=30):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def request(port, method, path, body=None, raw=None, timeout=120):
    """(status, body bytes) of one request on a new connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def abandoned_stream(port, rng):
    """A stream read up to its first event, then its connection closed mid-answer."""
    body = json.dumps({"prompt": words(rng), "max_tokens": 64, "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head = s.recv(4096)
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    return status, head


def kinds(rng, adapter):
    """(name, method, path, body or raw bytes, the statuses it may get) for each kind of request."""
    chat = [{"role": "user", "content": words(rng)}]
    return [
        ("article", "POST", "/", {"prompt": words(rng), "max_tokens": rng.choice([8, 16, 32])}, {200}),
        ("completions n=2 logprobs penalties", "POST", "/v1/completions",
         {"prompt": words(rng), "max_tokens": 12, "n": 2, "logprobs": 2, "frequency_penalty": 0.5,
          "repetition_penalty": 1.2, "temperature": 0.8}, {200}),
        ("chat json_schema", "POST", "/v1/chat/completions",
         {"messages": chat, "max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": {
             "name": "visit", "schema": SCHEMA}}}, {200}),
        ("chat tool required", "POST", "/v1/chat/completions",
         {"messages": chat, "max_tokens": 32, "tools": [TOOL], "tool_choice": "required"}, {200}),
        ("stream read", "POST", "/v1/chat/completions", {"messages": chat, "max_tokens": 16, "stream": True}, {200}),
        ("stream abandoned", "STREAM", None, None, {200}),
        ("tokenize", "POST", "/tokenize", {"prompt": words(rng)}, {200}),
        ("detokenize", "POST", "/detokenize", {"tokens": [rng.randrange(3, 400) for _ in range(8)]}, {200}),
        ("models", "GET", "/v1/models", None, {200}),
        ("metrics", "GET", "/metrics", None, {200}),
        ("health", "GET", "/health", None, {200}),
        ("adapter", "POST", "/v1/completions", {"model": adapter, "prompt": words(rng), "max_tokens": 8},
         {200, 404}),  # 404 while the cycler has it unloaded
        ("bad json", "POST", "/v1/completions", b"{not json", {400}),
        ("bad field", "POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, {400}),
        ("bad schema", "POST", "/v1/chat/completions",
         {"messages": chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}, {400}),
        ("unknown model", "POST", "/v1/completions", {"model": "nobody", "prompt": "x"}, {404}),
    ]


def client(port, seed, stop_at, counts, unexpected, lock, adapter):
    rng = random.Random(seed)
    while time.time() < stop_at:
        name, method, path, body, allowed = rng.choice(kinds(rng, adapter))
        try:
            if method == "STREAM":
                status, answer = abandoned_stream(port, rng)
            elif isinstance(body, bytes):
                status, answer = request(port, method, path, raw=body)
            else:
                status, answer = request(port, method, path, body)
            ok = status in allowed or status == 503 and name == "adapter"
        except OSError as e:
            status, answer, ok = type(e).__name__, b"", False
        with lock:
            counts[name] = counts.get(name, 0) + 1
            if not ok:
                unexpected.append(f"{name}: {status} {answer[:200]!r}")
                print(f"unexpected: {unexpected[-1]}", flush=True)


def cycler(port, path, stop_at, counts, unexpected, lock):
    loaded = False
    while time.time() < stop_at:
        route = "/v1/unload_lora_adapter" if loaded else "/v1/load_lora_adapter"
        body = {"lora_name": "cyc"} | ({} if loaded else {"lora_path": str(path)})
        status, answer = request(port, "POST", route, body)
        with lock:
            counts["adapter cycles"] = counts.get("adapter cycles", 0) + 1
            if status != 200:
                unexpected.append(f"{route}: {status} {answer[:200]!r}")
        loaded = not loaded
        time.sleep(2)


def main():
    args = parse_args()
    env = dict(__import__("os").environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    if (work / "hf" / "config.json").exists() and (work / "adapter-0" / "adapter.lora.h5").exists():
        hf_dir, adapter = work / "hf", work / "adapter-0"
    else:
        hf_dir, _ = make_bench_model(work, env)
        [adapter] = train_adapters(work, hf_dir, 1, env)
    port = free_port()
    log_path = work / f"serve-soak{'-no-cycle' if args.no_cycle else ''}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", str(hf_dir), "--host",
                                   "127.0.0.1", "--port", str(port), "--enable-lora", "--max-batch-size", "8",
                                   "--compile-cache", ""], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url + "/health", server)
        compilations = metric(url, "serve_compilations_total")
        started = time.time()
        stop_at = started + args.minutes * 60
        counts, unexpected, lock = {}, [], threading.Lock()
        threads = [threading.Thread(target=client, args=(port, i, stop_at, counts, unexpected, lock, "cyc"))
                   for i in range(args.clients)]
        if not args.no_cycle:
            threads.append(threading.Thread(target=cycler, args=(port, adapter, stop_at, counts, unexpected, lock)))
        for t in threads:
            t.start()
        curve = [(0.0, rss_mib(server.pid))]
        while time.time() < stop_at:
            time.sleep(min(15, max(0.0, stop_at - time.time())))
            curve.append((time.time() - started, rss_mib(server.pid)))
            print(f"{curve[-1][0] / 60:5.1f} min: RSS {curve[-1][1]:,.0f} MiB, {sum(counts.values()):,} requests, "
                  f"{len(unexpected)} unexpected", flush=True)
        for t in threads:
            t.join()
        request_compilations = metric(url, "serve_request_compilations_total")
        compilations = metric(url, "serve_compilations_total") - compilations
    finally:
        server.terminate()
        server.wait(60)
    out = Path(args.out or tempfile.mkstemp(prefix="soak-", suffix=".csv")[1])
    out.write_text("seconds,rss_mib\n" + "".join(f"{s:.0f},{r:.1f}\n" for s, r in curve))
    after_first = next(r for s, r in curve if s >= 60)
    half = [(s, r) for s, r in curve if s >= curve[-1][0] / 2]
    slope = (half[-1][1] - half[0][1]) / max(half[-1][0] - half[0][0], 1) * 600
    print(f"\nsoak {'without' if args.no_cycle else 'with'} adapter cycling: {args.minutes:g} min, {args.clients} "
          f"clients, {sum(counts.values()):,} requests, {len(unexpected)} unexpected errors, {compilations:.0f} "
          f"compilations after warm-up ({request_compilations:.0f} on a request's behalf)")
    print(f"RSS: {curve[0][1]:,.0f} MiB at the start, {after_first:,.0f} after the first minute, {curve[-1][1]:,.0f} at "
          f"the end ({curve[-1][1] - after_first:+,.0f} MiB); second half {slope:+.1f} MiB per 10 min; curve in {out}")
    print("requests: " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
