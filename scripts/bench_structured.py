"""Structured output on the real Gemma 3 270M (CPU, float32, pretrained, not instruction-tuned), one run.

    python3 scripts/bench_structured.py [--prompts 50]
    python3 scripts/bench_structured.py --mixed|--lone [--compare OLD_SERVE_PY]

1. Extraction: 50 short order descriptions, each to be turned into JSON for a nested schema (objects,
   an array of objects, enums, integers, required fields). The schema is in the prompt either way; the
   share of answers that parse and validate (jsonschema) without the constraint and with it
   (response_format json_schema).
2. Cost: generated tokens/s of constrained requests against free ones (the same prompts, the same
   max_tokens, greedy) with 1 and with 8 clients; the host time per token mask (/metrics); XLA
   compilations after warm-up.
3. With --mixed (instead of 1 and 2): what one constrained row costs the free rows beside it. Seven clients
   ask for free text (greedy, 96 tokens, ignore_eos) while an eighth asks for free text too, or asks for
   the JSON extraction again and again until the seven are done; the seven's tokens/s both ways, median of
   3 rounds, for this serve.py and (--compare) an older one, side by side in one run.
4. With --lone: one client, the extraction alone (8 prompts, twice, after a first), and free text; the
   constrained tokens dropped (drawn past a dispatch's first token and not kept). --compare as in 3.
"""
import argparse
import concurrent.futures
import contextlib
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

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, metric, wait_until_up  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PRODUCTS = ["lamp", "table", "chair", "sofa", "shelf", "rug"]
SCHEMA = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"product": {"enum": PRODUCTS},
                                         "quantity": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["product", "quantity"], "additionalProperties": False}},
    "delivery": {"enum": ["standard", "express"]},
    "city": {"type": "string", "maxLength": 30}},
    "required": ["customer", "items", "delivery", "city"], "additionalProperties": False}
NAMES = ["Maria Lopez", "Jonas Berg", "Aiko Tanaka", "Samuel Okafor", "Lena Novak", "Omar Haddad", "Chloé Martin"]
FREE_TOKENS = 96
CITIES = ["Lisbon", "Oslo", "Kyoto", "Lagos", "Prague", "Cairo", "Lyon"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".demo" / "gemma3-270m"),
                   help="transformers-layout Gemma dir (converted from the PyPI GGUF when missing)")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--mixed", action="store_true", help="only part 3: free rows beside a constrained one")
    p.add_argument("--lone", action="store_true", help="only part 4: a constrained request alone")
    p.add_argument("--compare", default=None, metavar="OLD_SERVE_PY", help="with --mixed or --lone: also this serve.py")
    return p.parse_args()


def orders(n):
    rng = random.Random(0)
    out = []
    for _ in range(n):
        items = rng.sample(PRODUCTS, rng.randint(1, 3))
        quantities = [rng.randint(1, 5) for _ in items]
        text = (f"{rng.choice(NAMES)}, {rng.randint(19, 80)} years old, ordered "
                + " and ".join(f"{q} {p}{'s' if q > 1 else ''}" for p, q in zip(items, quantities))
                + f", {rng.choice(['standard', 'express'])} delivery to {rng.choice(CITIES)}.")
        out.append([{"role": "user", "content": "Extract the order as JSON with this JSON Schema:\n"
                     + json.dumps(SCHEMA) + "\n\nOrder: " + text}])
    return out


def ask(url, messages, constrained):
    body = {"messages": messages, "max_tokens": 160, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        answer = json.load(response)
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]


def valid(text):
    text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def throughput(url, prompts, constrained, clients):
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda m: ask(url, m, constrained), prompts))
    return sum(tokens for _, tokens in answers) / (time.time() - started), answers


def free_text(url, prompt):
    body = {"prompt": prompt, "max_tokens": FREE_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.load(response)["usage"]["completion_tokens"]


def free_rows_rate(url, prompts, extraction, constrained):
    """Tokens/s of seven free requests sent together with an eighth: free text, or (constrained) the
    extraction asked again and again until the seven are done."""
    done = threading.Event()

    def eighth():
        while not done.is_set():
            ask(url, extraction, True) if constrained else free_text(url, prompts[-1])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        beside = pool.submit(eighth)
        started = time.time()
        tokens = sum(pool.map(lambda p: free_text(url, p), prompts[:7]))
        rate = tokens / (time.time() - started)
        done.set()
        beside.result()
    return rate


def mixed(url, prompts):
    extraction = orders(1)[0]
    rates = {False: [], True: []}
    for _ in range(3):
        for constrained in (False, True):
            rates[constrained].append(free_rows_rate(url, prompts, extraction, constrained))
    return {c: statistics.median(r) for c, r in rates.items()}


@contextlib.contextmanager
def server_at(serve_py, model, env, name):
    port = free_port()
    log_path = REPO / "bench-out" / f"structured-{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, serve_py, "--model", model, "--host", "127.0.0.1",
                                   "--port", str(port), "--max-batch-size", "8", "--dtype", "float32", "--length-buckets", "512",
                                   "--compile-cache", str(REPO / "bench-out" / "xla-cache")],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_up(url + "/health", server, timeout=3600)
            yield url
        finally:
            server.terminate()
            server.wait()


