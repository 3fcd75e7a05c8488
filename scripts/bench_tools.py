"""Agents on the real Gemma 3 270M: tool_choice "auto" before and after a short tool-use fine-tune (issues #51, #63).

    python3 scripts/bench_tools.py [--work DIR] [--epochs 3]

Converts Gemma 3 270M (the GGUF on PyPI, as scripts/demo.sh) unless --work has it, LoRA-tunes it with
train_local.py on tests/data/tool_sample.jsonl (TRL's tool-calling format, many tools spelled many ways), then
serves the base with the tuned adapter beside it and asks both the same questions with no tool_choice ("auto"),
in two sets: tools, parameter names and questions the sample never has (lookup_weather(town, scale),
convert_currency(amount, source, target): does it call by the convention, or only the names it was taught?),
and the sample's first record's tools (get_weather, get_time) about cities the sample never names. Each set has
questions that want a tool and questions that want none. Reported per model and set: how often it called the
right tool with arguments valid for its schema when one was wanted, how often it answered in text when none
was, every status, and whether a round trip (the call's result sent back as a tool message) is answered.
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

UNSEEN_TOOLS = [
    {"type": "function", "function": {"name": "lookup_weather", "description": "Looks up the weather of a town.",
                                      "parameters": {"type": "object", "properties": {
                                          "town": {"type": "string"}, "scale": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["town", "scale"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Converts money between currencies.",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number"}, "source": {"type": "string"},
                                          "target": {"type": "string"}},
                                          "required": ["amount", "source", "target"], "additionalProperties": False}}}]
# (question, the tool it wants or None): tools, parameters and questions the sample never has.
UNSEEN = [("What is the weather in Porto?", "lookup_weather"), ("Is it warm in Krakow today?", "lookup_weather"),
          ("How cold is it in Tallinn right now?", "lookup_weather"),
          ("Convert 50 euros to dollars.", "convert_currency"), ("How many yen is 20 pounds?", "convert_currency"),
          ("What is 100 dollars in euros?", "convert_currency"),
          ("Tell me a short joke about cats.", None), ("What is 12 times 3?", None),
          ("Write a haiku about autumn.", None), ("What does the word serendipity mean?", None)]
SAMPLE_ASKS = [("What is the weather in {city}?", "get_weather"), ("Is it cold in {city} right now?", "get_weather"),
               ("What time is it in {city}?", "get_time"), ("Tell me the local time in {city}.", "get_time"),
               ("Say hello to {city}.", None), ("Write one sentence about the word {city}.", None)]
CITIES = ["Quito", "Reykjavik", "Montevideo", "Tbilisi"]  # never in the sample


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-tools"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--cities", type=int, default=2, help="held-out cities asked about with the sample's tools "
                                                            "(6 questions each)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--reuse", action="store_true", help="serve the tuned model --work already holds, untrained again")
    p.add_argument("--train-flags", default="", help="more train_local.py flags, e.g. '--lora-modules all-linear'")
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


def measure(url, model, tools, questions, max_tokens):
    """Counts over (question, wanted tool or None) asked with `tools`, and a few examples."""
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    counts = dict(requests=0, ok=0, wanted=0, called=0, unwanted=0, answered=0, round_trips=0, round_trips_ok=0)
    examples = []
    for question, wanted in questions:
        status, calls, text = ask(url, model, tools, question, max_tokens)
        counts["requests"] += 1
        counts["ok"] += status == 200
        if wanted:
            counts["wanted"] += 1
            counts["called"] += bool(calls) and all(c["function"]["name"] == wanted and valid(
                c["function"]["arguments"], specs[wanted]) for c in calls)
        else:
            counts["unwanted"] += 1
            counts["answered"] += not calls
        if len(examples) < 6:
            examples.append(f"{question} -> {json.dumps(calls[0]['function']) if calls else repr(text[:80])}")
        if calls and counts["round_trips"] < 3:  # the result goes back, and the model answers from it
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
                    "--output", str(tuned), "--overwrite", "--compile-cache", str(work / "xla"),
                    *args.train_flags.split()], check=True, env=env) \
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
        sample_questions = [(q.format(city=city), w) for city in CITIES[:args.cities] for q, w in SAMPLE_ASKS]
        rows = {(name, kind): measure(url, model, kind_tools, questions, args.max_tokens)
                for name, model in (("base", "gemma3-270m"), ("tuned", "tools"))
                for kind, kind_tools, questions in (("unseen tools", UNSEEN_TOOLS, UNSEEN),
                                                    ("the sample's tools", tools, sample_questions))}
        with urllib.request.urlopen(url + "/metrics") as r:
            compilations = next(float(line.split()[-1]) for line in r.read().decode().splitlines()
                                if line.startswith("serve_request_compilations_total "))
    finally:
        server.terminate()
        server.wait(60)
    print(f"\ntuned {'earlier' if trained < 60 else f'in {trained:.0f}s'} ({args.epochs} epochs of "
          f"tests/data/tool_sample.jsonl); max_tokens {args.max_tokens}; {compilations:.0f} compilations on a "
          f"request's behalf\n")
    print("| model | tools | requests (200) | called the right tool, schema-valid, when one was wanted | answered in "
          "text when none was | round trips answered |\n|---|---|---|---|---|---|")
    for (name, kind), (c, _) in rows.items():
        print(f"| {name} | {kind} | {c['requests']} ({c['ok']}) | {c['called']}/{c['wanted']} | "
              f"{c['answered']}/{c['unwanted']} | {c['round_trips_ok']}/{c['round_trips']} |")
    for (name, kind), (_, examples) in rows.items():
        print(f"\n{name}, {kind}:\n" + "\n".join(f"  {e}" for e in examples))

if __name__ == "__main__":
    main()
