"""Fills a running `serve.py --uds PATH` with streaming clients and says where the time went (issue #48).

    python3 scripts/load_check.py /tmp/serve.sock [--clients 64,128,256] [--rounds 2] [--engine-log LOG]

The shape of issue #48's measurements: each client streams --rounds completions one after another, each a
prompt of 30-60 words and --max-tokens (128) new tokens, greedy, ignore_eos; a 503 is retried after
its Retry-After (as the openai client does), its wait counted in the time to first token. Per client count,
a row: generated tokens/s over the level, time to first token p50/p99, and, from /metrics before and
after, where the model worker's wall time went (serve_worker_seconds_total: waiting on the device to read
tokens, or host work: admitting, dispatching, handing out tokens; of that, how much was the worker's own CPU,
serve_worker_cpu_seconds_total: the rest it waited for the GIL) and the device's (serve_device_busy_
seconds_total by program, and idle between a batch's dispatches: the host was the wall), the prefill
dispatches and the decode time they stalled, and the process's CPU time by thread (serve_thread_cpu_seconds_total:
the model worker's and the HTTP threads' together near 100% of the wall time, one GIL's worth, say the GIL is the
wall and a front end in its own process would pay). With --engine-log, a log of scripts/tpu_check.py's decode
runs ("generate: batch N: X tok/s"), each row also gives the engine's own decode at the level's batch size,
measured alone in the same run, and the server's share of it. Standard library only: it runs on a TPU VM.
With --grammar, the first level once more with one client asking for JSON throughout (issue #48 item 4).
Exit 1 if a request failed or anything compiled on a request's behalf.
"""
import argparse
import json
import os
import re
import sys
import threading
import time

from uds_check import greedy_bodies, percentile, request, run_clients, stream, wait_compiled


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("socket")
    p.add_argument("--clients", default="64,128,256")
    p.add_argument("--rounds", type=int, default=2, help="streamed requests per client at each level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine-log", default=None, help="scripts/tpu_check.py's output: the engine alone, per batch")
    p.add_argument("--json", default=None, help="also write the rows here, as JSON")
    p.add_argument("--grammar", action="store_true", help="then the first level again with one of its clients "
                   "asking for JSON (a json_schema, again and again until the others are done): what the free rows "
                   "keep of their tokens/s beside a constrained one")
    return p.parse_args()


def scrape(sock):
    """{metric name with labels: value} of /metrics."""
    _, text = request(sock, "GET", "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def level(sock, clients, rounds, max_tokens):
    bodies = greedy_bodies(clients, rounds, max_tokens, (30, 60))
    before, started = scrape(sock), time.perf_counter()
    results = run_clients(clients, bodies, lambda body: stream(sock, body, retry_busy=True))
    seconds, after = time.perf_counter() - started, scrape(sock)
    good = [r for r in results if not isinstance(r, Exception)]
    ttft = [r[0] for r in good] or [float("nan")]
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"clients": clients, "requests": len(results), "errors": len(results) - len(good),
            "first_error": next((repr(r)[:200] for r in results if isinstance(r, Exception)), ""),
            "retries": sum(r[3] for r in good), "seconds": seconds, "tokens_per_second": sum(r[1] for r in good) / seconds,
            "ttft_p50_ms": percentile(ttft, 0.5) * 1000, "ttft_p99_ms": percentile(ttft, 0.99) * 1000,
            "metrics": delta, "batch_sizes": {k: v for k, v in delta.items() if k.startswith("serve_batches_total")}}


SCHEMA = {"type": "object", "properties": {"town": {"type": "string"}, "rivers": {"type": "array", "items": {
    "type": "string"}}, "year": {"type": "integer"}}, "required": ["town", "rivers", "year"]}


def mixed_level(sock, clients, rounds, max_tokens):
    """level() with clients - 1 free clients and one asking for JSON the whole time: (the free rows' tokens/s, the
    JSON requests answered, those that failed)."""
    done, answered, failed = threading.Event(), [0], [0]

    def constrained():
        body = {"messages": [{"role": "user", "content": "Describe a town as JSON."}], "max_tokens": max_tokens,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}
        while not done.is_set():
            status, _ = request(sock, "POST", "/v1/chat/completions", body)
            answered[0] += status == 200
            failed[0] += status != 200
    thread = threading.Thread(target=constrained)
    thread.start()
    try:
        row = level(sock, clients - 1, rounds, max_tokens)
    finally:
        done.set()
        thread.join()
    return row, answered[0], failed[0]


def labelled(delta, name):
    """{label value: delta} of one labelled counter."""
    return {re.search(r'"(.*)"', k).group(1): v for k, v in delta.items() if k.startswith(name + "{")}


def engine_alone(path):
    """{batch size: tok/s} from scripts/tpu_check.py's output."""
    if not path or not os.path.exists(path):
        return {}
    found = re.findall(r"generate: batch (\d+): ([\d,]+) tok/s", open(path).read())
    return {int(b): float(t.replace(",", "")) for b, t in found}