def main_lone(args, env):
    prompts = orders(8)
    sides = [("this serve.py", str(REPO / "serve.py"))] + ([("--compare", args.compare)] if args.compare else [])
    for name, serve_py in sides:
        with server_at(serve_py, args.model, env, "lone-" + name.strip("-").split()[-1].replace(".", "_")) as url:
            throughput(url, prompts[:1], True, 1)  # a first answer
            rates = [throughput(url, prompts, True, 1)[0] for _ in range(2)]
            free = throughput(url, prompts[:4], False, 1)[0]
            print(f"{name}: constrained, one client, tok/s {' / '.join(f'{r:.1f}' for r in rates)}; free text "
                  f"{free:.1f}; dropped tokens {metric(url, 'serve_grammar_dropped_tokens_total')}", flush=True)


def main_mixed(args, env):
    prompts = [f"Instruction:\nWrite about {topic}.\n\nResponse:\n" for topic in
               ("rivers", "trains", "bread", "music", "glass", "winter", "bees", "maps")]
    sides = [("this serve.py", str(REPO / "serve.py"))] + ([("--compare", args.compare)] if args.compare else [])
    results = {}
    for name, serve_py in sides:
        with server_at(serve_py, args.model, env, "mixed-" + name.strip("-").split()[-1].replace(".", "_")) as url:
            compiles = metric(url, "serve_compilations_total")
            results[name] = mixed(url, prompts) | {"compiles": metric(url, "serve_compilations_total") - compiles,
                                                   "dropped": metric(url, "serve_grammar_dropped_tokens_total")}
            print(f"{name}: {results[name]}", flush=True)
    print(f"\nSeven free requests (greedy, {FREE_TOKENS} tokens) beside an eighth, batch 8, median of 3 rounds\n")
    print("| serve.py | free rows' tok/s, eighth free | eighth constrained (JSON schema) | ratio | compilations |\n"
          "|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r[False]:.1f} | {r[True]:.1f} | {100 * r[True] / r[False]:.0f}% | {r['compiles']:.0f} |")


def main():
    args = parse_args()
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "gguf_to_hf.py"), args.model], check=True, env=env)
    if args.mixed or args.lone:
        return (main_mixed if args.mixed else main_lone)(args, env)
    prompts = orders(args.prompts)
    with server_at(str(REPO / "serve.py"), args.model, env, "serve") as url:
        compiles = metric(url, "serve_compilations_total")
        results = {}
        for constrained in (False, True):
            rate8, answers = throughput(url, prompts, constrained, 8)
            results[constrained] = {"valid": sum(valid(text) for text, _ in answers), "rate8": rate8,
                                    "tokens": sum(t for _, t in answers) / len(answers)}
            results[constrained]["rate1"], _ = throughput(url, prompts[:8], constrained, 1)
            print(f"constrained={constrained}: {results[constrained]}", flush=True)
        masks, mask_seconds = metric(url, "serve_grammar_masks_total"), metric(url, "serve_grammar_mask_seconds_total")
        compiles = metric(url, "serve_compilations_total") - compiles
        example = ask(url, prompts[0], True)[0]
    free, forced = results[False], results[True]
    print(f"\n{args.prompts} extraction prompts, greedy, max_tokens 160\n")
    print("| | valid JSON for the schema | mean tokens | tok/s, 1 client | tok/s, 8 clients |\n|---|---|---|---|---|")
    for name, r in (("free text", free), ("`response_format` json_schema", forced)):
        print(f"| {name} | {r['valid']}/{args.prompts} ({100 * r['valid'] / args.prompts:.0f}%) | {r['tokens']:.0f} | "
              f"{r['rate1']:.1f} | {r['rate8']:.1f} |")
    print(f"\nmask time: {1e6 * mask_seconds / max(masks, 1):.0f} µs per token mask ({masks:.0f} masks); "
          f"compilations after warm-up: {compiles:.0f}\nexample: {example}")


if __name__ == "__main__":
    main()
