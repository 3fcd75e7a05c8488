"""Drives a running `serve.py --uds PATH` as its users would, over the unix socket, and measures it.

    python3 scripts/uds_check.py /tmp/serve.sock [--adapter NAME] [--clients 1,8,32,64] [--rounds 3]

First the checks, each a line "ok ..." or "FAILED ...": a completion, a chat, a stream, a system prompt
sent twice (the second must hit the prefix cache), a JSON schema (the answer must parse and hold its
keys), and with --adapter, a request to that adapter. Then the load: for each client count, every client
streams --rounds requests (a varied ~30-token prompt, --max-tokens new tokens, greedy), and the table
gives generated tokens/s over the whole level, and time to first token (p50, p99) and errors. Last, the
XLA compilations the server made on a request's behalf during all of it, from /metrics (must be 0); the
checks may run while the server still compiles in the background, the load waits for it to finish. Standard library only:
it runs on a TPU VM as it is. Exit 1 if a check failed, a request erred or anything compiled.
"""
import argparse
import concurrent.futures
import http.client
import json
import random
import socket
import sys
import time

WORDS = "the river valley canal town boats rail museum history people water bridge summer market".split()


class UnixConnection(http.client.HTTPConnection):
    """http.client over a unix domain socket (serve.py --uds); tests/conftest.py uses it too."""

    def __init__(self, socket_path, timeout=600):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def request(sock, method, path, body=None):
    connection = UnixConnection(sock)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
        return response.status, (json.loads(raw) if raw.startswith(("{", "[")) else raw)
    finally:
        connection.close()


def stream(sock, body, retry_busy=False):
    """(seconds to the first token, completion tokens, seconds in all, 503s retried) of a streamed completion;
    with `retry_busy`, a 503 is retried after a random part of its Retry-After, as the openai client does (its
    wait counts in the time to the first token)."""
    started, retries = time.perf_counter(), 0
    while True:
        connection = UnixConnection(sock)
        try:
            connection.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                               body=json.dumps(body | {"stream": True, "stream_options": {"include_usage": True}}))
            response = connection.getresponse()
            if response.status == 503 and retry_busy:
                retries += 1
                time.sleep(min(float(response.headers.get("Retry-After", 1)), 1.0) * random.random())
                continue
            if response.status != 200:
                raise RuntimeError(f"status {response.status}: {response.read()[:200]!r}")
            first, tokens = None, 0
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if first is None and event.get("choices") and event["choices"][0].get("text"):
                    first = time.perf_counter() - started
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            seconds = time.perf_counter() - started
            return first if first is not None else seconds, tokens, seconds, retries
        finally:
            connection.close()


