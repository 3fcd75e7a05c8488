"""Teaching a multi-turn chat on the real Gemma 3 270M (CPU), side by side in one run.

    python3 scripts/bench_chat_train.py [--steps 40] [--skip-remat]

1. The chat sample (tests/data/chat_sample.jsonl, OpenAI's messages format) in Gemma's turn format,
   LoRA on q_proj,v_proj (the article's modules) against all-linear, with the README's recommended
   recipe otherwise (rank 16, alpha 32, cosine schedule, 10 warm-up steps) and the same step count:
   held-out loss on the assistant turns before and after, ms per step, peak RSS.
2. The all-linear model served by serve.py, asked a two-turn conversation through /v1/chat/completions
   (greedy): does it answer in the trained style (short, ending "Anything else?")?
3. --remat: peak RSS with and without gradient checkpointing at sequence 512 (every batch padded to
   512), and the loss of each, which should agree.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHAT = REPO / "tests" / "data" / "chat_sample.jsonl"
RECIPE = ["--data", str(CHAT), "--data-format", "messages", "--template", "gemma-chat", "--limit", "160",
          "--eval-examples", "40", "--sequence-length", "256", "--lora-rank", "16", "--lora-alpha", "32",
          "--lr-schedule", "cosine", "--warmup-steps", "10", "--learning-rate", "2e-4"]
CONVERSATION = [[{"role": "user", "content": "What is the capital of Norway?"}],
                [{"role": "user", "content": "And of Kenya?"}]]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".demo" / "gemma3-270m"),
                   help="transformers-layout Gemma dir (converted from the PyPI GGUF when missing)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip-remat", action="store_true")
    return p.parse_args()


def run(cmd, env):
    """(stdout, peak RSS in GiB) of a child process."""
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:3]))} failed:\n{output[-3000:]}")
    return output, usage.ru_maxrss / 2**20


def train(model, out, extra, env, cache):
    cmd = [sys.executable, str(REPO / "train_local.py"), "--model", model, "--output", str(out), "--overwrite",
           "--compile-cache", cache, *extra]
    _, rss = run(cmd, env)
    record = json.loads((out / "training.json").read_text())
    steps = len(record["history"])
    return {"ms_per_step": 1000 * record["seconds"] / steps, "before": record["eval_loss_before"],
            "after": record["eval_loss_after"], "rss": rss, "last_loss": record["history"][-1]["loss"]}


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def ask_two_turns(model_dir, env, cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", str(model_dir), "--host",
                               "127.0.0.1", "--port", str(port), "--max-batch-size", "1", "--length-buckets", "256",
                               "--compile-cache", cache], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        messages, answers = [], []
        for turn in CONVERSATION:
            messages += turn
            answer = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 40, "temperature": 0})
            text = answer["choices"][0]["message"]["content"]
            answers.append((turn[0]["content"], text))
            messages.append({"role": "assistant", "content": text})
        return answers
    finally:
        server.terminate()
        server.wait(60)


def main():
    args = parse_args()
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "gguf_to_hf.py"), args.model], check=True, env=env)
    work = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    cache = str(work / "xla-cache")
    steps = ["--max-steps", str(args.steps)]
    results = {}
    for name, modules in (("q_proj,v_proj", "q_proj,v_proj"), ("all-linear", "all-linear")):
        results[name] = train(args.model, work / name, [*RECIPE, *steps, "--lora-modules", modules], env, cache)
        print(f"{name}: {results[name]}", flush=True)
    print(f"\nmulti-turn chat sample, gemma-chat template, {args.steps} steps of batch 4, rank 16, alpha 32, cosine, "
          "10 warm-up steps, lr 2e-4\n")
    print("| LoRA on | held-out loss before → after | ms/step | peak RSS |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['before']:.3f} → **{r['after']:.3f}** | {r['ms_per_step']:,.0f} | {r['rss']:.2f} GiB |")

    print("\ntwo turns through /v1/chat/completions (greedy), all-linear model:\n")
    for question, answer in ask_two_turns(work / "all-linear", env, cache):
        print(f"- user: {question}\n  assistant: {answer}")

    if not args.skip_remat:
        remat = {}
        for name, extra in (("without --remat", []), ("--remat", ["--remat"])):
            remat[name] = train(args.model, work / name.strip("-").replace(" ", "-"), [
                "--data", str(CHAT), "--limit", "16", "--eval-examples", "0", "--max-steps", "3", "--buckets", "512",
                "--sequence-length", "512", "--lora-modules", "all-linear", *extra], env, cache)
            print(f"{name}: {remat[name]}", flush=True)
        print("\ngradient checkpointing, all-linear LoRA, batch 4 x 512 tokens, 3 steps\n")
        print("| run | peak RSS | ms/step | loss at step 3 |\n|---|---|---|---|")
        for name, r in remat.items():
            print(f"| {name} | {r['rss']:.2f} GiB | {r['ms_per_step']:,.0f} | {r['last_loss']:.5f} |")


if __name__ == "__main__":
    main()
