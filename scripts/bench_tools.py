"""Agents on the real Gemma 3 270M: tool_choice "auto" before and after a short tool-use fine-tune (issue #51).

    python3 scripts/bench_tools.py [--work DIR] [--epochs 3]

Converts Gemma 3 270M (the GGUF on PyPI, as scripts/demo.sh) unless --work has it, LoRA-tunes it with
train_local.py on tests/data/tool_sample.jsonl (TRL's tool-calling format), then serves the base with the
tuned adapter beside it and asks both the same held-out questions with the sample's tools and no
tool_choice ("auto"): questions that want a tool (cities the sample never names) and questions that do
not. Reported per model: how often it called a tool when one was wanted, how often it answered in text
when none was, whether every call named a given tool with arguments valid for its schema, every status,
and whether a round trip (the call's result sent back as a tool message) is answered.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_serve import free_port, wait_until_up  # noqa: E402

WANT_TOOL = ["What is the weather in {city}?", "Is it cold in {city} right now?", "What time is it in {city}?",
             "Tell me the local time in {city}.", "How warm is it in {city}?", "Do I need an umbrella in {city} today?"]
NO_TOOL = ["Say hello to {city}.", "Spell the name {city}.", "Write one sentence about the word {city}."]
CITIES = ["Oslo", "Lima", "Quito", "Nairobi"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-tools"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--cities", type=int, default=len(CITIES), help="held-out cities asked about (9 questions each)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--reuse", action="store_true", help="serve the tuned model --work already holds, untrained again")
    return p.parse_args()


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def valid(arguments, schema):
    import jsonschema
    try:
        jsonschema.validate(json.loads(arguments), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def ask(url, model, tools, question, max_tokens):
    """(status, tool calls or None, text) for one question with the tools and no tool_choice."""
    status, answer = post(url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": question}], "tools": tools,
        "max_tokens": max_tokens, "temperature": 0})
    if status != 200:
        return status, None, json.dumps(answer)[:200]
    message = answer["choices"][0]["message"]
    return status, message.get("tool_calls"), message.get("content") or ""


def measure(url, model, tools, cities, max_tokens):
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    counts = dict(requests=0, ok=0, wanted=0, called=0, unwanted=0, answered=0, calls=0, valid=0, round_trips=0,
                  round_trips_ok=0)
    examples = []
    for city in CITIES[:cities]:
        for template, wants in [(q, True) for q in WANT_TOOL] + [(q, False) for q in NO_TOOL]:
            question = template.format(city=city)
            status, calls, text = ask(url, model, tools, question, max_tokens)
            counts["requests"] += 1
            counts["ok"] += status == 200
            counts["wanted" if wants else "unwanted"] += 1
            counts["called" if wants else "answered"] += bool(calls) if wants else not calls
            for call in calls or []:
                counts["calls"] += 1
                counts["valid"] += call["function"]["name"] in specs and valid(call["function"]["arguments"],
                                                                               specs[call["function"]["name"]])
            if len(examples) < 4 and (calls or text):
                examples.append(f"{question} -> {json.dumps(calls[0]['function']) if calls else repr(text[:80])}")
            if calls and counts["round_trips"] < 4:  # the result goes back, and the model answers from it
                counts["round_trips"] += 1
                follow = [{"role": "user", "content": question},
                          {"role": "assistant", "content": None, "tool_calls": calls},
                          {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12 degrees, cloudy"}]
                status, _ = post(url + "/v1/chat/completions", {"model": model, "messages": follow, "tools": tools,
                                                                "max_tokens": 32, "temperature": 0})
                counts["round_trips_ok"] += status == 200
    return counts, examples


def main():
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    base, tuned = work / "gemma3-270m", work / "gemma3-270m-tools"
    if not (base / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts/gguf_to_hf.py"), str(base)], check=True, env=env)
    started = time.time()
    subprocess.run([sys.executable, str(REPO / "train_local.py"), "--model", str(base), "--data",
                    str(REPO / "tests/data/tool_sample.jsonl"), "--template", "gemma-chat", "--loss-on", "response",
                    "--epochs", str(args.epochs), "--learning-rate", str(args.learning_rate), "--eval-examples", "0",
                    "--output", str(tuned), "--overwrite", "--compile-cache", str(work / "xla")], check=True, env=env) \
        if not (args.reuse and (tuned / "adapter.lora.h5").exists()) else None
    trained = time.time() - started
    tools = json.loads((REPO / "tests/data/tool_sample.jsonl").read_text().splitlines()[0])["tools"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "serve.log", "w") as log:
        server = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", str(base), "--adapter",
                                   f"tools={tuned}", "--host", "127.0.0.1", "--port", str(port), "--max-batch-size",
                                   "2", "--length-buckets", "512", "--compile-cache", str(work / "xla")], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(url + "/health", server)
        rows = {name: measure(url, model, tools, args.cities, args.max_tokens)
                for name, model in (("base", "gemma3-270m"), ("tuned", "tools"))}
        with urllib.request.urlopen(url + "/metrics") as r:
            compilations = next(float(line.split()[-1]) for line in r.read().decode().splitlines()
                                if line.startswith("serve_request_compilations_total "))
    finally:
        server.terminate()
        server.wait(60)
    print(f"\ntuned {'earlier' if trained < 60 else f'in {trained:.0f}s'} ({args.epochs} epochs of "
          f"tests/data/tool_sample.jsonl); {args.cities} cities x {len(WANT_TOOL) + len(NO_TOOL)} questions a model, "
          f"max_tokens {args.max_tokens}; "
          f"{compilations:.0f} compilations on a request's behalf\n")
    print("| model | requests (200) | called a tool when one was wanted | answered in text when none was | "
          "calls with a given name and schema-valid arguments | round trips answered |\n|---|---|---|---|---|---|")
    for name, (c, _) in rows.items():
        print(f"| {name} | {c['requests']} ({c['ok']}) | {c['called']}/{c['wanted']} | {c['answered']}/{c['unwanted']} | "
              f"{c['valid']}/{c['calls']} | {c['round_trips_ok']}/{c['round_trips']} |")
    for name, (_, examples) in rows.items():
        print(f"\n{name}:\n" + "\n".join(f"  {e}" for e in examples))


if __name__ == "__main__":
    main()
