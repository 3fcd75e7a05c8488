"""The same answers from two serve.py, token for token (issue #58: a change of structure changes no answer).

    git show REV:serve.py > /tmp/old_serve.py        # a serve.py from before the gemma_lora package runs alone
    python3 scripts/same_answers.py --compare /tmp/old_serve.py [--model DIR --adapter NAME=DIR ...]

Each side serves the same model and adapters over --uds with --seed 0, and gets the same requests one at a
time, in the same order: completions and chat, greedy and sampled (seeded), with log-probabilities, streamed
and not, n > 1, an adapter's, a JSON schema's, tool calls (tool_choice "required" and "auto"). Every answer's
text, tokens, tool calls, finish reasons and usage must be equal, and every log-probability within
--tolerance. Without --model: the tests' tiny random Gemma, with an adapter trained on it by train_local.py.
Exit 1 if any answer differs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_load import serve  # noqa: E402
from uds_check import UnixConnection, request  # noqa: E402

PROMPT = "Instruction:\nName three rivers of Europe.\n\nResponse:\n"
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a canal?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
IGNORED = {"id", "created", "system_fingerprint"}  # made per reply (and per tool call), never the same twice


def cases(adapter):
    """(name, path, body) of every request, each side asked in this order."""
    greedy = {"temperature": 0}
    out = [
        ("article", "/", {"prompt": PROMPT, "max_tokens": 16}),
        ("instruction", "/", {"instruction": "Name a river.", "max_tokens": 16}),
        ("completion", "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "logprobs": 3, **greedy}),
        ("completion sampled n=2", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "n": 2, "seed": 7,
                                                       "temperature": 0.9, "logprobs": 2}),
        ("completion, penalties and a stop", "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 24, "frequency_penalty": 0.5, "stop": ["\n\n"], **greedy}),
        ("completion streamed", "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "logprobs": 2,
                                                    "stream": True, **greedy}),
        ("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "logprobs": True, "top_logprobs": 3,
                                          **greedy}),
        ("chat streamed", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "logprobs": True,
                                                   "top_logprobs": 2, "stream": True, **greedy}),
        ("chat, JSON schema", "/v1/chat/completions", {
            "messages": CHAT, "max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": SCHEMA}}, "logprobs": True, **greedy}),
        ("tools, required", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Weather in Porto?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 40, "logprobs": True, **greedy}),
        ("tools, auto, streamed", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Weather in Porto?"}], "tools": [WEATHER], "max_tokens": 40,
            "stream": True, "logprobs": True, **greedy}),
        ("tokenize", "/tokenize", {"prompt": PROMPT}),
    ]
    if adapter:
        out += [(f"adapter {adapter}, completion", "/v1/completions", {
                    "model": adapter, "prompt": PROMPT, "max_tokens": 24, "logprobs": 2, **greedy}),
                (f"adapter {adapter}, chat", "/v1/chat/completions", {"model": adapter, "messages": CHAT,
                                                                    "max_tokens": 24, "logprobs": True, **greedy})]
    return out


def streamed(sock, path, body):
    """A streamed reply's events, as a list of payloads."""
    connection = UnixConnection(sock)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
        return response.status, events
    finally:
        connection.close()


def differences(a, b, tolerance, where=""):
    """Where two answers differ: every string, number and key equal, floats within `tolerance`."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (a.keys() | b.keys()) - IGNORED
        return [d for k in sorted(keys) for d in differences(a.get(k), b.get(k), tolerance, f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, tolerance, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return [] if abs(a - b) <= tolerance else [f"{where}: {a!r} against {b!r}"]
    return [] if a == b else [f"{where}: {str(a)[:200]!r} against {str(b)[:200]!r}"]


def ask(sock, requests):
    answers = []
    for name, path, body in requests:
        if body.get("stream"):
            answers.append(streamed(sock, path, body))
        else:
            answers.append(request(sock, "POST", path, body))
    return answers


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", required=True, metavar="SERVE_PY", help="the other serve.py")
    p.add_argument("--model", default=None)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--flags", default="--length-buckets 128,512 --max-batch-size 4", help="serve.py flags, both sides")
    p.add_argument("--tolerance", type=float, default=1e-6)
    args = p.parse_args()
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    work = Path(tempfile.mkdtemp(prefix="same-answers-"))
    model, adapters = args.model, args.adapter
    if model is None:
        model = work / "tiny"
        subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_gemma.py"), str(model)], check=True, env=env,
                       capture_output=True)
        subprocess.run([sys.executable, str(REPO / "train_local.py"), "--model", str(model), "--data",
                        str(REPO / "tests/data/chat_sample.jsonl"), "--limit", "16", "--eval-examples", "0",
                        "--max-steps", "4", "--template", "gemma-chat", "--output", str(work / "chat"),
                        "--compile-cache", str(work / "xla")], check=True, env=env, capture_output=True)
        adapters = [f"chat={work / 'chat'}"]
    flags = args.flags.split() + ["--seed", "0"] + [f for a in adapters for f in ("--adapter", a)]
    requests = cases(adapters[0].partition("=")[0] if adapters else None)
    answers = {}
    for name, script in (("other", args.compare), ("this", str(REPO / "serve.py"))):
        process, sock = serve(script, model, flags, env, work)
        try:
            answers[name] = ask(sock, requests)
        finally:
            process.terminate()
            process.wait(60)
    failed = 0
    for (name, _, _), theirs, ours in zip(requests, answers["other"], answers["this"]):
        found = differences(theirs, ours, args.tolerance)
        if theirs[0] != 200:
            found.append(f"status {theirs[0]}: {str(theirs[1])[:200]}")
        failed += bool(found)
        print(f"{'FAILED' if found else 'same'} {name}" + "".join(f"\n    {d}" for d in found[:5]))
    print(f"\n{len(requests) - failed} of {len(requests)} answers the same (log-probabilities within "
          f"{args.tolerance:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