def typical_batch(row):
    """The batch size most of the level's dispatches ran at (serve_batches_total counts active rows)."""
    counts = {int(re.search(r'"(\d+)"', k).group(1)): v for k, v in row["batch_sizes"].items() if v > 0}
    return max(counts, key=counts.get) if counts else 0


def describe(row, alone):
    m = row["metrics"]
    worker, busy = labelled(m, "serve_worker_seconds_total"), labelled(m, "serve_device_busy_seconds_total")
    cpu = labelled(m, "serve_worker_cpu_seconds_total")
    dispatches = labelled(m, "serve_dispatches_total")
    wall = sum(worker.values()) or row["seconds"]
    host = wall - worker.get("read", 0) - worker.get("idle", 0)
    idle = m.get("serve_device_idle_seconds_total", 0.0)
    active = max(typical_batch(row), 1)
    engine = next((alone[b] for b in sorted(alone) if b >= active), alone.get(max(alone), 0) if alone else 0)
    share = f"{row['tokens_per_second'] / engine:.0%} of {engine:,.0f}" if engine else "-"
    prefills = dispatches.get("prefill", 0) + dispatches.get("prefill_group", 0)
    cpu_share = {role: seconds / row["seconds"] for role, seconds in labelled(m, "serve_thread_cpu_seconds_total").items()}
    gil = (f"worker + HTTP {cpu_share['worker'] + cpu_share['http']:.0%} (worker {cpu_share['worker']:.0%}, HTTP "
           f"{cpu_share['http']:.0%}), other Python {cpu_share['python_other']:.0%}, native {cpu_share['native']:.0%}"
           if cpu_share else "-")
    return (f"| {row['clients']} | {row['requests']} ({row['errors']} failed, {row['retries']} retried 503s) | "
            f"{row['tokens_per_second']:,.0f} | {row['ttft_p50_ms']:,.0f} / {row['ttft_p99_ms']:,.0f} ms | {share} | "
            f"{active} | {worker.get('read', 0) / wall:.0%} read, {host / wall:.0%} host "
            f"(dispatch {worker.get('dispatch', 0) / wall:.0%}, settle {worker.get('settle', 0) / wall:.0%}, admit "
            f"{worker.get('admit', 0) / wall:.0%}, resize {worker.get('resize', 0) / wall:.0%}; the worker's CPU "
            f"{(sum(cpu.values()) - cpu.get('read', 0) - cpu.get('idle', 0)) / wall:.0%}, settle's "
            f"{cpu.get('settle', 0) / wall:.0%}) | "
            f"decode {busy.get('decode', 0) + busy.get('decode_long', 0):.2f}s, prefill "
            f"{busy.get('prefill', 0) + busy.get('prefill_group', 0):.2f}s, idle {idle:.2f}s of {row['seconds']:.1f}s | "
            f"{prefills:.0f} ({dispatches.get('prefill_group', 0):.0f} groups of "
            f"{m.get('serve_grouped_prompts_total', 0):.0f}), stalling {m.get('serve_prefill_stall_seconds_total', 0):.2f}s "
            f"| {dispatches.get('decode', 0) + dispatches.get('decode_long', 0):.0f} | {gil} |")


def main():
    args = parse_args()
    print(f"background warm-up finished {wait_compiled(args.socket):.1f}s after the load check started", flush=True)
    alone = engine_alone(args.engine_log)
    compilations = scrape(args.socket).get("serve_request_compilations_total", 0)
    print("| clients | requests | tok/s | TTFT p50 / p99 | of the engine alone | batch | worker's wall time | "
          "device time | prefill dispatches | decode dispatches | threads' CPU, of the wall time |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows, failed = [], 0
    for clients in map(int, args.clients.split(",")):
        row = level(args.socket, clients, args.rounds, args.max_tokens)
        rows.append(row)
        print(describe(row, alone) + (f" first error: {row['first_error']}" if row["errors"] else ""), flush=True)
        failed += row["errors"]
    if args.grammar and rows[0]["clients"] > 1:  # one JSON client beside the others: there must be others
        free = rows[0]
        clients = free["clients"]
        row, answered, bad = mixed_level(args.socket, clients, args.rounds, args.max_tokens)
        kept = (row["tokens_per_second"] / (clients - 1)) / (free["tokens_per_second"] / clients)
        print(f"grammar: {clients - 1} free clients beside one asking for a json_schema ({answered} answered, {bad} "
              f"failed): {row['tokens_per_second']:,.0f} tok/s, {row['tokens_per_second'] / (clients - 1):.1f} a "
              f"row, against {free['tokens_per_second'] / clients:.1f} a row with {clients} free: the free rows keep "
              f"{kept:.0%}; TTFT p50 {row['ttft_p50_ms']:,.0f} ms", flush=True)
        failed += row["errors"] + bad
    compiled = scrape(args.socket).get("serve_request_compilations_total", 0) - compilations
    print(f"{'ok' if compiled == 0 else 'FAILED'} XLA compilations on a request's behalf during the load: {compiled:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "engine_alone": alone}, f, indent=1)
    return 1 if failed or compiled else 0


if __name__ == "__main__":
    sys.exit(main())