def metric(sock, name):
    _, text = request(sock, "GET", "/metrics")
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def wait_compiled(sock, timeout=600):
    """Seconds until /health lists nothing still compiling in the background (the server answers before)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        status, body = request(sock, "GET", "/health")
        if status == 200 and not body.get("compiling"):
            break
        time.sleep(0.5)
    return time.perf_counter() - started


def checks(sock, adapter):
    """Yields (ok, what) for each thing a user does first."""
    status, answer = request(sock, "POST", "/v1/completions", {"prompt": "The river", "max_tokens": 8})
    yield status == 200 and answer["usage"]["completion_tokens"] > 0, f"completion: {status}"
    chat = {"messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 8}
    status, answer = request(sock, "POST", "/v1/chat/completions", chat)
    yield status == 200 and answer["choices"][0]["message"]["role"] == "assistant", f"chat: {status}"
    first, tokens, _, _ = stream(sock, {"prompt": "The river", "max_tokens": 8, "temperature": 0})
    yield tokens > 0, f"stream: {tokens} tokens, first after {first * 1000:.0f} ms"
    # The prefix cache takes effect once its programs are compiled: answered before, a prompt is not cached.
    yield True, f"background warm-up done {wait_compiled(sock):.1f}s after the first checks"
    system = {"role": "system", "content": " ".join(WORDS * 8)}
    for question in ("Which town?", "Which bridge?"):
        status, answer = request(sock, "POST", "/v1/chat/completions",
                                 {"messages": [system, {"role": "user", "content": question}], "max_tokens": 4})
    cached = answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) if status == 200 else 0
    yield cached > 0, f"prefix cache: {cached} of {answer['usage']['prompt_tokens']} prompt tokens cached"
    schema = {"type": "object", "properties": {"town": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["town", "year"], "additionalProperties": False}
    status, answer = request(sock, "POST", "/v1/chat/completions", chat | {
        "max_tokens": 48, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
    choice = answer["choices"][0] if status == 200 else {"message": {"content": ""}, "finish_reason": answer}
    content = choice["message"]["content"]
    try:
        parsed = json.loads(content)
        ok = set(parsed) == {"town", "year"} and isinstance(parsed["year"], int)
    except ValueError:  # a random model may not finish the object in max_tokens: it must still be on the grammar
        ok = choice["finish_reason"] == "length" and content.startswith('{"town": "')
    yield ok, f"json schema: {content[:80]!r} (finish {choice['finish_reason']})"
    if adapter:
        status, answer = request(sock, "POST", "/v1/completions", {"model": adapter, "prompt": "The river",
                                                                   "max_tokens": 8})
        yield status == 200 and answer["model"] == adapter, f"adapter {adapter}: {status}"


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def greedy_bodies(clients, rounds, max_tokens, words):
    """clients x rounds completion bodies: a prompt of `words` (low, high) random words, greedy, ignore_eos."""
    rng = random.Random(clients)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))), "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True} for _ in range(clients * rounds)]


def run_clients(clients, bodies, send):
    """`clients` threads, each sending its share of `bodies` one after another: send(body)'s results, or the
    exceptions they raised (counted, not fatal: the table says how many)."""
    def client(i):
        results = []
        for body in bodies[i::clients]:
            try:
                results.append(send(body))
            except Exception as e:
                results.append(e)
        return results
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [r for rs in pool.map(client, range(clients)) for r in rs]


def load(sock, clients, rounds, max_tokens):
    bodies = greedy_bodies(clients, rounds, max_tokens, (20, 40))
    started = time.perf_counter()
    results = run_clients(clients, bodies, lambda body: stream(sock, body))
    seconds = time.perf_counter() - started
    good = [r for r in results if not isinstance(r, Exception)]
    errors = [r for r in results if isinstance(r, Exception)]
    ttft = [r[0] for r in good] or [float("nan")]
    return {"clients": clients, "requests": len(results), "errors": len(errors), "seconds": seconds,
            "tokens_per_second": sum(r[1] for r in good) / seconds,
            "ttft_p50_ms": percentile(ttft, 0.5) * 1000, "ttft_p99_ms": percentile(ttft, 0.99) * 1000,
            "first_error": repr(errors[0])[:200] if errors else ""}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("socket")
    p.add_argument("--adapter", default=None, help="also ask this adapter (a --adapter NAME of the server)")
    p.add_argument("--clients", default="1,8,32,64")
    p.add_argument("--rounds", type=int, default=3, help="streamed requests per client at each level")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    # Counted apart from the background warm-up's: those the server made on a request's behalf.
    compilations = metric(args.socket, "serve_request_compilations_total")
    failed = 0
    _, health = request(args.socket, "GET", "/health")
    print(f"checks start while compiling: {', '.join(health.get('compiling', [])) or 'nothing'}", flush=True)
    for ok, what in checks(args.socket, args.adapter):
        print(f"{'ok' if ok else 'FAILED'} {what}", flush=True)
        failed += not ok
    print(f"| clients | requests | errors | tok/s | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|---|", flush=True)
    for clients in (int(c) for c in args.clients.split(",")):
        row = load(args.socket, clients, args.rounds, args.max_tokens)
        print(f"| {clients} | {row['requests']} | {row['errors']} | {row['tokens_per_second']:,.0f} | "
              f"{row['ttft_p50_ms']:,.0f} ms | {row['ttft_p99_ms']:,.0f} ms |"
              + (f" first error: {row['first_error']}" if row["errors"] else ""), flush=True)
        failed += row["errors"] > 0
    compiled = metric(args.socket, "serve_request_compilations_total") - compilations
    print(f"{'ok' if compiled == 0 else 'FAILED'} XLA compilations during the checks and the load: {compiled:.0f}")
    return 1 if failed or compiled else 0


if __name__ == "__main__":
    sys.exit(main())
