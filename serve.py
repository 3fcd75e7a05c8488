"""Serves a fine-tuned Gemma preset over HTTP with the standard library, as the article does.

    python3 serve.py                          # ./gemma-2b-dolly-lora on 0.0.0.0:8080
    curl -X POST http://localhost:8080/ -H "Content-Type: application/json" \\
         -d '{"prompt": "Instruction:\\nExplain the difference between a GPU and a TPU.\\n\\nResponse:\\n", "max_tokens": 256}'

The article's API stays (POST / {"prompt", "max_tokens"} -> {"generated_text"}), with one
deliberate change: max_tokens counts new tokens, not prompt + new tokens. Also served:
instruction mode (POST / {"instruction", "context"?} with the template train_local.py recorded),
OpenAI-compatible POST /v1/completions and /v1/chat/completions (streaming, log-probabilities),
GET /v1/models, POST /tokenize and /detokenize, GET /health, GET /metrics, and GET /openapi.json,
which describes all of them. With --adapter NAME=PATH (or --enable-lora and POST /v1/load_lora_adapter)
one base serves many LoRA fine-tunes, picked per request by the `model` field, mixed in one batch.

Every program is compiled at start-up (per batch bucket: decode over each attention window of
--length-buckets, and a prefill per prompt block), so no request ever waits for XLA. Concurrent
requests share one decode loop (continuous batching): each row has its own position, takes a new
request the moment it frees, and stops at its own stop token or max_tokens.
"""
import argparse
import array
import bisect
import collections
import collections.abc
import contextlib
import errno
import faulthandler
import functools
import hashlib
import hmac
import itertools
import json
import os
import queue
import random
import re
import select
import shutil
import selectors
import signal
import socket
import stat
import sys
import threading
import time
import uuid
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")

# Prompt templates, as train_local.py's (--template) and kept identical to its table.
TEMPLATES = {
    "article": {"prompt": "Instruction:\n{instruction}\n\nResponse:\n",
                "prompt_with_context": "Instruction:\n{instruction}\n\nContext:\n{context}\n\nResponse:\n",
                "response_suffix": "", "turn_separator": "\n\n"},
    # Gemma's instruction-tuned turn format; Gemma has no system role, so context joins the user turn.
    "gemma-chat": {"prompt": "<start_of_turn>user\n{instruction}<end_of_turn>\n<start_of_turn>model\n",
                   "prompt_with_context": "<start_of_turn>user\n{instruction}\n\n{context}<end_of_turn>\n"
                                          "<start_of_turn>model\n",
                   "response_suffix": "<end_of_turn>", "turn_separator": "\n"},
}
# Sampling looks at this many most-likely tokens: top_k is capped here and top_p is computed over them.
CANDIDATES = 128
DETOKENIZE_WINDOW = 16  # tokens a streamed row decodes again with its new ones (Generation.detokenize)
TOP_LOGPROBS = 20  # most alternatives a request may ask log-probabilities for (OpenAI's limit)
# The per-row arrays the decode programs take after the adapter slots: sample()'s, then adjust_logits'.
SAMPLE_ARRAYS = ("temperature", "top_k", "top_p", "seeds", "alternatives")
ADJUST_ARRAYS = ("prompt_lengths", "frequency", "presence", "repetition", "min_positions", "stop_ids", "bias_ids",
                 "bias_values")
BIAS_SLOTS = 300  # logit_bias entries a request may send (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 8  # stop_token_ids a request may send; with the model's own, STOP_SLOTS at most
STOP_SLOTS = 16
MAX_N = 16  # answers a request may ask for (n)
DECODE_CHUNK = 4  # tokens decoded per dispatch to the device
# ...and, when no request waits for a row, in the smallest batch (see decode_until_done), at least
# LONG_CHUNK and at most LONGEST_CHUNK: as many as the last long dispatch says fit in LONG_CHUNK_SECONDS,
# which is how long a request arriving meanwhile may wait for its row (bench_convoy.py: 0.05 s gave 2.8x).
LONG_CHUNK, LONGEST_CHUNK, LONG_CHUNK_SECONDS = 16, 64, 0.02
UNROLL_FROM_BYTES = 64 << 20  # off a CPU, weights from which a decode chunk is unrolled (see decode_chunk)...
UNROLL_FROM_BATCH_OFF_CPU = 2  # ...and the batch size from which it is (see Engine)
# Backends on which a decode step writes each row's new key, value and token as a select over the window,
# not a per-row scatter (see positions_written_by_select).
WRITE_BY_SELECT_ON = ("tpu",)
# Prompts of up to GROUP_BLOCK tokens that are admitted together are prefilled in groups of these sizes
# (see prefill_group); a batch smaller than a size never uses it. On a CPU, whose prefills are compute-bound
# from fewer tokens, each size only up to its GROUP_BLOCKS_CPU, where it paid for its program (its compiling
# and 30-45 MiB of RSS: BENCHMARKS.md, issue #35). Gemma 3 270M on 2 cores, grouped against one by one:
# 1.1-3.6x in blocks of 16-64 tokens but 0.80-1.09x (int8) and 1.01-1.39x (float32) in blocks of 128; a
# pair 1.88x (int8) and 1.43x (float32) in blocks of 16, 1.12-1.27x in 32 and 64 (5-34 ms once).
# Off a CPU, groups up to 64 prompts and GROUP_TOKENS tokens: a wave of newcomers (streaming clients whose
# answers end together, a burst) is prefilled in a few dispatches, each of which stalls the decoding rows,
# instead of one per 8 (issue #48: 64 clients on a TPU v5e, 67 groups for 389 prompts, 40-56 ms each).
PREFILL_GROUPS = (2, 4, 8, 16, 32, 64)
GROUP_BLOCK, GROUP_TOKENS, GROUP_BLOCKS_CPU = 128, 4096, {2: 16, 4: 64, 8: 64}
SAMPLER_DEFAULTS = {  # keras-hub's samplers' defaults: the article's "top_k" is TopKSampler(k=5)
    "greedy": {"temperature": 0.0, "top_k": CANDIDATES, "top_p": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 5, "top_p": 1.0},
    "top_p": {"temperature": 1.0, "top_k": CANDIDATES, "top_p": 0.1},
}
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A generation's own latencies, in vLLM's buckets (its time_to_first_token_seconds and time_per_output_token_
# seconds), so that a dashboard made for one reads the other.
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)


def number_or_auto(p, flag, value):
    """A flag's integer, or None for "auto"."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        p.error(f"{flag} {value}: a number, or auto")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="./gemma-2b-dolly-lora", help="preset dir or handle (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weights and compute: auto (default) serves in the dtype the preset was saved in")
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default="none",
                   help="quantize the dense layers' weights after loading (int8: about a quarter of float32's "
                        "memory); LoRA adapters stay float32 on top (default: none)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="also serve a LoRA adapter over --model, as the model NAME: a train_local.py output dir or "
                        "a Hugging Face PEFT dir (adapter_config.json + adapter_model.safetensors); repeatable")
    p.add_argument("--enable-lora", action="store_true",
                   help="keep adapter slots for POST /v1/load_lora_adapter even with no --adapter (implied by it)")
    p.add_argument("--max-adapters", type=int, default=8, help="adapters held at once (default: 8)")
    p.add_argument("--max-lora-rank", type=int, default=64,
                   help="largest adapter rank (PEFT's r; train_local.py's rank times the query heads) (default: 64)")
    p.add_argument("--lora-modules", default=None,
                   help="projections adapters may change, of " + ",".join(LORA_MODULES) + ", or all-linear (default: "
                        "q_proj,v_proj and all that the --adapter ones change)")
    p.add_argument("--prefix-cache-blocks", type=int, default=None,
                   help="automatic prefix caching: KV blocks kept on the device for prompts that start alike (a "
                        "system prompt, a conversation's history); 0 turns it off (default: 8 longest prompts' "
                        "worth, 8 x the largest --length-buckets / --prefix-block-tokens)")
    p.add_argument("--prefix-block-tokens", type=int, default=16,
                   help="positions per prefix-cache block; only whole blocks are shared (default: 16, the smallest "
                        "block the engine prefills, so a hit recomputes at most 15 tokens of a cached prefix)")
    p.add_argument("--host", default="0.0.0.0", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="serve on this unix domain socket instead of --host/--port (as vLLM's and uvicorn's --uds): "
                        "for machines that allow no TCP, or a proxy on the same host; curl --unix-socket PATH")
    p.add_argument("--uds-mode", default="600", metavar="OCTAL",
                   help="the socket file's permissions, which are its access control: 600 (default) lets only this "
                        "user connect, 660 the group too")
    p.add_argument("--max-batch-size", default="auto",
                   help="most requests decoded together; auto (default): 8 on a CPU, on a GPU or TPU the largest power "
                        "of two up to 256 whose KV cache fits the device's free memory (the log says why)")
    p.add_argument("--batch-sizes", default=None, metavar="N,N,...",
                   help="batch sizes compiled at start-up, the largest being --max-batch-size (default: powers of "
                        "two up to 16; above, 1,4,16,64 and doubling from there, e.g. 1,4,16,64,128,256); fewer "
                        "start faster, a model of several minutes' warm-up per size (2B on one TPU chip) wants few, "
                        "such as 1,8,64")
    p.add_argument("--length-buckets", default="128,256,512",
                   help="total lengths (prompt + new tokens) compiled at start-up; the largest is the longest "
                        "request served (default: %(default)s)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long the first queued request waits for others to batch with (default: 5)")
    p.add_argument("--max-queue", default="auto",
                   help="queued requests before answering 503; auto (default): twice the largest batch size, at "
                        "least 64, so that a full batch's worth of newcomers waits for rows instead of retrying")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens accepted (default: the largest length bucket)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds a connection may sit idle, or take to send a request's headers or body, before "
                        "it is closed (default: 60)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections before new ones get 503 and are closed (default: 1024)")
    p.add_argument("--api-key", default=os.environ.get("SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on everything but /health (env: SERVE_API_KEY)")
    p.add_argument("--sampler", choices=sorted(SAMPLER_DEFAULTS), default="top_k",
                   help="default sampling when a request names none (default: top_k, k=5, as the article)")
    p.add_argument("--seed", type=int, default=None, help="seed for requests that bring none (default: random)")
    p.add_argument("--compile-cache", default=str(Path.home() / ".cache" / "gemma-lora-xla"),
                   help="JAX persistent compilation cache dir, so restarts skip compiling; '' disables")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests")
    p.add_argument("--distribution", choices=["auto", "off", "data", "model"], default="off",
                   help="off (default): one device; data: replicas over all devices; model: shard the weights "
                        "over --mesh (for models too big for one chip); auto: data if several devices")
    p.add_argument("--mesh", default=None, help="B,M device mesh for --distribution model (default: 1,<all>)")
    args = p.parse_args(argv)
    args.length_buckets = sorted({int(s) for s in args.length_buckets.split(",") if s.strip()})
    if not args.length_buckets or args.length_buckets[0] < 2:
        p.error("--length-buckets must list lengths of at least 2")
    if args.batch_sizes is not None:
        try:
            args.batch_sizes = sorted({int(n) for n in args.batch_sizes.split(",") if n.strip()})
        except ValueError:
            p.error(f"--batch-sizes {args.batch_sizes}: write sizes such as 1,8,64")
        if not args.batch_sizes or args.batch_sizes[0] < 1:
            p.error("--batch-sizes must list sizes of at least 1")
        args.max_batch_size = args.batch_sizes[-1]
    else:  # auto: decided once the model is on the device (fitting_batch_size)
        args.max_batch_size = number_or_auto(p, "--max-batch-size", args.max_batch_size)
    args.max_queue = number_or_auto(p, "--max-queue", args.max_queue)  # auto: with the batch size (auto_max_queue)
    if (args.max_batch_size or 1) < 1 or (args.max_queue or 1) < 1 or args.max_connections < 1:
        p.error("--max-batch-size, --max-queue and --max-connections must be at least 1")
    if args.idle_timeout <= 0:
        p.error("--idle-timeout must be positive")
    try:
        args.uds_mode = int(args.uds_mode, 8)
        if not 0 <= args.uds_mode <= 0o777:
            raise ValueError
    except ValueError:
        p.error(f"--uds-mode {args.uds_mode}: write the permissions in octal, such as 600 or 660")
    if args.quantize != "none" and args.distribution == "model":
        p.error("--quantize cannot be combined with --distribution model: the layout map shards float kernels")
    args.max_tokens_limit = args.max_tokens_limit or args.length_buckets[-1]
    if args.prefix_block_tokens < 1 or any(length % args.prefix_block_tokens for length in args.length_buckets):
        p.error(f"--prefix-block-tokens {args.prefix_block_tokens} must divide every --length-buckets length")
    if args.prefix_cache_blocks is None:
        args.prefix_cache_blocks = 8 * args.length_buckets[-1] // args.prefix_block_tokens
    if args.prefix_cache_blocks < 0:
        p.error("--prefix-cache-blocks must not be negative")
    adapters = {}
    for spec in args.adapter:
        name, _, path = spec.partition("=")
        if not name or not path:
            p.error(f"--adapter {spec}: write it NAME=PATH")
        if name in adapters:
            p.error(f"--adapter {name} is given twice")
        adapters[name] = path
    args.adapter = adapters
    if len(adapters) > args.max_adapters or args.max_adapters < 1 or args.max_lora_rank < 1:
        p.error(f"--max-adapters ({args.max_adapters}) must be at least 1 and hold every --adapter ({len(adapters)}); "
                "--max-lora-rank at least 1")
    if args.lora_modules is not None:
        try:
            args.lora_modules = parse_lora_modules(args.lora_modules)
        except ValueError as e:
            p.error(f"--lora-modules: {e}")
    if (adapters or args.enable_lora) and args.distribution == "model":
        p.error("--adapter/--enable-lora cannot be combined with --distribution model yet")
    return args


LOG_LOCK = threading.Lock()


def log(message):
    """One line on stdout, written whole: print() writes the text and the newline apart, so two threads' lines
    could join ("...finish=length08:23:23 POST ..."), which a log shipper drops or misreads."""
    line = f"{time.strftime('%H:%M:%S')} {message}\n"
    with LOG_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


# ----------------------------------------------------------------------------- metrics

class Histogram:
    """A Prometheus histogram: counts per upper bound, their sum. Its owner holds the lock."""

    def __init__(self, name, help, buckets):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts, self.sum = [0] * (len(buckets) + 1), 0.0

    def observe(self, seconds):
        self.sum += seconds
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1

    def render(self):
        lines, cumulative = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"], 0
        for bound, count in zip(list(self.buckets) + ["+Inf"], self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        return lines + [f"{self.name}_sum {self.sum}", f"{self.name}_count {cumulative}"]


class Metrics:
    """Prometheus text exposition, kept by hand: a few counters need no client library."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {}          # (path, status) -> count
        self.latency = Histogram("serve_request_latency_seconds", "Latency of generation requests.", LATENCY_BUCKETS)
        # Each generation's (the n answers of a request are n): from its request's arrival to the worker taking
        # it (a row free), to its first token, and then per further token, as the worker hands them out.
        self.generation = [
            Histogram("serve_request_queue_seconds", "A generation's wait for a row of the batch.", FIRST_TOKEN_BUCKETS),
            Histogram("serve_time_to_first_token_seconds", "From a generation's request arriving to its first "
                      "token.", FIRST_TOKEN_BUCKETS),
            Histogram("serve_time_per_output_token_seconds", "A generation's time per token after its first (its "
                      "mean, for those of two tokens or more).", PER_TOKEN_BUCKETS)]
        self.prompt_tokens = self.generated_tokens = self.compilations = self.cancelled = 0
        self.request_compilations = self.compile_cache_hits = 0
        self.warm_up_pending = lambda: 0
        self.cached_prompt_tokens = self.prefix_bytes = self.prefix_blocks = 0
        self.prefill_groups = self.grouped_prompts = self.batch_resizes = 0
        self.grammar_masks, self.grammar_mask_seconds = 0, 0.0  # masks computed, host time computing them
        self.grammar_dropped = 0  # later tokens of a chunk a grammar row did not keep
        self.prefix_used = lambda: 0
        self.refused_connections = self.idle_closed = 0
        self.weight_bytes, self.weights = 0, {}  # weights: labels of serve_model_info
        self.batch_sizes = {}
        self.models = {}  # model (base or adapter) name -> (generation requests, generated tokens)
        self.queue_depth = self.open_connections = self.running = lambda: 0

    def observe_request(self, path, status, seconds):
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1
            if seconds is not None:
                self.latency.observe(seconds)

    def observe_generation(self, latencies):
        """A finished generation's Generation.latencies(), those it had."""
        with self.lock:
            for histogram, seconds in zip(self.generation, latencies):
                if seconds is not None:
                    histogram.observe(max(0.0, seconds))

    def add(self, name, amount=1):
        with self.lock:
            setattr(self, name, getattr(self, name) + amount)

    def observe_model(self, name, generated):
        with self.lock:
            requests, tokens = self.models.get(name, (0, 0))
            self.models[name] = (requests + 1, tokens + generated)

    def observe_masks(self, count, seconds):
        with self.lock:
            self.grammar_masks += count
            self.grammar_mask_seconds += seconds

    def observe_batch(self, size):
        with self.lock:
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def render(self, ready):
        with self.lock:
            lines = ["# HELP serve_requests_total HTTP requests by path and status.",
                     "# TYPE serve_requests_total counter"]
            lines += [f'serve_requests_total{{path="{p}",status="{s}"}} {n}'
                      for (p, s), n in sorted(self.requests.items())]
            lines += self.latency.render()
            for histogram in self.generation:
                lines += histogram.render()
            lines += ["# HELP serve_requests_running Generations decoding in the batch's rows now.",
                      "# TYPE serve_requests_running gauge", f"serve_requests_running {self.running()}",
                      "# HELP serve_prompt_tokens_total Prompt tokens of generation requests.",
                      "# TYPE serve_prompt_tokens_total counter", f"serve_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP serve_cached_prompt_tokens_total Prompt tokens whose KV came from the prefix cache.",
                      "# TYPE serve_cached_prompt_tokens_total counter",
                      f"serve_cached_prompt_tokens_total {self.cached_prompt_tokens}",
                      "# HELP serve_prefill_groups_total Dispatches that prefilled several prompts admitted "
                      "together.", "# TYPE serve_prefill_groups_total counter",
                      f"serve_prefill_groups_total {self.prefill_groups}",
                      "# HELP serve_batch_resizes_total Times the decode batch grew or shrank in place.",
                      "# TYPE serve_batch_resizes_total counter", f"serve_batch_resizes_total {self.batch_resizes}",
                      "# HELP serve_grouped_prompts_total Prompts prefilled in those dispatches.",
                      "# TYPE serve_grouped_prompts_total counter",
                      f"serve_grouped_prompts_total {self.grouped_prompts}",
                      "# HELP serve_grammar_masks_total Token masks computed for structured output (one per "
                      "constrained row and dispatch).",
                      "# TYPE serve_grammar_masks_total counter", f"serve_grammar_masks_total {self.grammar_masks}",
                      "# HELP serve_grammar_dropped_tokens_total Tokens a constrained row drew past a dispatch's "
                      "first without the mask and dropped, to draw again under it.",
                      "# TYPE serve_grammar_dropped_tokens_total counter",
                      f"serve_grammar_dropped_tokens_total {self.grammar_dropped}",
                      "# HELP serve_grammar_mask_seconds_total Host time spent computing them.",
                      "# TYPE serve_grammar_mask_seconds_total counter",
                      f"serve_grammar_mask_seconds_total {self.grammar_mask_seconds}",
                      "# HELP serve_prefix_cache_bytes Device memory of the prefix-cache pool.",
                      "# TYPE serve_prefix_cache_bytes gauge", f"serve_prefix_cache_bytes {self.prefix_bytes}",
                      "# HELP serve_prefix_cache_blocks Prefix-cache blocks, by whether they hold a prefix.",
                      "# TYPE serve_prefix_cache_blocks gauge",
                      f'serve_prefix_cache_blocks{{state="used"}} {self.prefix_used()}',
                      f'serve_prefix_cache_blocks{{state="free"}} {self.prefix_blocks - self.prefix_used()}',
                      "# TYPE serve_generated_tokens_total counter",
                      f"serve_generated_tokens_total {self.generated_tokens}",
                      "# HELP serve_queue_depth Requests waiting for the model worker.",
                      "# TYPE serve_queue_depth gauge", f"serve_queue_depth {self.queue_depth()}",
                      "# HELP serve_batches_total Decode batches by number of requests in them.",
                      "# TYPE serve_batches_total counter"]
            lines += [f'serve_batches_total{{size="{s}"}} {n}' for s, n in sorted(self.batch_sizes.items())]
            lines += ["# HELP serve_model_requests_total Generation requests by model (the base or an adapter).",
                      "# TYPE serve_model_requests_total counter"]
            lines += [f'serve_model_requests_total{{model="{label(m)}"}} {n}' for m, (n, _) in sorted(self.models.items())]
            lines += ["# HELP serve_model_generated_tokens_total Generated tokens by model (the base or an adapter).",
                      "# TYPE serve_model_generated_tokens_total counter"]
            lines += [f'serve_model_generated_tokens_total{{model="{label(m)}"}} {t}'
                      for m, (_, t) in sorted(self.models.items())]
            lines += ["# HELP serve_cancelled_total Generations stopped because their client went away.",
                      "# TYPE serve_cancelled_total counter", f"serve_cancelled_total {self.cancelled}",
                      "# HELP serve_open_connections Client connections open now.",
                      "# TYPE serve_open_connections gauge", f"serve_open_connections {self.open_connections()}",
                      "# HELP serve_refused_connections_total Connections answered 503 at --max-connections.",
                      "# TYPE serve_refused_connections_total counter",
                      f"serve_refused_connections_total {self.refused_connections}",
                      "# HELP serve_idle_closed_total Connections closed for idling or sending slower than "
                      "--idle-timeout.",
                      "# TYPE serve_idle_closed_total counter", f"serve_idle_closed_total {self.idle_closed}",
                      "# HELP serve_compilations_total XLA compilations in this process (flat after warm-up).",
                      "# TYPE serve_compilations_total counter", f"serve_compilations_total {self.compilations}",
                      "# HELP serve_request_compilations_total XLA compilations outside the warm-up (0: none ever "
                      "ran on a request's behalf).", "# TYPE serve_request_compilations_total counter",
                      f"serve_request_compilations_total {self.request_compilations}",
                      "# HELP serve_compile_cache_hits_total Programs loaded from the persistent compilation cache.",
                      "# TYPE serve_compile_cache_hits_total counter",
                      f"serve_compile_cache_hits_total {self.compile_cache_hits}",
                      "# HELP serve_warmup_pending_parts Warm-up parts still compiling in the background (batch "
                      "sizes, the prefix cache, grouped prefills); requests use only what is compiled.",
                      "# TYPE serve_warmup_pending_parts gauge", f"serve_warmup_pending_parts {self.warm_up_pending()}",
                      "# TYPE serve_ready gauge", f"serve_ready {int(ready)}",
                      "# HELP serve_process_resident_bytes This process's resident memory (RSS).",
                      "# TYPE serve_process_resident_bytes gauge", f"serve_process_resident_bytes {process_rss()}",
                      "# HELP serve_weight_bytes Bytes of model weights held on the device(s).",
                      "# TYPE serve_weight_bytes gauge", f"serve_weight_bytes {self.weight_bytes}"]
            if self.weights:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.weights.items()))
                lines += ["# HELP serve_model_info The served model's dtype and quantization.",
                          "# TYPE serve_model_info gauge", f"serve_model_info{{{labels}}} 1"]
        return "\n".join(lines + WORKER_CLOCK.render() + TIMELINE.render() + THREAD_CPU.render()) + "\n"


METRICS = Metrics()


# Where the model worker's time goes, and the device's (issue #48): the worker's wall time split into parts
# that add up to it, and each dispatch's device time learned from when its outputs are ready. Together they
# say which side is the wall under load: a device idle between a batch's dispatches waits for the host.
WORKER_PARTS = {
    "idle": "waiting for requests, no batch running",
    "admit": "admitting: prefill, pool and insert dispatches, row settings",
    "resize": "growing or shrinking the batch",
    "dispatch": "preparing and dispatching decode chunks",
    "read": "blocked on the device, reading a chunk's tokens",
    "settle": "handing each row its tokens: stops, text, log-probabilities, stream events",
    "grammar": "structured output's token masks",
    "other": "the loop's own bookkeeping: the queue, cancellations, batch sizes",
}
TIMED_PROGRAMS = ("decode", "decode_long", "prefill", "prefill_group")  # whose device time is learned
COUNTED_PROGRAMS = TIMED_PROGRAMS + ("insert", "pool_store", "pool_gather", "resize")


class PartClock:
    """One thread's wall time, part by part: every moment counts in exactly one of WORKER_PARTS (a part
    entered inside another pauses it), so the parts add up to the time since start(). Only the thread that
    started it is timed: the warm-up's and the tests' own calls of the same code are not."""

    def __init__(self):
        self.seconds = dict.fromkeys(WORKER_PARTS, 0.0)  # every key from the start: render() copies it unlocked
        # The thread's CPU time in each part: wall time less CPU time is waiting, on the device or for the GIL
        # (which the HTTP threads hold while they render and write what the worker hands them).
        self.cpu = dict.fromkeys(WORKER_PARTS, 0.0)
        self.current, self.since, self.cpu_since, self.owner = "other", None, None, None

    def start(self, part="other"):
        self.owner, self.current = threading.get_ident(), part
        self.since, self.cpu_since = time.perf_counter(), time.thread_time()

    def switch(self, part):
        """Enters `part`; returns the part it leaves (for the caller to go back to)."""
        if threading.get_ident() != self.owner:
            return part
        now, cpu = time.perf_counter(), time.thread_time()
        self.seconds[self.current] += now - self.since
        self.cpu[self.current] += cpu - self.cpu_since
        previous, self.current, self.since, self.cpu_since = self.current, part, now, cpu
        return previous

    @contextlib.contextmanager
    def part(self, name):
        previous = self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def totals(self):
        seconds, current, since = dict(self.seconds), self.current, self.since
        if since is not None:
            seconds[current] += time.perf_counter() - since
        return seconds

    def render(self):
        return ["# HELP serve_worker_seconds_total The model worker's wall time by what it did (" + "; ".join(
                f"{part}: {what}" for part, what in WORKER_PARTS.items()) + "); the parts add up to its time since "
                "it started.", "# TYPE serve_worker_seconds_total counter"] + [
            f'serve_worker_seconds_total{{part="{part}"}} {seconds:.6f}' for part, seconds in self.totals().items()] + [
            "# HELP serve_worker_cpu_seconds_total The model worker thread's CPU time by part (as above), up to its "
            "last change of part: the rest of a part's wall time it waited, on the device or for the GIL.",
            "# TYPE serve_worker_cpu_seconds_total counter"] + [
            f'serve_worker_cpu_seconds_total{{part="{part}"}} {seconds:.6f}' for part, seconds in dict(self.cpu).items()]


class DeviceTimeline:
    """The device's time, dispatch by dispatch, without a profiler: the worker hands each decode and prefill
    dispatch's outputs here, and a thread waits for them in dispatch order. A dispatch ran from when it was
    dispatched or the one before finished, whichever is later, to when its outputs are ready; a gap between
    the one before finishing and the next being dispatched, inside one batch's run, is the device idle while
    the host works. The copies that are not timed (inserts, pool writes, resizes: their outputs are donated
    to the next program) fall into the next timed dispatch. Prefills dispatched while other rows were
    decoding stall them by their whole device time (serve_prefill_stall_seconds_total)."""

    def __init__(self):
        self.queue = queue.Queue()
        self.busy, self.dispatches = dict.fromkeys(TIMED_PROGRAMS, 0.0), dict.fromkeys(COUNTED_PROGRAMS, 0)
        self.idle = self.stall = 0.0
        self.stalling = False  # set by the worker while it admits into a batch whose other rows are decoding
        self.run_id = 0  # bumped by the worker at each batch's start: the gaps between batches are no one's
        self.owner = None
        self.thread = None

    def start(self):
        self.owner = threading.get_ident()
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, daemon=True, name="device-timeline")
            self.thread.start()

    def new_run(self):
        self.run_id += 1

    def dispatched(self, program, outputs=None):
        """Counts a dispatch of the worker's, and times it on the device when `outputs` are given."""
        if threading.get_ident() != self.owner:
            return
        self.dispatches[program] += 1
        if outputs is not None:
            stalls = self.stalling and program.startswith("prefill")
            self.queue.put((program, time.perf_counter(), outputs, stalls, self.run_id))

    def run(self):
        import jax
        last_done, last_run = None, None
        while True:
            program, at, outputs, stalls, run = self.queue.get()
            try:
                jax.block_until_ready(outputs)
            except Exception:  # the worker learns of a failed dispatch when it reads it; here it just ends
                pass
            done = time.perf_counter()
            same_run = last_done is not None and run == last_run
            if same_run and at > last_done:
                self.idle += at - last_done
            began = max(at, last_done) if same_run else at
            self.busy[program] += done - began
            if stalls:
                self.stall += done - began
            last_done, last_run = done, run
            del outputs  # not held while waiting for the next dispatch: its buffers may go now

    def render(self):
        lines = ["# HELP serve_dispatches_total Programs the model worker dispatched to the device, by kind.",
                 "# TYPE serve_dispatches_total counter"]
        lines += [f'serve_dispatches_total{{program="{p}"}} {n}' for p, n in self.dispatches.items()]
        lines += ["# HELP serve_device_busy_seconds_total Device time of the worker's dispatches, by program (the "
                  "untimed copies before one are in it).", "# TYPE serve_device_busy_seconds_total counter"]
        lines += [f'serve_device_busy_seconds_total{{program="{p}"}} {s:.6f}' for p, s in self.busy.items()]
        return lines + [
            "# HELP serve_device_idle_seconds_total Time the device waited for the host between two dispatches of "
            "one batch: the host was the wall.", "# TYPE serve_device_idle_seconds_total counter",
            f"serve_device_idle_seconds_total {self.idle:.6f}",
            "# HELP serve_prefill_stall_seconds_total Device time of prefills dispatched while other rows were "
            "decoding: the decode time they stalled.", "# TYPE serve_prefill_stall_seconds_total counter",
            f"serve_prefill_stall_seconds_total {self.stall:.6f}"]


class ThreadCPU:
    """The process's CPU time by kind of thread, to tell whether the GIL is the wall (issue #48): Python's
    threads run Python one at a time, so when the model worker's and the HTTP threads' CPU together come near
    the wall time, the worker waits for the GIL and an HTTP front end in a process of its own would pay; well
    below it, it would not. A live thread's time is read from /proc/self/task (Linux: elsewhere none is
    given); an HTTP thread's is kept as it ends, since each connection has a thread of its own."""
    ROLES = {"worker": "the model worker",
             "http": "the threads that read requests and write answers, and the one that writes every stream",
             "python_other": "every other Python thread (the warm-up's, the device timeline, the reaper)",
             "native": "the rest: threads Python did not start (the XLA runtime's), and Python threads that came "
                       "and went between two readings"}

    def __init__(self):
        self.lock = threading.Lock()
        self.http = set()  # native ids of the HTTP threads running: each adds its whole time as it ends
        # Other threads' time as last read, and of those that ended, so that their time stays theirs (up to
        # their last reading): a counter that fell whenever the warm-up's threads ended would say nothing.
        self.seen, self.ended = {}, dict.fromkeys(("worker", "http", "python_other"), 0.0)
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @contextlib.contextmanager
    def http_thread(self):
        tid = threading.get_native_id()
        with self.lock:
            self.http.add(tid)
        try:
            yield
        finally:
            with self.lock:
                self.http.discard(tid)
                self.ended["http"] += time.thread_time()

    def of_thread(self, tid):
        """A live thread's CPU seconds (0 if it has just ended): utime and stime, in clock ticks."""
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.tick

    def totals(self):
        """{role: CPU seconds}, or None where /proc cannot tell."""
        if not os.path.isdir("/proc/self/task"):
            return None
        seconds = dict.fromkeys(self.ROLES, 0.0)
        with self.lock:  # an HTTP thread that ends meanwhile waits, then counts once, as ended
            process = time.process_time()
            live = {}
            for thread in threading.enumerate():
                tid = thread.native_id
                if tid in self.http:
                    seconds["http"] += self.of_thread(tid)
                    continue
                role = {"model-worker": "worker", "stream-writer": "http"}.get(thread.name, "python_other")
                live[thread] = role, self.of_thread(tid)
            for thread, (role, last) in self.seen.items():
                if thread not in live:
                    self.ended[role] += last
            self.seen = live
            for role, last in live.values():
                seconds[role] += last
            for role, ended in self.ended.items():
                seconds[role] += ended
        seconds["native"] = max(0.0, process - sum(seconds.values()))
        return seconds

    def render(self):
        seconds = self.totals()
        if seconds is None:
            return []
        return ["# HELP serve_thread_cpu_seconds_total The process's CPU time by thread (" + "; ".join(
                f"{role}: {what}" for role, what in self.ROLES.items()) + "). The Python threads hold one GIL: "
                "worker and http together near the wall time say it is the wall.",
                "# TYPE serve_thread_cpu_seconds_total counter"] + [
            f'serve_thread_cpu_seconds_total{{role="{role}"}} {s:.6f}' for role, s in seconds.items()]


WORKER_CLOCK, TIMELINE, THREAD_CPU = PartClock(), DeviceTimeline(), ThreadCPU()


def label(value):
    """A Prometheus label value, escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# ----------------------------------------------------------------------------- model

def count_compilation():
    """serve_compilations_total, and apart from it those of no warm-up thread: compiled on a request's behalf."""
    METRICS.add("compilations")
    if not threading.current_thread().name.startswith(("loader", "warm-up")):
        METRICS.add("request_compilations")


def on_compilation(callback):
    """Calls callback() after every XLA compilation in this process (the warm-up's, and any that should not
    happen at request time)."""
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: callback() if event == "/jax/core/compile/backend_compile_duration" else None)


def keep_unused_imports_out(model=None):
    """keras-hub imports TensorFlow whenever it is installed, and this script never runs it: the model loads
    without its task's preprocessor and text goes through SentencePiece. Kept out, it costs no memory (about
    800 MiB of RSS, see BENCHMARKS.md) and cannot take the GPU's memory from JAX. keras imports IPython (and
    with it jedi and prompt_toolkit: 450 modules, 20 MiB) only to tell whether it runs in a notebook, which
    a script started from the command line never does. kagglehub (with kagglesdk: 280 modules, 14 MiB) only
    downloads presets, which a `model` in a local directory or on hf:// never needs. A None in sys.modules
    makes such an import fail, which keras and keras-hub take as "not installed"; a module already
    imported (a notebook's IPython) stays."""
    names = ["tensorflow", "IPython"]
    if model is not None and (str(model).startswith("hf://") or Path(model).expanduser().is_dir()):
        names.append("kagglehub")
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None


def start_backend():
    """Starts JAX's backend on a thread of its own: on a TPU its runtime takes seconds to come up, which
    then overlap keras-hub's import. Whoever needs the backend next waits for it."""
    import jax

    def start():
        try:
            jax.devices()
        except Exception:  # no usable backend: the loader's own first use of it says why
            pass
    threading.Thread(target=start, daemon=True, name="backend").start()


def make_text_codec(tokenizer):
    """(encode, decode) without TensorFlow: SentencePiece directly for Gemma-family tokenizers."""
    sp = sentence_piece(tokenizer)
    if sp is not None:
        return sp.encode, sp.decode
    return (lambda text: np.asarray(tokenizer(text)).tolist()), (lambda ids: str(tokenizer.detokenize(ids)))


def sentence_piece(tokenizer):
    """The SentencePieceProcessor of a keras-hub SentencePiece tokenizer (None for any other): keras-hub's
    own when it has one. Each costs its vocabulary's size in RSS (Gemma 3's 262,144 pieces: 44 MiB), and the
    text codec and the grammar's token table both use it."""
    proto = getattr(tokenizer, "proto", None)
    if proto is None:
        return None
    import sentencepiece
    own = getattr(tokenizer, "_sentence_piece_spm", None)
    if isinstance(own, sentencepiece.SentencePieceProcessor):
        return own
    if isinstance(proto, (str, os.PathLike)):
        proto = Path(proto).read_bytes()
    return sentencepiece.SentencePieceProcessor(model_proto=proto)


class SentencePieces(collections.abc.Sequence):
    """A SentencePiece vocabulary read from its processor as asked: piece by id, `in`, len. keras-hub's
    tokenizer keeps the whole vocabulary twice more, as a list of strings and a dict back to ids (Gemma 3's
    262,144 pieces: 37 MiB of RSS), for what the processor answers itself."""

    def __init__(self, processor):
        self.processor, self.size = processor, processor.get_piece_size()  # a loaded vocabulary never changes

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        return self.processor.id_to_piece(i % self.size)

    def __contains__(self, piece):
        return self.id(piece) is not None

    def id(self, piece):
        """The piece's id, or None: SentencePiece answers an unknown piece with the unknown token's id."""
        if not isinstance(piece, str):
            return None
        i = self.processor.piece_to_id(piece)
        return i if self.processor.id_to_piece(i) == piece else None


class SentencePieceIds(collections.abc.Mapping):
    """The piece -> id dict keras-hub's tokenizer keeps, answered by the processor (see SentencePieces)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def __getitem__(self, piece):
        i = self.pieces.id(piece)
        if i is None:
            raise KeyError(piece)
        return i

    def __iter__(self):
        return iter(self.pieces)

    def __len__(self):
        return len(self.pieces)


def pieces_of(tokenizer):
    """A tokenizer's pieces by id, with `in`: a SentencePieces view of keras-hub's SentencePiece tokenizers,
    whose own list and dict it then replaces (keras-hub reads them through the same operations), so the
    vocabulary is held once, in the processor; any other tokenizer's get_vocabulary()."""
    processor = sentence_piece(tokenizer)
    if processor is None or not hasattr(tokenizer, "_token_to_id_map"):
        return tokenizer.get_vocabulary()
    pieces = getattr(tokenizer, "_vocabulary", None)
    if not isinstance(pieces, SentencePieces):
        pieces = SentencePieces(processor)
        tokenizer._vocabulary, tokenizer._token_to_id_map = pieces, SentencePieceIds(pieces)
    return pieces


def check_model_exists(preset):
    """A local path that is not there is the most common first mistake: say so before binding the port."""
    if not preset.startswith(("hf://", "kaggle://")) and ("/" in preset or preset.startswith(".")) \
            and not Path(preset).exists():
        hint = " Run `python3 train_local.py` first (it writes it), or" if preset == "./gemma-2b-dolly-lora" else ""
        print(f"error: --model {preset}: no such directory.{hint} pass --model with a trained output dir, a Keras "
              "preset or a transformers-layout dir, or a handle such as hf://google/gemma-2b", file=sys.stderr)
        raise SystemExit(2)


def check_adapters_exist(args):
    """A wrong adapter path is one line before binding the port, as a wrong --model is."""
    for name, path in args.adapter.items():
        try:
            adapter_kind(Path(path))
        except AdapterError as e:
            print(f"error: --adapter {name}={path}: {e}", file=sys.stderr)
            raise SystemExit(2)


def explain_load_error(preset, error):
    text = f"{type(error).__name__}: {error}"
    low = text.lower()
    if preset.startswith("hf://") and any(s in low for s in ("401", "403", "gated", "unauthorized", "access")):
        return (f"could not load {preset}: Hugging Face refused access ({text.splitlines()[0][:200]}).\n"
                "Gemma is gated: accept the license on its model page while logged in, create a read token "
                "at https://huggingface.co/settings/tokens, then `export HF_TOKEN=hf_...`.")
    if preset.startswith("kaggle://") or "kaggle" in low:
        if any(s in low for s in ("401", "403", "credential", "unauthorized", "consent", "license")):
            return (f"could not load {preset}: Kaggle refused access ({text.splitlines()[0][:200]}).\n"
                    "Accept the Gemma license on kaggle.com/models/google/gemma, then set KAGGLE_USERNAME and "
                    "KAGGLE_KEY (or put kaggle.json in ~/.kaggle).")
    if any(s in low for s in ("connection", "resolve", "network", "timed out", "offline", "max retries",
                              "name or service not known", "localentrynotfound")):
        return (f"could not load {preset}: the network is unreachable ({text.splitlines()[0][:200]}).\n"
                "Offline, pass a local model dir: --model path/to/model (a Keras preset or a transformers-"
                "layout dir with config.json, model.safetensors and tokenizer.model).")
    if preset.startswith("hf://") and "no config.json" in low:  # keras-hub's word for "the download failed"
        return (f"could not load {preset}: Hugging Face gave no config.json (no network, a typo, or a gated "
                "model without HF_TOKEN).\nOffline, pass a local model dir: --model path/to/model.")
    if not preset.startswith(("hf://", "kaggle://")) and ("/" in preset or preset.startswith(".")) \
            and not Path(preset).exists():
        return f"--model {preset}: no such directory"
    return f"could not load {preset}: {text.splitlines()[0][:500]}"


def saved_dtype(preset):
    """The dtype a preset was saved in: a Keras preset's policy, a transformers config's torch_dtype."""
    from keras_hub.src.utils.preset_utils import get_preset_loader
    config = getattr(get_preset_loader(preset), "config", None) or {}
    config = config.get("config", config)
    dtype = config.get("dtype") or config.get("torch_dtype")
    if isinstance(dtype, dict):  # a serialized DTypePolicy
        dtype = dtype.get("config", {}).get("name")
    return dtype if dtype in ("float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16") else "float32"


def process_rss():
    """This process's resident memory in bytes, now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def locked_bytes():
    """This process's host memory that is locked or pinned (VmLck + VmPin: 0 where /proc says neither): part of
    its RSS that no other process can have, e.g. a TPU runtime's buffer for transfers."""
    total = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmLck:", "VmPin:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


class MemoryLog:
    """Where the process's resident memory went: RSS at each stage of start-up (the differences add up to
    the last), next to the sizes of what the device holds (weights, each batch's KV cache, the prefix pool,
    adapter slots). On a CPU those live inside the RSS; on a GPU or TPU they do not. Of the RSS, what is locked
    or pinned is said apart: on a TPU the runtime pins TPU_PREMAPPED_BUFFER_SIZE bytes (4 GiB by default) at
    its start, for transfers (scripts/host_memory.py measures a start's steps one at a time)."""

    def __init__(self):
        self.stages = [("start", process_rss())]
        self.held = []  # (what, bytes) on the device

    def stage(self, name):
        self.stages.append((name, process_rss()))

    def lines(self):
        (first, base), total = self.stages[0], self.stages[-1][1]
        parts = [f"{first} {base / 2**20:,.0f}"]
        for (_, before), (name, now) in zip(self.stages, self.stages[1:]):
            parts.append(f"{'+' if now >= before else '-'} {name} {abs(now - before) / 2**20:,.0f}")
        lines = [f"memory: RSS {total / 2**20:,.0f} MiB = " + " ".join(parts),
                 "memory: held for the model: " + ", ".join(f"{what} {size / 2**20:,.1f} MiB" for what, size in self.held)]
        if locked := locked_bytes():
            lines.append(f"memory: of the RSS, {locked / 2**20:,.0f} MiB locked or pinned (a device runtime's host "
                         f"buffers; on a TPU, TPU_PREMAPPED_BUFFER_SIZE sets its transfer buffer)")
        return lines


def release_freed_memory():
    """Hands memory freed by quantizing back to the OS: glibc keeps it otherwise, and RSS would not shrink."""
    import gc
    gc.collect()
    trim_heap()


@contextlib.contextmanager
def one_collection_after():
    """Keras collects garbage every time a layer drops a variable (Layer.__delattr__), so that the device frees
    its buffer at once; quantizing drops every kernel, and each collection walks the whole heap: 127 of them
    were 37 of quantizing's 40-44 s for Gemma 3 270M on a CPU (the 2B's quantizing took 65 s on a TPU v5e).
    The kernels go with their last reference anyway (the same peak RSS either way: 3,224 and 3,223 MiB), so
    meanwhile collections are skipped; the caller collects once after (release_freed_memory)."""
    import gc
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


def trim_heap():
    """glibc's malloc_trim: the free pages of every arena back to the OS. Without a garbage collection (which
    would hold the GIL from the decode loop), so a request handler may call it."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS): nothing to trim
        pass


def load_model(args, memory=None, alone=False):
    """The preset in the dtype asked for (auto: as saved), quantized if asked; errors explained in one line.
    `memory`: a MemoryLog to note each step's RSS in. `alone`: nothing else in the process has compiled
    programs to keep (the server), so JAX's caches can be emptied of what loading compiled."""
    import jax
    try:
        dtype = saved_dtype(args.model) if args.dtype == "auto" else args.dtype
        model = load_causal_lm(args.model, dtype=dtype)
    except Exception as e:
        raise LoadError(explain_load_error(args.model, e).replace("\n", " ")) from None
    shapes = lora_kernel_shapes(model.backbone) if hasattr(model.backbone, "transformer_layers") else {}
    # Each array operation of loading ran eagerly: a small program, compiled and kept in JAX's caches, that
    # serving never runs again (Gemma 3 270M: 33 MiB of RSS; 76 MiB more after quantizing to int8).
    if alone:
        jax.clear_caches()
    if getattr(model, "preprocessor", None) is not None:
        pieces_of(model.preprocessor.tokenizer)  # the vocabulary held once, before the table says what loading took
    release_freed_memory()  # the converter's and loader's copies of the weights
    if memory is not None:
        memory.stage("model loaded")
    if args.quantize != "none":
        import keras
        # The dense layers and the embedding: all Gemma's big weights. The embedding is also the tied output
        # head, the largest product of a decode step; quantized, its step reads a quarter of the bytes.
        # keras' int8 layers quantize each row's activations and run an int8 x int8 dot. On XLA's CPU
        # backend that dot is YNNPACK's, the fastest lowering measured (scripts/bench_lowering.py): about
        # 10-13 GB/s of weights over two rows. A float32 or bfloat16 dot of the kernel converted in the graph
        # runs at about 1 GB/s, a multiply-and-reduce at 0.4-8. (GPU and TPU compilers can fuse such a convert
        # into the dot; not measured here.)
        try:
            with one_collection_after():
                model.backbone.quantize(args.quantize, filters=lambda layer: isinstance(
                    layer, (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)))
        except Exception as e:
            raise LoadError(f"--quantize {args.quantize}: {type(model.backbone).__name__} cannot be quantized so: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        if alone:
            jax.clear_caches()  # quantizing's eager programs, as loading's above
        release_freed_memory()
        if memory is not None:
            memory.stage("quantized")
    return model, dtype, shapes


def load_causal_lm(preset, **kwargs):
    """keras-hub's CausalLM without the task's own preprocessor: it serves keras-hub's generate() and tf.data,
    and some (Gemma 3's) refuse to exist without TensorFlow. A plain one holds the tokenizer, all this script
    reads. Its variables start as zeros, not random (see zeros_for_random_initializers)."""
    import keras_hub
    with zeros_for_random_initializers(), mapped_safetensors():
        model = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **kwargs)
    # Keras wraps every list and dict a layer keeps to track variables in them; a tokenizer's vocabulary (256k
    # pieces, and a dict of them) holds none, and wrapping it cost 0.55 of its 0.78 s on this CPU.
    from keras.src.utils.tracking import DotNotTrackScope
    with DotNotTrackScope():
        tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    model.preprocessor = keras_hub.models.CausalLMPreprocessor(tokenizer=tokenizer)
    return model


class zeros_for_random_initializers:
    """While a checkpoint loads, a variable Keras would fill from a random initializer starts as zeros: Keras
    initializes every variable when the model is built, and the weights read next overwrite them all (a
    test checks it). Random ones cost: Gemma 3 270M on a CPU loads in 3.4-3.7 s instead of 10-12 s, and on
    an accelerator each shape's random program is compiled on a first start. Zeros, ones and constants
    stay as they are."""

    def __enter__(self):
        import keras
        from keras.src.backend.common import variables
        from keras.src.initializers.random_initializers import RandomInitializer
        self.initialize = initialize = variables.Variable._initialize_with_initializer

        def zeros_for_random(variable, initializer):
            if not isinstance(initializer, RandomInitializer):
                return initialize(variable, initializer)
            variable._initialize(keras.ops.zeros(variable._shape, variable._dtype))
        variables.Variable._initialize_with_initializer = zeros_for_random

    def __exit__(self, *_):
        from keras.src.backend.common import variables
        variables.Variable._initialize_with_initializer = self.initialize


class mapped_safetensors:
    """While a checkpoint loads, keras-hub reads each tensor of a .safetensors file as a view of the file mapped
    into memory, not as a fresh copy: off a CPU the weights go from the page cache to the accelerator with no
    host copy of their own (a converter's transpose still makes one). That copy was most of a warm load on
    the TPU host: 5.9 of 7.8 s for gemma_2b's 4.7 GiB, faulting in fresh pages. On a CPU each tensor is
    still copied once (safetensors copied twice): there JAX may keep an aligned host array as the weight
    itself, and a file rewritten under a running server (a new training run into the same directory)
    would then crash it."""

    def __enter__(self):
        from keras_hub.src.utils.transformers import safetensor_utils
        self.module, self.original = safetensor_utils, safetensor_utils.safetensors
        if self.original is not None:
            import jax
            copy = jax.default_backend() == "cpu"
            safetensor_utils.safetensors = type("mapped", (), {
                "safe_open": staticmethod(lambda path, framework="np", **_: MappedSafetensors(path, copy))})
        return self

    def __exit__(self, *_):
        self.module.safetensors = self.original


class MappedSafetensors:
    """One .safetensors file as safetensors' safe_open(framework="np") reads it: keys() and get_tensor(name).
    The format: a little-endian u64 header length, a JSON header of name -> dtype, shape and byte offsets
    into the data that follows."""
    DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
              "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
              "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

    def __init__(self, path, copy):
        import mmap
        import ml_dtypes  # noqa: F401  (gives numpy bfloat16 and the float8 types by name)
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(size))
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.header.pop("__metadata__", None)
        self.start, self.copy = 8 + size, copy
        if hasattr(self.map, "madvise"):  # read ahead from disk on a first load; nothing to read when cached
            self.map.madvise(mmap.MADV_WILLNEED)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        # The views handed out keep the map open until the last is gone (an accelerator's transfer may still
        # be reading one); closing it under them would raise.
        self.map = None

    def keys(self):
        return list(self.header)

    def get_tensor(self, name):
        import numpy as np
        entry = self.header[name]
        dtype = np.dtype(self.DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        tensor = np.frombuffer(self.map, dtype, (end - begin) // dtype.itemsize, self.start + begin)
        tensor = tensor.reshape(entry["shape"])
        return tensor.copy() if self.copy else tensor


class LoadError(Exception):
    """A model that cannot be served as asked: one line for the user, exit code 2."""


def setup_distribution(args):
    """Returns the keras distribution to load the model under, or None for one device."""
    import keras
    devices = keras.distribution.list_devices()
    mode = args.distribution
    if mode == "auto":
        mode = "data" if len(devices) > 1 else "off"
    if mode == "off":
        return None, 1
    if mode == "data":
        distribution, batch_axis = keras.distribution.DataParallel(devices=devices), len(devices)
    else:
        batch_axis, model_axis = (int(s) for s in args.mesh.split(",")) if args.mesh else (1, len(devices))
        if batch_axis * model_axis != len(devices):
            raise SystemExit(f"error: --mesh {args.mesh}: {batch_axis}x{model_axis} != {len(devices)} devices")
        mesh = keras.distribution.DeviceMesh(shape=(batch_axis, model_axis), axis_names=("batch", "model"),
                                             devices=devices)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map_for(args.model, mesh, model_axis),
                                                        batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    log(f"distribution: {mode} over {len(devices)} devices")
    return distribution, batch_axis


def layout_map_for(preset, mesh, model_axis):
    """The family's layout map, K/V replicated when there are fewer KV heads than model shards (keras-hub #1613)."""
    from keras_hub.models import GemmaBackbone
    from keras_hub.src.utils.preset_utils import get_preset_loader
    loader = get_preset_loader(preset)
    cls = loader.check_backbone_class()
    layout_map = getattr(cls, "get_layout_map", GemmaBackbone.get_layout_map)(
        mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch")
    config = getattr(loader, "config", {}) or {}
    config = config.get("config", config)
    kv_heads = config.get("num_key_value_heads") or config.get("num_kv_heads") or 1
    qkv = "decoder_block.*attention.*(query|key|value).kernel"
    if qkv in layout_map and kv_heads % model_axis:
        spec = layout_map[qkv]
        del layout_map[qkv]
        layout_map["decoder_block.*attention.*query.kernel"] = spec
        layout_map["decoder_block.*attention.*(key|value).kernel"] = (None,) + tuple(spec.axes[1:])
    return layout_map


# Pieces that mark structure (chat turns, images, placeholders), never text a grammar may spell out.
MARKER_PIECES = re.compile(r"<(start|end)_of_(turn|image)>|<mask>|\[multimodal\]|<image_soft_token>|<unused\d+>")


def grammar_tokenizer(tokenizer, vocabulary_size, stop_ids):
    """llguidance's view of a SentencePiece vocabulary, for structured output: '▁' is a space, '<0xNN>' one
    raw byte, control pieces, chat/image markers and the stop tokens are special (never text), and the
    stop tokens end a finished grammar. None for a tokenizer that is not SentencePiece."""
    proto = getattr(tokenizer, "proto", None)
    if proto is None:
        return None
    import llguidance
    from sentencepiece import sentencepiece_model_pb2
    if isinstance(proto, (str, os.PathLike)):
        proto = Path(proto).read_bytes()
    pieces = sentencepiece_model_pb2.ModelProto.FromString(proto).pieces
    sp = sentence_piece(tokenizer)

    class Vocabulary:  # the attributes and call llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id = min(stop_ids), tokenizer.start_token_id

        def __init__(self):
            self.tokens, self.special_token_ids = [], []

        def __call__(self, text):
            return sp.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)
    vocabulary = Vocabulary()
    for i, piece in enumerate(pieces):
        # SentencePiece piece types: 2 unknown, 3 control, 5 unused, 6 byte; 4 (user-defined) is text too,
        # as Gemma's newline and space runs and HTML tags are.
        if piece.type in (2, 3, 5) or i in stop_ids or MARKER_PIECES.fullmatch(piece.piece):
            vocabulary.tokens.append(b"\xff" + piece.piece.encode())
            vocabulary.special_token_ids.append(i)
        elif piece.type == 6:
            vocabulary.tokens.append(bytes([int(piece.piece[3:5], 16)]))
        else:
            vocabulary.tokens.append(piece.piece.replace("\u2581", " ").encode())
    vocabulary.tokens += [b""] * (vocabulary_size - len(vocabulary.tokens))
    wrapper = llguidance.TokenizerWrapper(vocabulary)
    table = llguidance.LLTokenizer(wrapper, n_vocab=vocabulary_size, eos_token=sorted(stop_ids))
    wrapper.tokens = vocabulary.tokens = None  # copied into llguidance's table; Gemma's are 13 MiB of bytes objects
    return table


def read_prompt_template(model_dir, vocabulary):
    """The template train_local.py recorded beside the weights. Without a record: Gemma's turn format
    when the tokenizer knows <start_of_turn> (an instruction-tuned preset), else the article's."""
    record = Path(model_dir) / "training.json"
    if record.is_file():
        recorded = json.loads(record.read_text()).get("prompt_template") or {}
        template = dict(TEMPLATES.get(recorded.get("name"), TEMPLATES["article"]), name=recorded.get("name", "article"))
        template.update({k: v for k, v in recorded.items() if v is not None and k in template})
        return template
    name = "gemma-chat" if "<start_of_turn>" in vocabulary else "article"
    return dict(TEMPLATES[name], name=name)


# ----------------------------------------------------------------------------- adapters
# Many LoRA fine-tunes over the one base. Whatever an adapter comes as (train_local.py's
# adapter.lora.h5, or a Hugging Face PEFT dir), it is held in PEFT's form: per (layer, module) a
# `down` (in, r) and an `up` (r, out) with the scale folded in, in transformers' flattening of the
# kernel's input and output axes. The engine keeps --max-adapters slots of them, padded to
# --max-lora-rank, in fixed-shape tables: loading an adapter writes a slot and never compiles, and
# every row of a decode batch reads its own slot, so any mix of adapters shares one batch.

LORA_MODULES = {  # PEFT's module names -> where keras-hub's Gemma decoder blocks keep that projection
    "q_proj": ("attention", "query_dense"), "k_proj": ("attention", "key_dense"),
    "v_proj": ("attention", "value_dense"), "o_proj": ("attention", "output_dense"),
    "gate_proj": ("gating_ffw",), "up_proj": ("gating_ffw_2",), "down_proj": ("ffw_linear",),
}
KERAS_ADAPTER, PEFT_CONFIG, PEFT_WEIGHTS = "adapter.lora.h5", "adapter_config.json", "adapter_model.safetensors"
PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


DEFAULT_LORA_MODULES = ("q_proj", "v_proj")  # what keras-hub's enable_lora and PEFT's Gemma default train


def parse_lora_modules(spec):
    """--lora-modules: PEFT's projection names, comma-separated, or all-linear for every one; in
    LORA_MODULES' order."""
    names = set(LORA_MODULES) if spec.strip() == "all-linear" else {m.strip() for m in spec.split(",") if m.strip()}
    unknown = sorted(names - set(LORA_MODULES))
    if unknown or not names:
        raise ValueError(f"{','.join(unknown) or 'none given'}: choose from {','.join(LORA_MODULES)}, or all-linear")
    return [m for m in LORA_MODULES if m in names]


def keras_lora_scale(model_dir):
    """alpha / rank of a train_local.py adapter, from its training.json (the .lora.h5 keeps only the rank);
    1.0, keras-hub's own scale, for a run that recorded no alpha."""
    record = Path(model_dir) / "training.json"
    args = json.loads(record.read_text()).get("args", {}) if record.is_file() else {}
    return args["lora_alpha"] / args["lora_rank"] if args.get("lora_alpha") else 1.0


class AdapterError(Exception):
    """An adapter that cannot go on this base (or into this server now), said in one line."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


def lora_layer(backbone, index, module):
    layer = backbone.transformer_layers[index]
    for attribute in LORA_MODULES[module]:
        layer = getattr(layer, attribute)
    return layer


def kernel_axes(equation):
    """(input axes, output axes) of an EinsumDense kernel, as positions in its shape."""
    inputs, output = equation.split("->")
    x, kernel = inputs.split(",")
    ins = [i for i, c in enumerate(kernel) if c in x and c not in output]
    outs = [i for i, c in enumerate(kernel) if c in output and c not in x]
    if len(ins) + len(outs) != len(kernel) or not outs or outs[-1] != len(kernel) - 1:
        raise AdapterError(f"a kernel of equation {equation} cannot take a LoRA adapter")
    return ins, outs


def lora_equations(equation):
    """Two einsums for x -> x·down -> ·up, from the layer's own equation."""
    inputs, output = equation.split("->")
    x, kernel = inputs.split(",")
    ins, outs = kernel_axes(equation)
    r = next(c for c in "rzyxwvuqpo" if c not in equation)
    k_in, k_out = "".join(kernel[i] for i in ins), "".join(kernel[i] for i in outs)
    kept = "".join(c for c in x if c not in k_in)
    return f"{x},{k_in}{r}->{kept}{r}", f"{kept}{r},{r}{k_out}->{output}"


def lora_kernel_shapes(backbone):
    """{(layer, module): (kernel shape, equation)} of every projection an adapter may target; read
    before quantizing, which packs some kernels into other shapes."""
    return {(i, m): (tuple(lora_layer(backbone, i, m).kernel.shape), lora_layer(backbone, i, m).equation)
            for i in range(len(backbone.transformer_layers)) for m in LORA_MODULES}


def keras_factors_to_peft(a, b, shape, equation):
    """Keras's LoRA factors (A: kernel[:-1] + (r,), B: (r, kernel[-1])) as PEFT's (down, up). B is shared
    over the output axes before the last (query's heads), so those multiply the rank: exact, not fitted."""
    import numpy as np
    ins, outs = kernel_axes(equation)
    extra, r = outs[:-1], b.shape[0]
    e = int(np.prod([shape[i] for i in extra]))
    down = np.transpose(a, ins + extra + [a.ndim - 1]).reshape(int(np.prod([shape[i] for i in ins])), e * r)
    up = np.einsum("ef,kj->ekfj", np.eye(e, dtype=b.dtype), b).reshape(e * r, e * shape[-1])
    return down.astype(np.float32), up.astype(np.float32)


def read_keras_adapter(h5_path, backbone, shapes):
    """train_local.py's adapter.lora.h5 (keyed by index among the backbone's layers that have weights) as
    {(layer, module): (down, up)}."""
    import h5py
    import numpy as np
    layers = [layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]
    where = {id(lora_layer(backbone, i, m)): (i, m) for i, m in shapes}
    factors = {}
    with h5py.File(h5_path, "r") as f:
        for index, group in f["lora"].items():
            if index == "vars":
                continue
            if not index.isdigit() or int(index) >= len(layers) or id(layers[int(index)]) not in where:
                raise AdapterError(f"its layer {index} is not a projection of this base: trained for another model")
            key = where[id(layers[int(index)])]
            a, b = np.asarray(group["vars"]["lora_kernel_a"]), np.asarray(group["vars"]["lora_kernel_b"])
            shape, equation = shapes[key]
            if a.shape[:-1] != shape[:-1] or b.shape != (a.shape[-1], shape[-1]):
                raise AdapterError(f"layers.{key[0]}.{key[1]} is {a.shape} x {b.shape}, the base's kernel is "
                                   f"{shape}: trained for another model")
            factors[key] = keras_factors_to_peft(a, b, shape, equation)
    return factors


def read_peft_adapter(path, shapes):
    """A Hugging Face PEFT LoRA dir: scale lora_alpha/r (alpha/sqrt(r) with use_rslora), per-module
    rank and alpha patterns honoured."""
    import math
    from safetensors.numpy import load_file
    config = json.loads((path / PEFT_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')} is not LORA")
    for field, fine in (("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(field, fine) != fine:
            raise AdapterError(f"{field}={config[field]} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']} is not supported: only bias='none'")
    tensors = load_file(str(path / PEFT_WEIGHTS))
    pairs = {}
    for name, tensor in tensors.items():
        match = PEFT_KEY.search(name)
        if match is None or match[2] not in LORA_MODULES:
            raise AdapterError(f"it targets {name}, which this server cannot apply (only "
                               f"{', '.join(LORA_MODULES)} of the decoder layers)")
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    factors = {}
    for key, pair in pairs.items():
        if key not in shapes:
            raise AdapterError(f"it has layers.{key[0]}.{key[1]}, the base has {len(shapes) // len(LORA_MODULES)} "
                               "layers: trained for another model")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layers.{key[0]}.{key[1]} lacks lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"].astype("float32"), pair["B"].astype("float32")
        shape, equation = shapes[key]
        ins, outs = kernel_axes(equation)
        n_in, n_out = math.prod(shape[i] for i in ins), math.prod(shape[i] for i in outs)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape != (n_out, a.shape[0]):
            raise AdapterError(f"layers.{key[0]}.{key[1]} is {list(b.shape)} x {list(a.shape)}, the base's "
                               f"projection is [{n_out}, {n_in}]: trained for another model")
        r = a.shape[0]
        alpha = next((v for k, v in (config.get("alpha_pattern") or {}).items() if re.search(rf"(^|\.){k}$",
                     f"layers.{key[0]}.{key[1]}")), config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        factors[key] = (a.T.copy(), (b * scale).T.copy())
    return factors


def adapter_kind(path):
    """"keras" for a train_local.py output dir, "peft" for a PEFT LoRA dir; AdapterError otherwise."""
    if not path.is_dir():
        raise AdapterError(f"{path}: no such directory")
    if (path / KERAS_ADAPTER).is_file():
        return "keras"
    if (path / PEFT_CONFIG).is_file() and (path / PEFT_WEIGHTS).is_file():
        return "peft"
    raise AdapterError(f"{path} has neither {KERAS_ADAPTER} (train_local.py's output) nor "
                       f"{PEFT_CONFIG} + {PEFT_WEIGHTS} (a PEFT LoRA)")


def read_adapter(name, path, backbone, shapes, vocabulary):
    """An Adapter from a train_local.py output dir or a PEFT dir, checked against the base."""
    path = Path(path)
    kind = adapter_kind(path)
    try:
        if kind == "keras":  # PEFT's form keeps the scale folded into `up`; the .h5 has none, its record does
            scale = keras_lora_scale(path)
            factors = {key: (down, up * scale) for key, (down, up) in
                       read_keras_adapter(path / KERAS_ADAPTER, backbone, shapes).items()}
        else:
            factors = read_peft_adapter(path, shapes)
    except AdapterError:
        raise
    except Exception as e:  # a truncated or foreign file: one line, not a failed start-up or a 500
        raise AdapterError(f"cannot read it: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
    if not factors:
        raise AdapterError("it holds no LoRA weights")
    template = read_prompt_template(path, vocabulary) if (path / "training.json").is_file() else None
    return Adapter(name, str(path), kind, factors, template)


ADAPTER_IDS = itertools.count(1)  # 0 is the base, in prefix-cache keys


class Adapter:
    """One loaded adapter: its PEFT-form factors, the template it was trained with (if recorded), its slot."""

    def __init__(self, name, path, kind, factors, template):
        self.name, self.path, self.kind, self.factors, self.template = name, path, kind, factors, template
        self.uid = next(ADAPTER_IDS)  # unique for the life of the process: a reloaded adapter is a new one
        self.rank = max(down.shape[1] for down, _ in factors.values())
        self.modules = sorted({m for _, m in factors})
        self.nbytes = sum(down.nbytes + up.nbytes for down, up in factors.values())
        self.slot = None


class AdapterSlots:
    """--max-adapters slots of LoRA factors on the device (slot 0 holds none: the base) and which
    adapter is in which. Each targeted projection's call adds x·down[slot]·up[slot] for the slot of
    the row being traced; rows of the base add exact zeros."""

    def __init__(self, backbone, shapes, modules, max_adapters, max_rank, put):
        import jax
        self.modules, self.max_adapters, self.max_rank = tuple(modules), max_adapters, max_rank
        self.sizes, tables = {}, {}
        for (i, m), (shape, equation) in shapes.items():
            if m not in self.modules:
                continue
            ins, outs = kernel_axes(equation)
            ins, outs = tuple(shape[a] for a in ins), tuple(shape[a] for a in outs)
            n_in, n_out = self.sizes[i, m] = (int(np.prod(ins)), int(np.prod(outs)))
            tables[f"{i}.{m}"] = (np.zeros((max_adapters + 1, n_in, max_rank), np.float32),
                                  np.zeros((max_adapters + 1, max_rank, n_out), np.float32))
            self.attach(lora_layer(backbone, i, m), f"{i}.{m}", equation, ins, outs)
        self.slot_bytes = sum(a.nbytes for a in jax.tree.leaves(tables)) // (max_adapters + 1)
        self.put, self.tables = put, put(tables)
        self.by_name = {}  # name -> Adapter, for every loaded adapter
        self.held = [None] * (max_adapters + 1)  # slot -> its Adapter, until the last row using it ends
        self.refs = [0] * (max_adapters + 1)
        self.lock = threading.Lock()
        self.active = {}  # while one row is traced: "layer.module" -> its (down, up)
        self._write = Program(lambda tables, slot, new: jax.tree.map(
            lambda table, value: jax.lax.dynamic_update_index_in_dim(table, value, slot, 0), tables, new))

    def attach(self, layer, key, equation, ins, outs):
        """Wraps the layer's call, float and quantized, to add the traced row's LoRA delta in float32."""
        import jax.numpy as jnp
        into, out_of = lora_equations(equation)

        def wrap(call):
            @functools.wraps(call)
            def with_lora(inputs, *args, **kwargs):
                outputs = call(inputs, *args, **kwargs)
                if key not in self.active:
                    return outputs
                down, up = self.active[key]
                low = jnp.einsum(into, inputs.astype(jnp.float32), down.reshape(ins + (self.max_rank,)))
                return outputs + jnp.einsum(out_of, low, up.reshape((self.max_rank,) + outs)).astype(outputs.dtype)
            return with_lora
        object.__setattr__(layer, "call", wrap(layer.call))
        object.__setattr__(layer, "quantized_call", wrap(layer.quantized_call))

    @contextlib.contextmanager
    def rows(self, tables, slot):
        """Traces what runs inside with the LoRA of `slot` (a traced index) applied."""
        self.active = {key: (down[slot], up[slot]) for key, (down, up) in tables.items()}
        try:
            yield
        finally:
            self.active = {}

    def check(self, adapter):
        unknown = sorted(set(adapter.modules) - set(self.modules))
        if unknown:
            raise AdapterError(f"it targets {','.join(unknown)}, and this server applies LoRA to "
                               f"{','.join(self.modules)} only: restart it with --lora-modules "
                               f"{','.join(sorted(set(self.modules) | set(unknown)))}")
        if adapter.rank > self.max_rank:
            how = " (train_local.py's rank times the query heads: its query LoRA is shared across heads)" \
                if adapter.kind == "keras" else ""
            raise AdapterError(f"its rank {adapter.rank}{how} is over --max-lora-rank {self.max_rank}")

    def load(self, adapter):
        """Writes the adapter into a free slot (a compiled update: no compile)."""
        self.check(adapter)
        with self.lock:
            if adapter.name in self.by_name:
                raise AdapterError(f"the name {adapter.name} is taken: unload it first", 409)
            slot = next((s for s in range(1, self.max_adapters + 1) if self.held[s] is None), None)
            if slot is None:
                raise AdapterError(f"all {self.max_adapters} adapter slots are in use: unload one, or restart with a "
                                   "larger --max-adapters", 409)
            new = {}
            for (i, m), (n_in, n_out) in self.sizes.items():
                down, up = adapter.factors.get((i, m), (np.zeros((n_in, 0)), np.zeros((0, n_out))))
                padded = (np.zeros((n_in, self.max_rank), np.float32), np.zeros((self.max_rank, n_out), np.float32))
                padded[0][:, :down.shape[1]], padded[1][:up.shape[0]] = down, up
                new[f"{i}.{m}"] = padded
            self.tables = self._write(self.tables, np.int32(slot), self.put(new))
            adapter.slot, self.held[slot], self.by_name[adapter.name] = slot, adapter, adapter

    def unload(self, name):
        """Forgets the name now; its slot frees when the last generation using it ends."""
        with self.lock:
            adapter = self.by_name.pop(name, None)
            if adapter is None:
                raise AdapterError(f"no adapter named {name} is loaded", 404)
            if not self.refs[adapter.slot]:
                self.held[adapter.slot] = None

    def loaded(self):
        with self.lock:
            return list(self.by_name.values())

    def acquire(self, name):
        """The adapter a request named (None: the base), held until release(); None if not loaded."""
        with self.lock:
            adapter = self.by_name.get(name)
            if adapter is not None:
                self.refs[adapter.slot] += 1
            return adapter

    def release(self, adapter):
        with self.lock:
            self.refs[adapter.slot] -= 1
            if not self.refs[adapter.slot] and self.by_name.get(adapter.name) is not adapter:
                self.held[adapter.slot] = None


# ----------------------------------------------------------------------------- engine
# The engine's steps are module-level functions of explicit arguments, so a test can call any one
# alone: `model` and its `variables` (whose values come in traced, as `values`), `adapters`
# (AdapterSlots or None), `axes` (each cache leaf's position axis). Engine binds them, jits each
# once, and every shape it will ever be called with is compiled at warm-up.
#
# The KV cache is a tuple with one entry per layer (Gemma 1/2: a [batch, 2, length, heads, head_dim]
# array; Gemma 3: a (key, value) pair). Which axis of each leaf is the position one is read off
# abstract shapes, so no layout is assumed; the prefix-cache pool holds the same leaves cut into
# blocks of positions.

def run_stateless(variables, values, fn):
    """fn() with the model's variables read from `values`, as a jitted function must."""
    import keras
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
        return fn()


def with_adapter(adapters, tables, slot, fn):
    """fn() with the LoRA of adapter slot `slot` added (a per-row index under vmap)."""
    if adapters is None:
        return fn()
    with adapters.rows(tables, slot):
        return fn()


def signature(args):
    """What tells one program's calls apart: each argument's shape and dtype (a container's by its first
    leaf), a static argument by its value. A dispatch computes it, so it is cheap, and as fine as the
    engine's programs need: they differ in batch, window, block or steps, all of which show in those."""
    return tuple(shape_of(a) for a in args)


def shape_of(a):
    while isinstance(a, (list, tuple, dict)) and a:
        a = next(iter(a.values())) if isinstance(a, dict) else a[0]
    if isinstance(a, (list, tuple, dict)):
        return ()
    shape = getattr(a, "shape", None)
    return a if shape is None else (tuple(shape), np.dtype(a.dtype))


class Program:
    """One of the engine's jitted programs, and the executables a ProgramStore loaded for it, by call
    signature: a call runs the loaded executable that matches it, else the jit, whose own caches hold
    what the warm-up compiled (until the server hands those here too: Builder.drop_tracing). A loaded
    executable was never traced in this process: a restart skips tracing, which a warm-up does one
    program at a time (see ProgramStore)."""

    def __init__(self, fn, static_argnums=(), **jit_options):
        import jax
        self.jitted = jax.jit(fn, static_argnums=static_argnums, **jit_options)
        self.static = tuple(static_argnums)
        self.loaded = {}

    def __call__(self, *args):
        if self.loaded:
            executable = self.loaded.get(signature(args))
            if executable is not None:
                return executable(*(a for i, a in enumerate(args) if i not in self.static))
        return self.jitted(*args)

    def lower(self, *args):
        return self.jitted.lower(*args)

    def statics(self, args):
        return {i: args[i] for i in self.static}

    def add(self, executable, statics):
        """Takes a loaded executable for the calls it was compiled for: their dynamic arguments are its
        inputs, the static ones `statics` (position -> value)."""
        dynamic = iter(executable.in_avals[0])
        count = len(statics) + len(executable.in_avals[0])
        self.loaded[signature([statics[i] if i in statics else next(dynamic) for i in range(count)])] = executable


def stacks_its_cache(model):
    """Gemma 1/2: keras-hub keeps every layer's cache in one stacked array."""
    import keras_hub
    return isinstance(model, keras_hub.models.GemmaCausalLM)


def cached_call(model, token_ids, cache, index):
    """keras-hub's `call_with_cache` -> (logits, hidden states, cache), with Gemma 1/2's cache per layer,
    as Gemma 3's already is. keras-hub slices Gemma 1/2's stacked cache and stacks it anew on every call,
    so each decoded token copies the whole cache (gemma_2b, 16 rows over 1,536 positions: 450 MB)."""
    if not stacks_its_cache(model):
        return model.call_with_cache(token_ids, cache, index)
    import keras
    backbone = model.backbone
    x = backbone.token_embedding(token_ids)
    x = x * keras.ops.cast(keras.ops.sqrt(backbone.hidden_dim), x.dtype)
    caches = []
    for layer, layer_cache in zip(backbone.transformer_layers, cache):
        x, layer_cache = layer(x, cache=layer_cache, cache_update_index=index)
        caches.append(layer_cache)
    hidden_states = backbone.layer_norm(x)
    return backbone.token_embedding(hidden_states, reverse=True), hidden_states, tuple(caches)


def build_cache(model, token_ids):
    """keras-hub's prefill: the KV cache of `token_ids` from position 0."""
    import inspect
    if stacks_its_cache(model):
        import keras
        backbone = model.backbone
        shape = (token_ids.shape[0], 2, token_ids.shape[1], backbone.num_key_value_heads, backbone.head_dim)
        empty = tuple(keras.ops.zeros(shape, model.compute_dtype) for _ in backbone.transformer_layers)
        return cached_call(model, token_ids, empty, 0)[2]
    if len(inspect.signature(model._build_cache).parameters) > 1:  # Gemma 3 takes image inputs too
        return model._build_cache(token_ids, None, None, None, None)[1]
    return model._build_cache(token_ids)[1]


def prompt_cache(model, token_ids):
    """A batch's cache as the engine keeps it: (keras-hub's KV cache, the token at each position). The
    tokens are what a row's penalties count (adjust_logits); kept as a cache leaf, every program that
    copies, resizes, pools or windows the KV cache carries them along by the same position axis."""
    return build_cache(model, token_ids), token_ids


CACHE_TEMPLATES = weakref.WeakKeyDictionary()  # model -> (its one-row abstract cache of 8 positions, position axes)


def cache_template(model):
    """A model's abstract cache of one row and 8 positions, and each leaf's position axis: traced once per
    model (each trace runs the model's prefill abstractly, 0.45 s for Gemma 3 270M on a CPU), where an
    engine asks for a dozen shapes on the start-up path. The axes are the ones that grow with the length,
    after the batch axis, which must be the first."""
    if model not in CACHE_TEMPLATES:
        import jax
        import jax.numpy as jnp
        one, two = (jax.eval_shape(functools.partial(prompt_cache, model), jax.ShapeDtypeStruct(size, jnp.int32))
                    for size in ((1, 8), (2, 16)))
        if any(a.shape[0] != 1 or b.shape[0] != 2 for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two))):
            raise ValueError(f"{type(model).__name__}'s cache is not batch-major; serve.py cannot batch it")
        CACHE_TEMPLATES[model] = one, jax.tree.map(
            lambda a, b: next(i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if i and m != n), one, two)
    return CACHE_TEMPLATES[model]


def cache_shapes(model, batch, length):
    import jax
    one, axes = cache_template(model)
    return jax.tree.map(lambda s, axis: jax.ShapeDtypeStruct(
        (batch,) + s.shape[1:axis] + (length,) + s.shape[axis + 1:], s.dtype), one, axes)


def cache_bytes(model, batch, length):
    import jax
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(cache_shapes(model, batch, length)))


def cache_position_axes(model):
    """Each cache leaf's position axis."""
    return cache_template(model)[1]


def prefill(model, variables, adapters, values, token_ids, tables, slot):
    """A prompt block's cache (one row, block positions); positions past the prompt hold padding that
    decoding overwrites before any query can see it."""
    return run_stateless(variables, values, lambda: with_adapter(adapters, tables, slot,
                                                                 lambda: prompt_cache(model, token_ids)))


def prefill_group(model, variables, adapters, values, token_ids, tables, slots):
    """Several prompts in blocks of one length, a row each with its own adapter slot -> a tuple of one-row
    caches, each what `prefill` makes of its row alone (to float rounding). A short block is too few
    rows for the CPU's matrix products to run at speed, so rows prefilled together cost far less than
    one at a time (Gemma 3 270M bfloat16 on 2 CPU cores, 16 prompts in blocks of 64: 3.2 s one by one,
    1.7 s four at a time)."""
    import jax
    rows = range(token_ids.shape[0])
    if adapters is None:  # one batch, no per-row LoRA to trace
        cache = prefill(model, variables, adapters, values, token_ids, tables, 0)
        return tuple(jax.tree.map(lambda c: c[row:row + 1], cache) for row in rows)
    cache = jax.vmap(lambda ids, slot: prefill(model, variables, adapters, values, ids[None], tables, slot))(
        token_ids, slots)
    return tuple(jax.tree.map(lambda c: c[row], cache) for row in rows)


def prefill_after_prefix(model, variables, adapters, values, row_cache, token_ids, start, tables, slot):
    """The cache of a prompt whose first `start` positions are already in `row_cache` (copied from the
    prefix-cache pool; none: an empty_row): keras-hub's cached call writes the rest as one chunk at `start`,
    and its causal mask and RoPE follow that index. The logits are dropped, so XLA never computes them.
    From 0 in an empty row it is `prefill` in a longer row (positions past the block stay zero)."""
    import jax
    kv, history = row_cache

    def run():
        return cached_call(model, token_ids, kv, start)[2]
    kv = run_stateless(variables, values, lambda: with_adapter(adapters, tables, slot, run))
    return kv, jax.lax.dynamic_update_slice_in_dim(history, token_ids, start, axis=1)


def zeros_of(shapes):
    """Zeros of each leaf's shape and dtype: a batch's new cache, or an empty row."""
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def empty_row(model, length):
    """A one-row cache of `length` positions, zeros: where a prompt with no cached prefix is prefilled."""
    return zeros_of(cache_shapes(model, 1, length))


def insert(axes, cache, row_cache, row, by_select=True):
    """Writes a one-row cache into row `row` of a batch's cache: on a mesh as a select, which splits cleanly
    along a sharded batch axis; on one device (not `by_select`) as an update of that row alone. The select
    reads and writes every row's positions up to the row cache's length, once per prompt admitted: gemma_2b in
    a batch of 256 rows, 0.6 GB for a 64-token block and 4.8 GB for a 512-position window, up to 7 ms of a TPU
    v5e's bandwidth each (by arithmetic; a wave of 256 newcomers, up to 1.8 s)."""
    import jax
    import jax.numpy as jnp
    if not by_select:
        return jax.tree.map(lambda big, small: jax.lax.dynamic_update_slice(
            big, small.astype(big.dtype), (row,) + (0,) * (big.ndim - 1)), cache, row_cache)

    def put(big, small, axis):
        region = jax.lax.slice_in_dim(big, 0, small.shape[axis], axis=axis)
        is_row = (jnp.arange(big.shape[0]) == row).reshape((-1,) + (1,) * (big.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(big, jnp.where(is_row, small, region), 0, axis=axis)
    return jax.tree.map(put, cache, row_cache, axes)


@contextlib.contextmanager
def local_attention_in_its_window(model):
    """While tracing a one-token step: each sliding-window layer (Gemma 2's every other layer, five in six
    of Gemma 3's) attends over only the sliding_window_size cache positions its mask lets through, not
    the whole cache with the rest masked off. keras-hub reads every position and masks; the keys and
    values it reads are most of a long decode step (Gemma 3 270M, 8 rows over 1,536 positions)."""
    import jax
    import jax.numpy as jnp
    layers = [layer.attention for layer in getattr(model.backbone, "transformer_layers", [])
              if getattr(getattr(layer, "attention", None), "use_sliding_window_attention", False)]

    def windowed(layer, compute):
        def compute_attention(q, k, v, attention_mask, training=False, cache_update_index=0):
            size, keys = layer.sliding_window_size, k.shape[1]
            if q.shape[1] != 1 or attention_mask is None or keys <= size:
                return compute(q, k, v, attention_mask, training=training, cache_update_index=cache_update_index)
            # The window ends at the token itself (or, early on, starts at 0); keras-hub's band mask over
            # the slice, at the index within it, lets exactly these keys through.
            start = jnp.clip(cache_update_index - size + 1, 0, keys - size)
            k, v = (jax.lax.dynamic_slice_in_dim(a, start, size, axis=1) for a in (k, v))
            attention_mask = jax.lax.dynamic_slice_in_dim(attention_mask, start, size, axis=2)
            return compute(q, k, v, attention_mask, training=training, cache_update_index=cache_update_index - start)
        return compute_attention

    own = [vars(layer).get("_compute_attention") for layer in layers]
    for layer in layers:
        layer._compute_attention = windowed(layer, layer._compute_attention)
    try:
        yield
    finally:
        for layer, compute in zip(layers, own):
            if compute is None:
                del layer._compute_attention  # the class's own again
            else:
                layer._compute_attention = compute


def one_position_axis(inputs, start_indices, updates):
    """The axis along which `ops.slice_update(inputs, start_indices, updates)` writes a single position (its
    start there may be traced, every other start is 0), or None for any other write."""
    differ = [a for a, (n, m) in enumerate(zip(inputs.shape, updates.shape)) if n != m]
    fixed = all(isinstance(start, int) and start == 0 for a, start in enumerate(start_indices) if a not in differ)
    return differ[0] if len(differ) == 1 and updates.shape[differ[0]] == 1 and fixed else None


def write_one_position(array, value, position, axis):
    """`array` with `value` (length 1 along `axis`) at `position` on that axis, as a select over the axis:
    elementwise, so vmapped over rows it stays one pass over the batch's array (see
    positions_written_by_select)."""
    import jax.numpy as jnp
    at = jnp.arange(array.shape[axis]).reshape((-1,) + (1,) * (array.ndim - axis - 1)) == position
    return jnp.where(at, value.astype(array.dtype), array)


@contextlib.contextmanager
def positions_written_by_select(on):
    """While tracing a decode step (`on`): keras-hub's one-position cache writes (`ops.slice_update` of a key or
    value at the row's own index) made as selects over the window. Vmapped over rows, a dynamic update slice is
    a scatter, which XLA's TPU backend makes a loop over the rows, one per layer, key and value: on a v5e that
    loop was most of a 256-row step (gemma_2b, window 160: 36 loops of 256 iterations a token; 39 ms a step
    where the weights' read takes 7.5). The select reads and writes the window once instead."""
    if not on:
        yield
        return
    import keras
    own = keras.ops.slice_update

    def slice_update(inputs, start_indices, updates):
        axis = one_position_axis(inputs, start_indices, updates)
        if axis is None:
            return own(inputs, start_indices, updates)
        return write_one_position(inputs, updates, start_indices[axis], axis)
    keras.ops.slice_update = slice_update
    try:
        yield
    finally:
        keras.ops.slice_update = own


def forward(model, variables, adapters, values, cache, tokens, positions, tables, slots):
    """One token per row, each at its own position and with its own adapter: keras-hub's cached call,
    vmapped over rows so the write index, causal mask and LoRA slot are per row. `cache`: a decode view
    in by_row form, as it returns it."""
    import jax
    select = jax.default_backend() in WRITE_BY_SELECT_ON

    def one_row(row_cache, token, position, slot):
        kv, history = row_cache
        logits, _, kv = with_adapter(adapters, tables, slot, lambda: cached_call(model, token[None, None], kv, position))
        history = write_one_position(history, token, position, 0) if select else history.at[position].set(token)
        return logits[0, 0], (kv, history)
    with local_attention_in_its_window(model), positions_written_by_select(select):
        return run_stateless(variables, values, lambda: jax.vmap(one_row)(cache, tokens, positions, slots))


def sample(logits, positions, temperature, top_k, top_p, seeds, alternatives=None):
    """Per row: the next token (greedy where temperature is 0) and log-probabilities (the token's, and
    the TOP_LOGPROBS most likely with their ids). `alternatives`: how many of those each row wants
    (None: some may). When every row is greedy and wants none, an argmax stands in for the top-k and
    the random draw, which cost more than a small model's step (test model: 40 µs a token for top-k)."""
    import jax
    if alternatives is None:
        return sample_candidates(logits, positions, temperature, top_k, top_p, seeds)
    greedy = ((temperature <= 0) & (alternatives <= 0)).all()
    return jax.lax.cond(greedy, pick_greedy, sample_candidates, logits, positions, temperature, top_k, top_p, seeds)


def pick_greedy(logits, *_):
    """sample_candidates' outputs for rows that are all greedy: the token, its log-probability, and in
    place of the alternatives no one asked for, the token alone."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token_logprob = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
    keep_top = min(TOP_LOGPROBS, CANDIDATES, logits.shape[-1])
    top_logprobs = jnp.full((logits.shape[0], keep_top), -jnp.inf).at[:, 0].set(token_logprob)
    return token, (token_logprob, top_logprobs, jnp.zeros((logits.shape[0], keep_top), jnp.int32).at[:, 0].set(token))


def sample_candidates(logits, positions, temperature, top_k, top_p, seeds):
    """sample() over the CANDIDATES most likely tokens of each row: temperature, top-k, top-p and a
    seeded draw."""
    import jax
    import jax.numpy as jnp
    candidates = min(CANDIDATES, logits.shape[-1])
    logits = logits.astype(jnp.float32)
    # The barrier keeps top_k's outputs from being fused into their users; otherwise XLA's CPU backend
    # lowers top_k to a full sort of the vocabulary, several times the model's own cost.
    top_logits, top_ids = jax.lax.optimization_barrier(jax.lax.top_k(logits, candidates))
    scaled = top_logits / jnp.maximum(temperature, 1e-6)[:, None]
    keep = jnp.arange(candidates)[None, :] < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    # Keyed by (seed, position): a seeded request samples the same tokens whatever it is batched with.
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds, positions)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
    choice = jnp.where(temperature <= 0, 0, choice)
    token = jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    # Log-probabilities of the distribution after temperature (greedy: temperature 1), before top-k/top-p
    # truncation; always computed, so asking for them never compiles anything.
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    top_logprobs_all = top_logits / t - jax.nn.logsumexp(logits / t, axis=-1, keepdims=True)
    token_logprob = jnp.take_along_axis(top_logprobs_all, choice[:, None], axis=-1)[:, 0]
    keep_top = min(TOP_LOGPROBS, candidates)
    return token, (token_logprob, top_logprobs_all[:, :keep_top], top_ids[:, :keep_top])


def adjust_logits(logits, at, history, prompt_lengths, frequency, presence, repetition, min_positions, stop_ids,
                  bias_ids, bias_values):
    """A row's logits for the token after position `at`, adjusted as vLLM's sampler does, in its order:
    `logit_bias` added (bias_ids padded with ids past the vocabulary, which are dropped); the stop ids
    masked while `at` < min_positions (min_tokens); repetition_penalty over every token the row has seen
    (positive logits divided by it, negative ones multiplied); then OpenAI's frequency and presence
    penalties over the tokens it has made: logit - frequency x count - presence x (count > 0). The counts
    come from `history` (the token at each cache position): positions from prompt_lengths up to `at` are
    made, those before are the prompt. Skipped (a cond) when no row asks for any of it."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)

    def adjust(logits):
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, bias_ids].add(bias_values, mode="drop")
        banned = jnp.zeros(logits.shape, bool).at[rows, stop_ids].set(True, mode="drop")
        logits = jnp.where(banned & (at < min_positions)[:, None], -jnp.inf, logits)
        place = jnp.arange(history.shape[1])[None, :]
        # One scatter counts both: a prompt token adds 1, a made one 1 << 16 (a window holds < 65,536).
        weight = jnp.where(place > at[:, None], 0, jnp.where(place >= prompt_lengths[:, None], 1 << 16, 1))
        counts = jnp.zeros(logits.shape, jnp.int32).at[rows, history].add(weight, mode="drop")
        made = (counts >> 16).astype(jnp.float32)
        penalty = repetition[:, None]
        logits = jnp.where(counts > 0, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
        return logits - frequency[:, None] * made - presence[:, None] * (made > 0)
    wanted = adjustments_wanted(at, prompt_lengths, frequency, presence, repetition, min_positions, stop_ids,
                                bias_ids, bias_values)
    return jax.lax.cond(wanted, adjust, lambda logits: logits, logits)


def adjustments_wanted(at, prompt_lengths, frequency, presence, repetition, min_positions, stop_ids, bias_ids,
                       bias_values):
    """Whether any row asks adjust_logits for anything."""
    return ((bias_values != 0).any() | (at < min_positions).any() | (frequency != 0).any() | (presence != 0).any()
            | (repetition != 1).any())


def apply_token_mask(logits, masks):
    """-inf for the tokens a row's grammar forbids: masks is llguidance's [batch, ceil(vocab/32)] int32
    bitmask, bit i of word w allowing token 32w + i (all ones for a free row)."""
    import jax.numpy as jnp
    bits = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(masks.shape[0], -1)[:, :logits.shape[-1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


# The attention kernels XLA's CPU backend transposes for its dots (query [heads, d, head_dim] and output
# [heads, head_dim, d]: heads moved second). It decides those layouts after its loop-invariant code motion,
# which leaves a transpose in the loop as cheap, so a decode loop copied both kernels of every layer on every
# step (Gemma 3 270M: 22.5 MiB a token in int8, 90 in float32); unrolling the chunks did it once per chunk.
LOOP_TRANSPOSED = ("attention/query/kernel", "attention/attention_output/kernel")


def loop_layouts(variables):
    """Each variable's transpose for lay_out_for_loops (None: as it is); on a CPU only, where it was measured."""
    import jax
    cpu = jax.default_backend() == "cpu"
    return [(1, 0, 2) if cpu and v.path.endswith(LOOP_TRANSPOSED) and len(v.shape) == 3 and v.shape[0] > 1 else None
            for v in variables]


def lay_out_for_loops(variables, values, back=False):
    """The values with those kernels transposed as XLA's dots want them, once, before a decode loop; `back`:
    their own shapes again, inside the loop, which XLA then reads as a layout, not a copy. Rolled, a 4-token
    chunk then decodes as fast as unrolled in int8, at a third of the instructions (BENCHMARKS.md)."""
    import jax.numpy as jnp
    return [v if p is None else jnp.transpose(v, np.argsort(p) if back else p)
            for v, p in zip(values, loop_layouts(variables))]


def decode_steps(model, variables, adapters, unroll, values, view, window, offsets, masks, tokens, positions,
                 tables, slots, sampling, laid_out=False):
    """One token per row for each of `offsets` (positions + offset), over a cache `view` of `window`
    positions (by_row) -> (view, last tokens), (tokens, log-probabilities) stacked per step. `laid_out`: `values`
    come through lay_out_for_loops already (a loop around this one did it)."""
    import jax
    import jax.numpy as jnp
    constrained = masks is not None and (masks != -1).any()  # a free row's mask allows everything
    if not laid_out:
        values = lay_out_for_loops(variables, values)

    def step(carry, offset):
        view, tokens = carry
        at = jnp.minimum(positions + offset, window - 1)  # only idle rows get this far
        logits, view = forward(model, variables, adapters, lay_out_for_loops(variables, values, back=True), view,
                               tokens, at, tables, slots)
        adjusting = len(sampling) > len(SAMPLE_ARRAYS)  # a test may call a step with sample()'s arrays alone
        # At the dispatch's first token only: the next mask depends on the token before it. A row's later
        # tokens are drawn free and kept by the host only where the mask could not have changed them.
        masked = masks is not None and constrained & (offset == 0)

        def adjust_mask_sample(logits):
            if adjusting:
                logits = adjust_logits(logits, at, view[1], *sampling[len(SAMPLE_ARRAYS):])
            if masks is not None:  # last: a grammar's mask holds whatever the penalties and biases did
                logits = jax.lax.cond(masked, apply_token_mask, lambda l, _: l, logits, masks)
            return sample(logits, at, *sampling[:len(SAMPLE_ARRAYS)])
        if len(sampling) < len(SAMPLE_ARRAYS):
            tokens, logprobs = adjust_mask_sample(logits)
        else:
            # A batch of greedy rows that adjust nothing, want no alternatives and have no mask to apply (the
            # common case) takes its tokens straight from the logits. Each branch of the steps' separate conds
            # handed the whole [rows, vocabulary] logits on, and on a TPU v5e each cond copied them to and from
            # another layout (gemma_2b at 64 rows: some 0.6 ms a step, by the HLO 1.5 ms at 256 rows).
            temperature, alternatives = (sampling[SAMPLE_ARRAYS.index(name)] for name in ("temperature", "alternatives"))
            plain = ((temperature <= 0) & (alternatives <= 0)).all() & ~jnp.asarray(masked)
            if adjusting:
                plain &= ~adjustments_wanted(at, *sampling[len(SAMPLE_ARRAYS):])
            tokens, logprobs = jax.lax.cond(plain, pick_greedy, adjust_mask_sample, logits)
        return (view, tokens), (tokens, logprobs)
    # `unroll`: XLA lays out the weights and the cache for its dots after it has looked for loop-invariant
    # code. In a loop on a CPU it transposed the query/output kernels on every step (until lay_out_for_loops)
    # and copied each cache leaf twice (until by_row); unrolled, it did each once per chunk, for four times
    # the instructions and twice the compile time. With both, a CPU decodes as fast in loops (Engine).
    return jax.lax.scan(step, (view, tokens), offsets, unroll=unroll)


def by_row(view):
    """A decode view with each row's cache as keras-hub's call takes it, a batch of one (an axis after the
    rows), as the decode loops carry it. Reshaped at every step instead, a loop copied each cache leaf twice
    a token on XLA's CPU backend: the carry and the row's update got layouts that differ in where the axes
    of one lie, and the update was not made in place (Gemma 3 270M float32, 36 leaves, BENCHMARKS.md)."""
    import jax
    kv, history = view
    return jax.tree.map(lambda c: c[:, None], kv), history


def from_rows(view):
    """by_row undone."""
    import jax
    kv, history = view
    return jax.tree.map(lambda c: c[:, 0], kv), history


def window_view(axes, cache, window):
    import jax
    return jax.tree.map(lambda c, axis: jax.lax.slice_in_dim(c, 0, window, axis=axis), cache, axes)


def write_view(axes, cache, view):
    import jax
    return jax.tree.map(lambda c, v, axis: jax.lax.dynamic_update_slice_in_dim(c, v, 0, axis=axis), cache, view, axes)


def decode_chunk(model, variables, adapters, axes, unroll, values, cache, window, steps, masks, tokens, positions,
                 tables, slots, *sampling):
    """`steps` tokens per dispatch (the host pays its per-call cost once every few tokens), attending over
    only the first `window` positions: attention and cache traffic grow with the window, and no row in
    the batch has got further than it yet. Grammar `masks` (all ones for a free row) hold for the
    chunk's first token, before top-k, temperature and top-p, so its draw and log-probabilities are the
    masked distribution's; DecodeBatch.settle keeps a later token only when that mask's draw would have
    been the same token (RowGrammars.keeps_free_draw)."""
    import jax.numpy as jnp
    (view, _), outputs = decode_steps(model, variables, adapters, unroll, values,
                                      by_row(window_view(axes, cache, window)), window, jnp.arange(steps), masks,
                                      tokens, positions, tables, slots, sampling)
    return outputs, write_view(axes, cache, from_rows(view))


def decode_until_done(model, variables, adapters, axes, unroll, values, cache, window, steps, masks, tokens, positions,
                      remaining, stop_ids, limit, tables, slots, *sampling):
    """Up to `limit` tokens (at most `steps`, the size of the outputs) in one dispatch, a token at a time,
    stopping after the token with which the last row ended: sampled one of `stop_ids`, or made its
    `remaining` tokens (0 for a free row). The Engine runs it when no request waits for a row, so a lone
    request pays the per-dispatch cost (the host's, and the weight-layout copies XLA makes once per run of
    a program) once every `limit` tokens instead of every DECODE_CHUNK (Gemma 3 270M float32 on 2 CPU
    cores, batch 1, 16 tokens: 18.7 -> 21.0 tokens/s). `limit` is an input, so the host can size it to the
    model's speed without compiling anything (Engine.long_limit); at a `limit` of 1 or DECODE_CHUNK it
    makes what decode_chunk does, grammar `masks` on the first token included, so the batch that has it
    needs no decode_chunk at all (Engine.long_makes_chunks). `unroll` is there for decode_chunk's
    signature: the one step an iteration makes is traced unrolled (a scan of one step is a loop in the
    loop, which copies the cache at its edges: 10-16% slower).
    -> ((tokens, log-probabilities) per step, the number of steps made), cache."""
    import jax
    import jax.numpy as jnp
    view = by_row(window_view(axes, cache, window))
    values = lay_out_for_loops(variables, values)
    shapes = jax.eval_shape(lambda: decode_steps(model, variables, adapters, True, values, view, window,
                                                 jnp.arange(1), masks, tokens, positions, tables, slots,
                                                 sampling, laid_out=True)[1])
    outputs = jax.tree.map(lambda s: jnp.zeros((steps,) + s.shape[1:], s.dtype), shapes)
    alive = remaining > 0

    def more(carry):
        _, _, made, alive, _ = carry
        return (made < jnp.minimum(limit, steps)) & alive.any()

    def token(carry):
        view, tokens, made, alive, outputs = carry
        (view, tokens), out = decode_steps(model, variables, adapters, True, values, view, window,
                                           made + jnp.arange(1), masks, tokens, positions, tables, slots,
                                           sampling, laid_out=True)
        outputs = jax.tree.map(lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part, made, axis=0),
                               outputs, out)
        stopped = (out[0][:, :, None] == stop_ids[None, None, :]).any(axis=(0, 2))
        alive &= ~stopped & (remaining > made + 1)
        return view, tokens, made + 1, alive, outputs
    view, _, made, _, outputs = jax.lax.while_loop(more, token, (view, tokens, jnp.int32(0), alive, outputs))
    return (outputs, made), write_view(axes, cache, from_rows(view))


def next_tokens(sampled, stale, tokens):
    """The input tokens of a chunk dispatched before the one ahead of it is read: a row's last token
    sampled there, or (not `stale`) the host's, the last prompt token of a row admitted since."""
    import jax.numpy as jnp
    return jnp.where(stale, sampled[-1], tokens)


def gather_blocks(axes, pool, block_ids):
    """A one-row cache of len(block_ids) x block positions, block k taken from pool block block_ids[k]."""
    import jax
    import jax.numpy as jnp

    def gather(leaf, axis):
        blocks = jnp.moveaxis(leaf[block_ids], 0, axis - 1)  # [..., n blocks, block tokens, ...]
        return blocks.reshape(blocks.shape[:axis - 1] + (-1,) + blocks.shape[axis + 1:])[None]
    return jax.tree.map(gather, pool, axes)


def store_blocks(axes, pool, row_cache, sources, targets):
    """Copies block sources[k] of a one-row cache into pool block targets[k], for every k (pairs that
    should do nothing target the pool's scratch block)."""
    import jax
    import jax.numpy as jnp

    def store(leaf, row, axis):
        size = leaf.shape[axis]
        row = row[0].reshape(row.shape[1:axis] + (row.shape[axis] // size, size) + row.shape[axis + 1:])
        return jnp.asarray(leaf).at[targets].set(jnp.moveaxis(row, axis - 1, 0)[sources])
    return jax.tree.map(store, pool, row_cache, axes)


class PrefixCache:
    """Which prompt prefixes the engine's device pool holds: --prefix-cache-blocks blocks of
    --prefix-block-tokens positions of KV each (plus a scratch block). A block's key hashes every token
    before and in it, and the adapter of the row that computed it (an adapter changes K and V), so one
    key is one exact KV. Only full blocks are kept; least recently used blocks that no running
    generation holds are evicted first. The worker thread alone calls it."""

    def __init__(self, blocks, block_tokens):
        self.blocks, self.block_tokens, self.scratch = blocks, block_tokens, blocks
        self.by_key = collections.OrderedDict()  # key -> block, least recently used first
        self.free = list(range(blocks - 1, -1, -1))
        self.holders = [0] * blocks  # running generations that hold each block

    def keys(self, ids, adapter):
        """The key chain of the full blocks of `ids`."""
        digest, keys, size = hashlib.sha256(b"adapter %d" % adapter).digest(), [], self.block_tokens
        for start in range(0, len(ids) - size + 1, size):
            digest = hashlib.sha256(digest + array.array("i", ids[start:start + size]).tobytes()).digest()
            keys.append(digest)
        return keys

    def match(self, keys):
        """The blocks of the longest cached prefix of the chain `keys`, now the most recently used."""
        found = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            self.by_key.move_to_end(key)
            found.append(block)
        return found

    def allocate(self, keys):
        """[(index in keys, block)] to write for the keys not cached yet, evicting the least recently used
        blocks nobody holds; fewer (or none) when every block is held. The blocks come back held, so one
        call never hands out a block twice (a pool write with a repeated block would be undefined)."""
        out = []
        for index, key in enumerate(keys):
            if key in self.by_key:
                self.by_key.move_to_end(key)
                continue
            block = self.free.pop() if self.free else self.evict()
            if block is None:
                break
            self.by_key[key] = block
            self.holders[block] += 1
            out.append((index, block))
        return out

    def forget(self, blocks):
        """Drops the keys of `blocks` (their KV was never written); the blocks stay held until released."""
        blocks = set(blocks)
        for key in [key for key, block in self.by_key.items() if block in blocks]:
            del self.by_key[key]
        self.free.extend(sorted(blocks, reverse=True))

    def evict(self):
        for key, block in self.by_key.items():
            if not self.holders[block]:
                del self.by_key[key]
                return block
        return None

    def hold(self, blocks):
        for block in blocks:
            self.holders[block] += 1

    def release(self, blocks):
        for block in blocks:
            self.holders[block] -= 1

    def used(self):
        return len(self.by_key)


class PrefixPool(PrefixCache):
    """The prefix cache with its blocks' KV on the device: the pool (a one-row cache's leaves cut into
    blocks, plus the scratch block) and the programs that copy a prefix out of it and a prompt's new
    blocks into it, for an Engine's prefills."""

    def __init__(self, engine, blocks, block_tokens, rows):
        import jax
        super().__init__(blocks, block_tokens)
        self.engine = engine
        self.pool = self.empty()
        self.pool_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(self.pool)) * blocks // (blocks + 1)
        self.gather_program = Program(functools.partial(gather_blocks, engine.axes), out_shardings=rows)
        self.store_program = Program(functools.partial(store_blocks, engine.axes), donate_argnums=(0,))

    def empty(self):
        import jax
        blocks, size = self.blocks, self.block_tokens
        return self.engine.put(jax.tree.map(
            lambda s, axis: np.zeros((blocks + 1,) + s.shape[1:axis] + (size,) + s.shape[axis + 1:], s.dtype),
            cache_shapes(self.engine.model, 1, 8), self.engine.axes), replicated=True)

    def keys_of(self, generation):
        return self.keys(generation.prompt_ids, 0 if generation.adapter is None else generation.adapter.uid)

    def reuse(self, generation, keys):
        """The pool blocks of the prompt's longest cached prefix, held until the generation ends, and the
        number of positions they cover."""
        ids, engine = generation.prompt_ids, self.engine
        reused = self.match(keys[:(len(ids) - 1) // self.block_tokens])  # the last token is always computed
        # The rest is prefilled in a block after the prefix, and both must fit the cache: near the end of it,
        # reuse fewer blocks (the block for the rest shrinks with it).
        while reused and len(reused) * self.block_tokens + engine.block_for(
                len(ids) - len(reused) * self.block_tokens) > engine.max_length:
            reused.pop()
        self.hold(reused)  # before this prompt's own blocks are allocated, which may evict
        generation.releases.append(functools.partial(self.release, reused))
        return reused, len(reused) * self.block_tokens

    def gather(self, reused, window):
        """A one-row cache of `window` positions starting with the `reused` blocks."""
        TIMELINE.dispatched("pool_gather")
        return self.gather_program(self.pool, np.array(
            reused + [self.scratch] * (window // self.block_tokens - len(reused)), np.int32))

    def store(self, generation, keys, start, row):
        """Writes the prompt's new full blocks (those after the first `start` positions) into the pool, held
        until the generation ends."""
        first = start // self.block_tokens
        written = [(first + index, block) for index, block in self.allocate(keys[first:])]
        generation.releases.append(functools.partial(self.release, [block for _, block in written]))
        if written:
            size = cache_length(row, self.engine.axes) // self.block_tokens
            sources = np.zeros(size, np.int32)
            targets = np.full(size, self.scratch, np.int32)
            sources[:len(written)], targets[:len(written)] = zip(*written)
            try:
                self.pool = self.store_program(self.pool, row, sources, targets)
                TIMELINE.dispatched("pool_store")
            except BaseException:
                # The store donates the pool: whatever failed, its buffer may be gone. A fresh pool, and no
                # key left to match a block that is not in it.
                self.forget(list(self.by_key.values()))
                self.pool = self.empty()
                raise


# A chunk dispatched and not read yet (DecodeBatch.pending): the tokens and log-probabilities on the device, the
# [(row, generation)] it decodes for, each row's position at its start, its steps; the grammar rows whose first
# token it draws without their mask, and the rows whose tokens in it are void (DecodeBatch.rewind).
Chunk = collections.namedtuple("Chunk", "sampled logprobs busy start steps unmasked voided")

# One batch size's compiled programs (see Engine.batch_programs); resize: {size: program} for its neighbours.
BatchPrograms = collections.namedtuple("BatchPrograms", "new_cache insert decode decode_long next_tokens resize")


class Engine:
    """Owns the model and its compiled programs. Every row of a decode batch keeps its own position,
    so a request takes a free row as soon as one opens (continuous batching), starts right after its
    own prompt, and never waits for its neighbours' prompts or max_tokens. With a prefix-cache pool, a
    prompt's longest cached prefix is copied into its row and only the rest is prefilled."""

    def __init__(self, model, batch_buckets, length_buckets, distribution, tokenizer=None, adapters=None,
                 prefix_blocks=0, block_tokens=16, dispatch_ahead=None):
        import jax
        self.model = model
        # Dispatching a chunk before reading the one ahead of it overlaps the host's work with the device's.
        # A CPU backend computes on the host's own cores, so there is nothing to overlap (bench_generate:
        # 760 ms both ways on the mixed load, the host busy 5% of the time), only a cost: a row freed by a
        # stop token is refilled a chunk later, and after the last one a chunk runs for nothing.
        self.dispatch_ahead = jax.default_backend() != "cpu" if dispatch_ahead is None else dispatch_ahead
        self.long_chunk_seconds = LONG_CHUNK_SECONDS
        self.token_seconds = None  # a token's time in the last long dispatch (None: none made yet)
        if jax.default_backend() == "cpu" and batch_buckets[0] == 1 and any(
                getattr(layer.dtype_policy, "quantization_mode", None) for layer in model.backbone._flatten_layers()):
            # XLA's CPU backend runs an int8 matrix-vector product several times slower than the same
            # product over two rows (640x8192: 3.1 ms against 0.44 ms), so one request decodes in two rows.
            batch_buckets = sorted({max(b, 2) for b in batch_buckets})
        # Every batch's cache holds the longest request; each decode step attends over the smallest of
        # the length buckets that holds every row's position.
        self.batch_buckets, self.length_buckets = batch_buckets, length_buckets
        self.max_length = length_buckets[-1]
        # Prompts are prefilled in the smallest of these blocks that holds them: prefill cost grows with the block.
        self.prompt_blocks = sorted({16 << i for i in range(16) if 16 << i < length_buckets[-1]} | set(length_buckets))
        self.distribution = distribution
        self.adapters = adapters  # AdapterSlots, or None: no LoRA is traced at all
        tokenizer = tokenizer or model.preprocessor.tokenizer
        self.encode, self.decode = make_text_codec(tokenizer)
        self.vocabulary_size = model.backbone.vocabulary_size
        self.pieces = pieces_of(tokenizer)
        if self.vocabulary_size > len(self.pieces):
            # Embedding rows past the tokenizer's pieces (a vocabulary padded to a round size) have no text:
            # they read as empty, as the grammar's token table already has them.
            decode, known = self.decode, len(self.pieces)
            self.decode = lambda ids: decode([i for i in ids if i < known])
        self.bos, self.pad = tokenizer.start_token_id, tokenizer.pad_token_id or 0
        self.stop_ids = {tokenizer.end_token_id}
        if "<end_of_turn>" in self.pieces:
            self.stop_ids.add(tokenizer.token_to_id("<end_of_turn>"))
        self.variables = model.variables
        self.values = [v.value for v in self.variables]
        self.top_logprobs = min(TOP_LOGPROBS, CANDIDATES, model.backbone.vocabulary_size)
        self.mask_words = -(-self.vocabulary_size // 32)  # a grammar mask's int32 words per row
        self.open_mask_arrays = {}
        self.axes = cache_position_axes(model)
        # Unrolled decode chunks (see decode_steps) pay on a TPU at batch 64 (gemma_2b bfloat16: 3,975 -> 4,511
        # tok/s) but not at batch 1, already at its weight-read limit either way (139 -> 140 tok/s), where they
        # cost 24 s more compiling (batch 1's warm-up 43 -> 67 s). On a CPU the loops decode as fast, once they
        # take the kernels laid out (lay_out_for_loops) and the cache by_row (Gemma 3 270M, 4-token chunks,
        # unrolled -> looped: float32 batch 2 window 512 23.8 -> 25.4 tok/s, batch 8 window 256 64.1 -> 66.0;
        # int8 window 512 36.2 -> 40.8 before by_row), for a third of the instructions: BENCHMARKS.md.
        cpu = jax.default_backend() == "cpu"
        large = sum(value.nbytes for value in self.values) >= UNROLL_FROM_BYTES
        self.unrolled = set() if cpu else {batch for batch in batch_buckets
                                           if large and batch >= UNROLL_FROM_BATCH_OFF_CPU}
        bound = functools.partial
        # On a mesh every program that makes a one-row cache hands it back copied to every device: the
        # programs it goes into (insert, a pool write, a prefill after a prefix) were compiled for one
        # layout, whichever program made it (a lone prefill, a group's, the pool's gather).
        rows = None if distribution is None else jax.sharding.NamedSharding(
            distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec())
        # A lone prompt is prefilled into a row of a window's positions, after its cached prefix or from an
        # empty row: one program per (block, window) serves both (a prefill of its own block's positions, one
        # per block, was the model's graph once more for each: Gemma 3 270M int8, 14,000 HLO instructions and
        # some 45 MiB of RSS apiece on a CPU), and at most a window's rows to insert and store.
        self._prefill = Program(bound(prefill_after_prefix, model, self.variables, adapters), out_shardings=rows)
        self._empty_row = Program(bound(empty_row, model), static_argnums=(0,), out_shardings=rows)
        self._prefill_group = Program(bound(prefill_group, model, self.variables, adapters), out_shardings=rows)
        self.group_sizes = [g for g in PREFILL_GROUPS if g <= batch_buckets[-1]]
        # The largest block each group size is formed in (group_blocks).
        self.group_limits = (dict(GROUP_BLOCKS_CPU) if jax.default_backend() == "cpu"
                             else {size: min(GROUP_BLOCK, GROUP_TOKENS // size) for size in PREFILL_GROUPS})
        # What requests may use: WarmUp narrows these while it compiles and widens them part by part.
        # `chunked`: the smallest batch's multi-token decodes exist (until then it decodes a token a step).
        self.ready_batches, self.grouping, self.chunked = list(batch_buckets), bool(self.group_sizes), True
        # A lone request decodes in the smallest batch, where the per-dispatch cost weighs most: on a CPU that
        # batch size gets decode_until_done's long chunks, which make its DECODE_CHUNKs too (one program per
        # window for both: Engine.long_makes_chunks). Off a CPU, dispatching ahead already hides that cost:
        # gemma_2b on a TPU v5e decoded 140 tok/s with them and 143 without at batch 1 (998 and 1,016 at batch 8),
        # and they cost 17-18 s of its warm-up.
        long = jax.default_backend() == "cpu"
        self.programs = {batch: self.batch_programs(batch, long=long and batch == batch_buckets[0])
                         for batch in batch_buckets}
        if prefix_blocks and any(length % block_tokens for length in length_buckets):
            raise LoadError(f"--prefix-block-tokens {block_tokens} must divide every --length-buckets length")
        self.prefix = PrefixPool(self, prefix_blocks, block_tokens, rows) if prefix_blocks else None
        self.prefills = Prefills(self)

    def cache_layout(self, batch):
        """(abstract shapes, device layout or None) of a batch's cache."""
        import jax
        shapes = cache_shapes(self.model, batch, self.max_length)
        return shapes, None if self.distribution is None else jax.tree.map(
            lambda s: self.distribution.get_data_layout(s.shape).backend_layout, shapes)

    def batch_programs(self, batch, long):
        """(new cache, insert, decode, decode until done or None, next tokens, resizes) for one batch size.
        The cache's layout (and next_tokens' split over the batch) is pinned so that what one program hands
        back is exactly what the next was compiled for."""
        import jax
        shapes, layout = self.cache_layout(batch)
        at = self.batch_buckets.index(batch)
        new_cache = Program(functools.partial(zeros_of, shapes), out_shardings=layout)

        rows = None if self.distribution is None else self.distribution.get_data_layout((batch,)).backend_layout
        # A chunk's tokens [steps, batch] split as the rows are: next_tokens reads them, and the warm-up
        # compiles it ahead from this layout (left to XLA, it is only known once the decode step is compiled).
        tokens = None if rows is None else jax.sharding.NamedSharding(rows.mesh, jax.sharding.PartitionSpec(
            None, *rows.spec))

        def decoder(fn, sampled=None):  # (values, cache, window, steps, ...) -> (outputs, cache), the cache donated
            return Program(functools.partial(fn, self.model, self.variables, self.adapters, self.axes,
                                             batch in self.unrolled),
                           static_argnums=(2, 3), donate_argnums=(1,), out_shardings=((sampled, None), layout))
        return BatchPrograms(
            new_cache, Program(functools.partial(insert, self.axes, by_select=self.distribution is not None),
                               donate_argnums=(0,), out_shardings=layout),
            decoder(decode_chunk, tokens), decoder(decode_until_done) if long else None,
            Program(next_tokens, out_shardings=rows),
            # Copies of chosen rows into a batch of the next smaller or larger size, in that size's layout.
            {size: Program(resize_cache, out_shardings=self.cache_layout(size)[1])
             for size in self.batch_buckets[max(at - 1, 0):at] + self.batch_buckets[at + 1:at + 2]})

    def long_makes_chunks(self, batch):
        """Whether a batch size's single tokens and chunks of DECODE_CHUNK tokens are made by its long decode,
        stopped after as many (DecodeBatch.step), and need no program of their own: where it has one and
        chunks are not dispatched ahead (a CPU), which reads the last token of decode_chunk's output on the
        device. Two programs fewer per window to compile and hold (Gemma 3 270M int8 on a CPU, the one-token
        decode: 18,600 HLO instructions)."""
        return self.programs[batch].decode_long is not None and not self.dispatch_ahead

    def open_masks(self, batch):
        """Grammar masks that allow every token, put on the device once per batch size: what a chunk
        without a grammar row takes."""
        if batch not in self.open_mask_arrays:
            self.open_mask_arrays[batch] = self.put(np.full((batch, self.mask_words), -1, np.int32))
        return self.open_mask_arrays[batch]

    def long_limit(self):
        """How many tokens a long dispatch may make: as many as fit in long_chunk_seconds at the last long
        dispatch's speed, in whole DECODE_CHUNKs, from LONG_CHUNK to LONGEST_CHUNK. A request that arrives
        meanwhile waits for that dispatch: no longer than the larger of that time and LONG_CHUNK tokens,
        while a fast model (a small one, or on a GPU) pays its per-dispatch cost less often."""
        if not self.token_seconds:
            return LONG_CHUNK
        fits = int(self.long_chunk_seconds / self.token_seconds) // DECODE_CHUNK * DECODE_CHUNK
        return min(max(fits, LONG_CHUNK), LONGEST_CHUNK)

    @property
    def lora_tables(self):
        return {} if self.adapters is None else self.adapters.tables

    def put(self, array, replicated=False):
        """Onto the device(s), split along the batch axis when data-parallel (or copied to all)."""
        import jax
        if self.distribution is None:
            return jax.device_put(array)
        if replicated:
            mesh = self.distribution.device_mesh.backend_mesh
            return jax.device_put(array, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        return jax.device_put(array, self.distribution.get_data_layout(array.shape).backend_layout)

    def feed(self, array, replicated=False):
        """A small host array a step takes (tokens, positions, sampling settings). On one device a numpy
        copy goes to the jitted call as it is: the call takes it in C++ in about a microsecond, where
        `device_put` costs 30-200 µs, some 20 times per request. Always a copy, so that the host may change its own
        array while the step it was dispatched to still waits to run: on a CPU mesh `device_put` may read a
        numpy array's memory after it returns (before this copy, 2 runs in 5 of a 2x2-mesh test decoded
        4 of its 8 requests from tokens and positions the host had already moved on)."""
        array = np.array(array)
        return array if self.distribution is None else self.put(array, replicated)

    def block_for(self, prompt_length):
        return next(b for b in self.prompt_blocks if b >= prompt_length)

    def batch_for(self, n_rows):
        """The smallest batch size whose programs are compiled that holds n_rows, or the largest such."""
        return next((b for b in self.ready_batches if b >= n_rows), self.ready_batches[-1])

    def window_for(self, length):
        return next((l for l in self.length_buckets if l >= length), self.max_length)

    def tokens(self, prompts, length):
        """Each of `prompts` (token id lists) padded to `length`, as a [len(prompts), length] array for a
        prefill."""
        tokens = np.full((len(prompts), length), self.pad, np.int32)
        for row, ids in enumerate(prompts):
            tokens[row, :len(ids)] = ids
        return self.feed(tokens, replicated=True)

    @property
    def row_lengths(self):
        """The lengths of the one-row caches prefills make, which batches insert and the pool stores: a
        window's (a lone prompt's) and a block's of group_blocks (a group's)."""
        return sorted(set(self.length_buckets) | set(self.group_blocks))

    def group_sizes_for(self, block):
        return [size for size in self.group_sizes if block <= self.group_limits.get(size, 0)]

    @property
    def group_blocks(self):
        """Each prompt block that has groups, and their sizes."""
        return {block: sizes for block in self.prompt_blocks if (sizes := self.group_sizes_for(block))}

    def warm_up(self):
        """Compiles every program once, so requests never compile (see WarmUp); returns the WarmUp, which
        keeps each program's compile time."""
        warm_up = WarmUp(self)
        warm_up.run()
        return warm_up

    def generate(self, rows, batch):
        """Decodes `rows` (Generation objects) in a batch of `batch` rows (or the smallest compiled size
        above), each taking a row as one frees; returns the batch."""
        decoding = DecodeBatch(self, self.batch_for(batch))
        waiting = list(rows)
        while waiting or decoding.active:
            taken, waiting = waiting[:decoding.free_rows], waiting[decoding.free_rows:]
            decoding.admit_all(taken)
            decoding.step(quiet=not waiting)
        return decoding


class Prefills:
    """How an Engine turns prompts into cache rows: a prompt's longest cached prefix copied from the
    prefix-cache pool and the rest computed after it in its window's row, or all of it computed in an empty
    row; prompts that arrive together and fit a group's block, computed in one dispatch. Each prompt's new
    full blocks go into the pool, held (with the ones it reused) until its generation ends."""

    def __init__(self, engine):
        self.engine = engine

    def keys(self, generation):
        """The prefix-cache key chain of a generation's prompt ([] without a prefix cache)."""
        prefix = self.engine.prefix
        return [] if prefix is None else prefix.keys_of(generation)

    def match(self, generation, keys):
        """PrefixPool.reuse: ([], 0) without a prefix cache."""
        prefix = self.engine.prefix
        return ([], 0) if prefix is None else prefix.reuse(generation, keys)

    def compute(self, generation, reused, start):
        """The cache row of a prompt, of the window that holds its block: the `reused` pool blocks copied and
        the rest computed after them, or all of it computed in an empty row."""
        engine, ids = self.engine, generation.prompt_ids
        suffix = engine.block_for(len(ids) - start)
        window = engine.window_for(start + suffix)
        row = engine.prefix.gather(reused, window) if start else engine._empty_row(window)
        row = engine._prefill(engine.values, row, engine.tokens([ids[start:]], suffix), np.int32(start),
                              engine.lora_tables, np.int32(generation.slot))
        TIMELINE.dispatched("prefill", row)
        return row

    def store(self, generation, keys, start, row):
        if self.engine.prefix is not None:
            self.engine.prefix.store(generation, keys, start, row)

    def row(self, generation, keys=None):
        """The cache row of one prompt and the number of its tokens that were cached. `keys`: its keys(),
        when already known."""
        keys = self.keys(generation) if keys is None else keys
        reused, start = self.match(generation, keys)
        row = self.compute(generation, reused, start)
        self.store(generation, keys, start, row)
        return row, start

    def rows(self, generations):
        """row() for each of `generations`, which arrived together. Prompts that reuse no cached prefix and
        fit one of the engine's group_blocks (up to GROUP_BLOCK tokens; on a CPU GROUP_BLOCKS_CPU) are
        prefilled in groups of one block length (prefill_group), the largest of the block's group sizes that
        fits first. A prompt that shares its first block with an earlier one of these waits until that one is
        in the pool, and reuses it."""
        engine = self.engine
        done, groups, after, firsts = {}, collections.defaultdict(list), [], set()
        twins, copies = {}, []  # the n answers to one prompt: one prefill, its row copied into each
        for generation in generations:
            twin = twins.setdefault((tuple(generation.prompt_ids), generation.slot), generation)
            if twin is not generation:
                copies.append((generation, twin))
                continue
            keys = self.keys(generation)
            if keys and keys[0] in firsts:
                after.append((generation, keys))
                continue
            firsts.update(keys[:1])
            reused, start = self.match(generation, keys)
            block = engine.block_for(len(generation.prompt_ids))
            if not start and engine.grouping and block in engine.group_blocks:
                groups[block].append((generation, keys))
                continue
            row = self.compute(generation, reused, start)
            self.store(generation, keys, start, row)
            done[id(generation)] = row, start
        for block, waiting in groups.items():
            while waiting:
                size = max((s for s in engine.group_sizes_for(block) if s <= len(waiting)), default=1)
                group, waiting = waiting[:size], waiting[size:]
                if size == 1:
                    rows = [self.compute(group[0][0], [], 0)]
                else:
                    slots = engine.feed(np.array([g.slot for g, _ in group], np.int32), replicated=True)
                    rows = engine._prefill_group(engine.values, engine.tokens([g.prompt_ids for g, _ in group], block),
                                                 engine.lora_tables, slots)
                    TIMELINE.dispatched("prefill_group", rows)
                    METRICS.add("prefill_groups")
                    METRICS.add("grouped_prompts", size)
                for (generation, keys), row in zip(group, rows):
                    self.store(generation, keys, 0, row)
                    done[id(generation)] = row, 0
        for generation, keys in after:  # the blocks of the prompts above are in the pool now
            done[id(generation)] = self.row(generation, keys)
        for generation, twin in copies:
            done[id(generation)] = done[id(twin)]
        return [done[id(generation)] for generation in generations]


def resize_cache(cache, index):
    """A cache whose row i is row index[i] of `cache`: a batch grown or shrunk in place."""
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda c: jnp.take(c, index, axis=0), cache)


def cache_length(cache, axes):
    """The number of positions a cache holds."""
    import jax
    leaf, axis = jax.tree.leaves(cache)[0], jax.tree.leaves(axes)[0]
    return leaf.shape[axis]


# ----------------------------------------------------------------------------- warm-up

# An argument that is another program's output (`pick`: which part of it), for WarmUp.submit.
Output = collections.namedtuple("Output", "program args pick", defaults=(lambda out: out,))

class WarmUpCalls:
    """What a WarmUp compiles, as (name, Program, arguments) calls: each program with the very arguments its
    caller passes (abstract where lowering reads no values), and per part of the warm-up the calls it needs."""

    def __init__(self, engine, prefix):
        self.engine, self.prefix = engine, prefix  # the prefix pool, held back from the Engine meanwhile
        # One arguments object per row length, (block, window), (batch, window, steps) and batch size, and per
        # (program, arguments) one lowering, however often used.
        self.rows, self.prefills, self.decodes, self.caches = {}, {}, {}, {}

    def prefill_calls(self):
        """(name, jitted program, arguments) of what a lone prompt with no cached prefix needs: per window an
        empty row, per block its prefill in the window that holds it."""
        engine = self.engine
        return ([(f"empty row window {window}", *self.row(window)[:2]) for window in engine.length_buckets]
                + [self.prefill_call(block, engine.window_for(block)) for block in engine.prompt_blocks])

    def row(self, length):
        """An Output that stands for a one-row cache of `length` positions, as every prefill hands one over."""
        if length not in self.rows:
            self.rows[length] = Output(self.engine._empty_row, (length,))
        return self.rows[length]

    def prefill_call(self, block, window):
        """A lone prompt's prefill of `block` tokens in a row of `window` positions: from an empty row or after
        a cached prefix, one program."""
        engine = self.engine
        if (block, window) not in self.prefills:
            self.prefills[block, window] = Output(engine._prefill, (
                engine.values, self.row(window), engine.tokens([[engine.bos]], block), np.int32(0),
                engine.lora_tables, np.int32(0)))
        return (f"prefill block {block} in window {window}", *self.prefills[block, window][:2])

    def decode_args(self, batch, window, steps):
        """A decode program's arguments as its DecodeBatch passes them (the cache as an abstract shape and
        layout: lowering reads no values), one object per (batch, window, steps)."""
        if (batch, window, steps) not in self.decodes:
            engine, int32 = self.engine, np.int32
            feed = lambda dtype: engine.feed(np.zeros(batch, dtype))  # noqa: E731
            sampling = [feed(int32)] + [engine.feed(array) for array in RowSampling(batch).arrays()]  # slots first
            cache = self.batch_cache(batch)
            if steps == LONGEST_CHUNK:
                inputs = (engine.open_masks(batch), feed(int32), feed(int32), feed(int32),
                          engine.feed(np.full(8, -1, int32), replicated=True),
                          engine.feed(int32(LONG_CHUNK), replicated=True))
            else:
                inputs = (engine.open_masks(batch), feed(int32), feed(int32))
            self.decodes[batch, window, steps] = (engine.values, cache, window, steps, *inputs, engine.lora_tables,
                                                  *sampling)
        return self.decodes[batch, window, steps]

    def batch_cache(self, batch):
        """A batch's cache as an abstract shape and layout, traced once per batch size (cache_layout runs
        the model's prefill abstractly: on the start-up path, not to be repeated per program)."""
        if batch not in self.caches:
            self.caches[batch] = abstract(*self.engine.cache_layout(batch))
        return self.caches[batch]

    def chunk_calls(self, batch):
        """A batch size's multi-token decodes: DECODE_CHUNK tokens (and on a CPU, in the smallest batch, up
        to LONGEST_CHUNK) a dispatch, over each window, and with dispatch-ahead the next chunk's input tokens."""
        engine, programs = self.engine, self.engine.programs[batch]
        if engine.long_makes_chunks(batch):
            return []  # the long decodes, compiled with the one-token ones (token_calls), make every chunk
        calls = [(f"decode batch {batch} window {window} chunk {DECODE_CHUNK}", programs.decode,
                  self.decode_args(batch, window, DECODE_CHUNK)) for window in engine.length_buckets]
        if programs.decode_long is not None:
            calls += self.long_calls(batch)
        if engine.dispatch_ahead:  # a chunk's input tokens, from the chunk before it still on the device
            sampled = Output(programs.decode, self.decode_args(batch, engine.length_buckets[0], DECODE_CHUNK),
                             lambda out: out[0][0])
            calls.append((f"next tokens batch {batch}", programs.next_tokens,
                          (sampled, engine.feed(np.zeros(batch, bool)), engine.feed(np.zeros(batch, np.int32)))))
        return calls

    def long_calls(self, batch):
        return [(f"decode batch {batch} window {window} long", self.engine.programs[batch].decode_long,
                 self.decode_args(batch, window, LONGEST_CHUNK)) for window in self.engine.length_buckets]

    def token_calls(self, batch):
        """What decodes a token a step, over each window: the one-token decode, or the long decode that makes
        one token as well (Engine.long_makes_chunks)."""
        engine = self.engine
        if engine.long_makes_chunks(batch):
            return self.long_calls(batch)
        return [(f"decode batch {batch} window {window} chunk 1", engine.programs[batch].decode,
                 self.decode_args(batch, window, 1)) for window in engine.length_buckets]

    def batch_calls(self, batch, chunks=True):
        """The programs of one batch size (with `chunks`, its multi-token decodes too) and the copies
        between it and the next smaller size, both ways."""
        engine, int32 = self.engine, np.int32
        programs, cache = engine.programs[batch], self.batch_cache(batch)
        calls = [(f"new cache batch {batch}", programs.new_cache, ())] + self.token_calls(batch)
        calls += self.chunk_calls(batch) if chunks else []
        for length in engine.row_lengths:
            calls.append((f"insert batch {batch} row of {length}", programs.insert, (cache, self.row(length), int32(0))))
        at = engine.batch_buckets.index(batch)
        if at:
            smaller = engine.batch_buckets[at - 1]
            calls += [(f"resize batch {batch} to {smaller}", programs.resize[smaller], (cache, np.zeros(smaller, int32))),
                      (f"resize batch {smaller} to {batch}", engine.programs[smaller].resize[batch],
                       (self.batch_cache(smaller), np.zeros(batch, int32)))]
        return calls

    def group_calls(self):
        engine = self.engine
        return [(f"prefill {size} prompts block {block}", engine._prefill_group,
                 (engine.values, engine.tokens([[engine.bos]] * size, block), engine.lora_tables,
                  engine.feed(np.zeros(size, np.int32), replicated=True)))
                for block, sizes in engine.group_blocks.items() for size in sizes]

    def prefix_calls(self):
        """Per row length a pool write; per window a gather, and a prefill after each prefix length that fits
        (those of the blocks it holds are compiled already, for prompts with no cached prefix)."""
        engine, prefix, calls, int32 = self.engine, self.prefix, [], np.int32
        size, scratch = prefix.block_tokens, prefix.scratch
        for length in engine.row_lengths:
            calls.append((f"pool store row of {length}", prefix.store_program,
                          (prefix.pool, self.row(length), np.zeros(length // size, int32),
                           np.full(length // size, scratch, int32))))
        for window in engine.length_buckets:
            calls.append((f"pool gather window {window}", prefix.gather_program,
                          (prefix.pool, np.full(window // size, scratch, int32))))
            calls += [self.prefill_call(suffix, window) for suffix in engine.prompt_blocks
                      if suffix <= window - size and engine.window_for(suffix) != window]
        return calls

    def adapter_calls(self):
        """The slot update adapters are loaded with."""
        slots = self.engine.adapters
        return [] if slots is None else [("adapter slot update", slots._write, self.empty_slot())]

    def empty_slot(self):
        import jax
        slots = self.engine.adapters
        return slots.tables, np.int32(0), slots.put(jax.tree.map(lambda t: np.zeros(t.shape[1:], t.dtype), slots.tables))


class WarmUp:
    """Compiles every program an Engine runs, so requests never compile: per batch size, decode over
    each window (a chunk of DECODE_CHUNK tokens, a single token and, in the smallest batch, up to
    LONG_CHUNK tokens; the first two under grammar masks), an insert for each row length prefills make
    and the copies that grow and shrink a batch to its neighbouring sizes; per window an empty row, per
    prompt block a prefill in the window that holds it, and per block of group_blocks one per group size it
    has; with a prefix cache, per window a gather and a prefill after each prefix length that fits, per row
    length a pool write; with adapters, the slot update.

    first() compiles what the smallest batch needs to answer, a token a step (its one-token decodes,
    inserts and prefills; on a CPU its long decode, which makes its chunks too), and runs each of those
    programs once: the server can answer after it. rest() compiles the other parts, each taking effect in
    the Engine only once all its programs exist (the smallest batch's multi-token decodes where they are
    programs of their own, a batch size in batch_for, the prefix cache, grouped prefills), so a request is
    never routed to a program that is not compiled; the server runs it on a background thread. The
    multi-token decodes are the slowest programs to compile (unrolled, or a loop of chunks): left out of
    first(), they no longer hold back the first answer."""

    def __init__(self, engine, threads=None, store=None):
        self.engine = engine
        self.build = Builder(threads or min(os.cpu_count() or 1, 16), store)
        self.pending = []  # the parts rest() has still to compile, by name (for /health and /metrics)
        self.prefix = engine.prefix  # held back from the Engine until its programs exist
        self.calls = WarmUpCalls(engine, self.prefix)
        self.first_names = []

    @property
    def compiled(self):
        return self.build.compiled

    def run(self):
        """Everything, in this thread."""
        self.first()
        self.rest()

    def first(self):
        engine, started = self.engine, time.time()
        smallest = engine.batch_buckets[0]
        # Where the long decode makes the chunks, compiled here for its single tokens, they serve at once.
        engine.ready_batches, engine.grouping, engine.prefix = [smallest], False, None
        engine.chunked = engine.long_makes_chunks(smallest)
        self.pending = self.parts()
        calls = self.calls
        self.build.run(calls.prefill_calls() + calls.batch_calls(smallest, chunks=False) + calls.adapter_calls())
        self.first_names = list(self.build.order)  # what the server needs to be ready (see Prefetch)
        self.decode(smallest)
        log(f"warm-up: batch {smallest}: decode over windows {','.join(map(str, engine.length_buckets))}"
            f" and prompt blocks {','.join(map(str, engine.prompt_blocks))} in {time.time() - started:.1f}s"
            f" ({self.build.counts()}{'' if engine.chunked else ', a token a step for now'})"
            f"{'; still to compile: ' + ', '.join(self.pending) if self.pending else ''}")
        self.adapter_slots()

    def parts(self):
        """The parts in the order they are compiled and take effect: batch sizes in increasing order (a batch
        grows through each size on its way), then the prefix cache, then grouped prefills."""
        engine = self.engine
        return (([] if engine.chunked else [f"chunks batch {engine.batch_buckets[0]}"])
                + [f"batch {batch}" for batch in engine.batch_buckets[1:]]
                + (["prefix cache"] if self.prefix else []) + (["grouped prefills"] if engine.group_sizes else []))

    def rest(self):
        engine, started = self.engine, time.time()
        smallest = engine.batch_buckets[0]
        work = {f"batch {batch}": functools.partial(self.calls.batch_calls, batch) for batch in engine.batch_buckets}
        work.update({f"chunks batch {smallest}": functools.partial(self.calls.chunk_calls, smallest),
                     "prefix cache": self.calls.prefix_calls, "grouped prefills": self.calls.group_calls})
        effects = {f"batch {batch}": functools.partial(engine.ready_batches.append, batch)
                   for batch in engine.batch_buckets}
        effects.update({f"chunks batch {smallest}": lambda: setattr(engine, "chunked", True),
                        "prefix cache": lambda: setattr(engine, "prefix", self.prefix),
                        "grouped prefills": lambda: setattr(engine, "grouping", True)})
        from concurrent.futures import ThreadPoolExecutor

        def take_effect(queued, wait):  # in order: a batch grows through every smaller size
            while queued and (wait or all(job.done() for job in queued[0][1])):
                part, jobs = queued.pop(0)
                for job in jobs:
                    job.result()
                effects[part]()
                self.pending.remove(part)
                log(f"warm-up: {self.describe(part)} ready after {time.time() - started:.1f}s more")
        parts, queued = list(self.pending), []
        with ThreadPoolExecutor(self.build.threads, thread_name_prefix="warm-up") as pool:
            # Each part is traced and queued while the ones before it compile: the compiler threads stay busy.
            for part in parts:
                queued.append((part, self.build.submit(pool, work[part]())))
                take_effect(queued, wait=False)
            take_effect(queued, wait=True)
        if parts:
            log(f"warm-up: {self.build.counts()}{self.build.times()}")

    def describe(self, part):
        engine = self.engine
        if part == "prefix cache":
            return (f"prefix cache of {self.prefix.blocks} blocks of {self.prefix.block_tokens} tokens "
                    f"({self.prefix.pool_bytes / 2**20:,.1f} MiB)")
        if part == "grouped prefills":
            by_blocks = collections.defaultdict(list)  # sizes formed in the same blocks, said once
            for size in engine.group_sizes:
                blocks = tuple(b for b, sizes in engine.group_blocks.items() if size in sizes)
                if blocks:
                    by_blocks[blocks].append(size)
            return "prefills of " + "; ".join(f"{','.join(map(str, sizes))} prompts at once in blocks "
                                              f"{','.join(map(str, blocks))}" for blocks, sizes in by_blocks.items())
        if part.startswith("chunks"):
            smallest = engine.batch_buckets[0]
            return (f"batch {smallest}'s decodes of {DECODE_CHUNK}"
                    f"{f' and up to {LONGEST_CHUNK}' if engine.programs[smallest].decode_long else ''} tokens a "
                    f"dispatch{', unrolled' if smallest in engine.unrolled else ''}"
                    f"{', dispatched ahead' if engine.dispatch_ahead else ''}")
        return part + " (decode, inserts, the copies to and from the next smaller size)"

    def decode(self, batch):
        """Runs the batch's programs once each (compiled above): a first run can still cost, e.g. the
        device's memory for the cache."""
        engine = self.engine
        # The longest prompt that leaves room for one new token is prefilled in the largest block.
        rows = [Generation([engine.bos] * min(block, engine.max_length - 1), 1, SAMPLER_DEFAULTS["greedy"], 0, [],
                           None) for block in engine.prompt_blocks]
        decoding = engine.generate(rows, batch)
        for window in engine.length_buckets:
            decoding.step(window, 1)
            if engine.chunked:
                for steps in (DECODE_CHUNK,) + ((LONG_CHUNK,) if decoding.decode_long is not None else ()):
                    decoding.step(window, steps)
        if engine.dispatch_ahead and engine.chunked:
            for _ in range(2):  # the second chunk is dispatched ahead of reading the first: next_tokens
                decoding.step(engine.length_buckets[0], DECODE_CHUNK)
            decoding.settle()

    def adapter_slots(self):
        slots = self.engine.adapters
        if slots is None:
            return
        import jax  # run once, on a copy (the tables stay)
        jax.block_until_ready(slots._write(*self.calls.empty_slot()))
        log(f"warm-up: {slots.max_adapters} adapter slots of rank {slots.max_rank} on "
            f"{','.join(slots.modules)}: {slots.slot_bytes / 2**20:,.1f} MiB each")


class Builder:
    """Makes the warm-up's programs exist. Each call (name, Program, arguments) is loaded from the
    ProgramStore when it holds it; else it is lowered here, one at a time (tracing runs Python, under the
    GIL, and briefly patches the model's layers), compiled on a thread pool (XLA's compiler releases the
    GIL) and saved to the store. A compiled program lands in its jit's caches and a loaded one in its
    Program, so the call that runs it later compiles nothing. An Output argument stands for that
    program's output, as an abstract value. Keeps each program's times."""

    def __init__(self, threads, store=None):
        self.threads, self.store = threads, store
        self.compiled = []  # (program, seconds to trace and lower, seconds to compile)
        self.loaded = []  # (program, seconds to load)
        self.lowered = {}  # one lowering per (program, arguments) object, however often used
        self.executables = []  # (program, compiled, static arguments) of each program compiled here
        self.order = []  # every program's name, in the order submitted
        self.tracing = threading.RLock()  # an Output's program is lowered inside its consumer's lowering

    def lower(self, program, args):
        with self.tracing:
            if (id(program), id(args)) not in self.lowered:
                self.lowered[id(program), id(args)] = program.lower(
                    *(a.pick(self.lower(a.program, a.args).out_info) if isinstance(a, Output) else a for a in args))
            return self.lowered[id(program), id(args)]

    def submit(self, pool, calls):
        """Queues each call's loading or compiling on `pool`; returns the futures."""
        jobs = []
        for name, program, args in calls:
            self.order.append(name)
            if self.store is not None and self.store.has(name):
                jobs.append(pool.submit(self.load_one, name, program, args))
            else:
                began = time.time()
                jobs.append(pool.submit(self.compile_one, name, program, args, self.lower(program, args),
                                        time.time() - began))
        return jobs

    def load_one(self, name, program, args):
        began = time.time()
        if self.store.load(name, program):
            self.loaded.append((name, time.time() - began))
        else:  # unreadable (and removed): compiled as on a first start
            began = time.time()
            self.compile_one(name, program, args, self.lower(program, args), time.time() - began)

    def compile_one(self, name, program, args, lowered, trace_seconds):
        began = time.time()
        XLA_CACHE.hit = False
        compiled = lowered.compile()
        self.compiled.append((name, trace_seconds, time.time() - began))
        self.executables.append((program, compiled, program.statics(args)))
        if self.store is not None:
            self.store.save(name, compiled, program.statics(args), from_xla_cache=XLA_CACHE.hit)

    def run(self, calls):
        """Every call's program, before this returns."""
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(self.threads, thread_name_prefix="warm-up") as pool:
            for job in self.submit(pool, calls):
                job.result()

    def drop_tracing(self):
        """Hands each program compiled here to its Program, as a loaded one is kept, and empties the lowerings
        and JAX's caches: what tracing left there, about 5 MiB a program on XLA's CPU backend (Gemma 3 270M
        int8, 23 programs: 106-126 MiB). Only for a process whose every program came from this Builder (the
        server, after its warm-up): anything else jitted would compile again at its next call."""
        import jax
        for program, compiled, statics in self.executables:
            program.add(compiled, statics)
        self.executables, self.lowered = [], {}
        jax.clear_caches()

    def counts(self):
        loaded, compiled, where = len(self.loaded), len(self.compiled), f"compiled on {self.threads} threads"
        if loaded and compiled:
            return f"{loaded + compiled} programs: {loaded} loaded from the program store, {compiled} {where}"
        return f"{loaded + compiled} programs {'loaded from the program store' if loaded else where}"

    def times(self):
        parts = []
        if self.compiled:
            slowest = max(self.compiled, key=lambda c: c[2])
            parts.append(f"{sum(c for _, _, c in self.compiled):.1f}s of compiling, "
                         f"{sum(t for _, t, _ in self.compiled):.1f}s of tracing; the slowest, {slowest[0]}: "
                         f"{slowest[2]:.1f}s")
        if self.loaded:
            parts.append(f"{sum(t for _, t in self.loaded):.1f}s of loading")
        return f": {'; '.join(parts)}" if parts else ""


# Whether this thread's last compile was a hit in XLA's persistent cache (see watch_xla_cache).
XLA_CACHE = threading.local()


def watch_xla_cache():
    """Counts XLA's persistent-cache hits (METRICS) and marks them in the compiling thread (XLA_CACHE), where
    JAX reports them."""
    import jax.monitoring

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            METRICS.add("compile_cache_hits")
            XLA_CACHE.hit = True
    jax.monitoring.register_event_listener(on_event)


class ProgramStore:
    """The warm-up's compiled programs on disk (under --compile-cache), each by its name in a folder named
    by a hash of all that shapes them: serve.py's own text, the versions of JAX, jaxlib, Keras and
    keras-hub, the devices and XLA's flags, the model's architecture and its variables' paths, shapes and
    dtypes, the adapter tables, and the engine's sizes (batch sizes, windows, blocks, stop tokens). A
    restart with all of those the same loads every program instead of tracing and compiling it: XLA's own
    cache saves the compiling but not the tracing, which runs one program at a time (on a TPU, 57-85 s of
    a restart's warm-up). A changed model, dtype or flag hashes to a new folder, never a stale program;
    the KEEP most recently used folders stay. A file that does not load is removed and compiled anew.

    On a CPU, a program that XLA's cache handed back is not stored: XLA's CPU backend serializes such an
    executable without its machine code (it then fails at its first run: "Function ... not found"). It is
    stored once it is compiled anew, e.g. after XLA's cache is emptied.

    The folder is only known once the model is loaded. An index (early key -> folder and the order its
    programs were built in) lets a Prefetch start loading them while the weights load; they are used only
    if that folder is this one."""

    KEEP = 4

    def __init__(self, root, engine, prefetch=None):
        import jax
        self.root, self.cpu = Path(root), jax.default_backend() == "cpu"
        key = hashlib.sha256(json.dumps(program_fingerprint(engine), sort_keys=True, default=str).encode())
        self.dir = self.root / key.hexdigest()[:24]
        self.prefetched = prefetch.jobs if prefetch is not None and prefetch.folder == self.dir.name else {}
        self.dir.mkdir(parents=True, exist_ok=True)
        os.utime(self.dir)  # most recently used, for the pruning below
        folders = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime,
                         reverse=True)
        for stale in folders[self.KEEP:]:
            shutil.rmtree(stale, ignore_errors=True)

    def path(self, name):
        return program_file(self.dir, name)

    def has(self, name):
        return self.path(name).is_file()

    def load(self, name, program):
        """Loads the program `name` into `program` (prefetched, or now); False (the file removed) if it
        cannot be."""
        job = self.prefetched.pop(name, None)
        try:
            program.add(*(job.result() if job is not None else read_program(self.path(name))))
            return True
        except Exception as e:
            log(f"warning: the stored program {name} did not load ({type(e).__name__}: {e}); compiling it")
            self.path(name).unlink(missing_ok=True)
            return False

    def save(self, name, compiled, statics, from_xla_cache=False):
        if from_xla_cache and self.cpu:  # serialized without its machine code (see above): compiled anew next time
            return
        import pickle
        from jax.experimental import serialize_executable
        try:
            data = pickle.dumps((*serialize_executable.serialize(compiled), statics))
            partial = self.path(name).with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_bytes(data)
            os.replace(partial, self.path(name))  # whole, or not there: a crash mid-write leaves no torn file
        except Exception as e:  # a full disk, a program that cannot be serialized: the next start compiles it
            log(f"warning: the program {name} was not stored ({type(e).__name__}: {e})")

    def remember(self, early, first):
        """Records that a start with the early key `early` used this folder, and `first`, the names of the
        programs it needs to be ready."""
        index_path = self.root / "index.json"
        try:
            index = json.loads(index_path.read_text()) if index_path.exists() else {}
            index[early] = {"folder": self.dir.name, "first": first}
            partial = index_path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(index))
            os.replace(partial, index_path)
        except (OSError, ValueError) as e:
            log(f"warning: the program store's index was not written ({type(e).__name__}: {e})")


def program_file(folder, name):
    return folder / (name.replace(" ", "-") + ".xla")


def read_program(path):
    """(executable, its static arguments) from a file ProgramStore.save wrote."""
    import pickle
    from jax.experimental import serialize_executable
    serialized, in_tree, out_tree, statics = pickle.loads(Path(path).read_bytes())
    return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree), statics


class Prefetch:
    """Loads the programs the last start with the same early key needed to be ready (WarmUp.first's), on
    threads of their own, while the model loads. The early key is what a start knows before loading:
    serve.py's text, the libraries' versions, the flags, the model files' names, sizes and times. It only
    predicts the store's folder: ProgramStore takes these programs only when the folder it computes from
    the loaded model is the same. Only the first part's: on a TPU, loading all 59 programs of gemma_2b
    alongside its weights slowed the weights' loading from 9 to 24 s, and the server was ready after 41 s
    instead of 31 s without a prefetch (BENCHMARKS.md)."""

    NOT_PROGRAMS = {"api_key", "host", "port", "uds", "uds_mode", "seed", "sampler", "shutdown_timeout", "idle_timeout",
                    "max_connections", "max_body_bytes", "max_queue", "batch_window_ms", "max_tokens_limit"}

    def __init__(self, root, args, threads=None):
        from concurrent.futures import ThreadPoolExecutor
        from importlib import metadata
        root, self.jobs, self.folder = Path(root), {}, None
        model = Path(args.model)
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime) for f in model.iterdir()) if model.is_dir() else []
        self.early = hashlib.sha256(json.dumps(
            [hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), files,
             sorted((k, v) for k, v in vars(args).items() if k not in Prefetch.NOT_PROGRAMS),
             [metadata.version(p) for p in ("jax", "jaxlib", "keras", "keras-hub")],
             [os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")]], default=str).encode()).hexdigest()
        try:
            entry = json.loads((root / "index.json").read_text()).get(self.early)
        except (OSError, ValueError):
            entry = None
        if not entry or not (root / entry["folder"]).is_dir():
            return
        self.folder = entry["folder"]
        pool = ThreadPoolExecutor(threads or min(os.cpu_count() or 1, 16), thread_name_prefix="prefetch")
        for name in entry["first"]:
            path = program_file(root / self.folder, name)
            if path.is_file():
                self.jobs[name] = pool.submit(read_program, path)
        pool.shutdown(wait=False)


def program_fingerprint(engine):
    """What shapes an engine's programs, beyond their names (see ProgramStore)."""
    import jax
    import jaxlib
    import keras
    import keras_hub
    model, tables = engine.model, engine.lora_tables
    return {"serve.py": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "versions": [jax.__version__, jaxlib.__version__, keras.__version__, keras_hub.__version__],
            "devices": [(d.platform, d.device_kind, d.id) for d in jax.devices()],
            "flags": [os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")],
            "mesh": None if engine.distribution is None else repr(engine.distribution.device_mesh.backend_mesh),
            "model": [type(model).__name__, model.backbone.get_config()],
            "variables": [(v.path, tuple(v.shape), str(v.dtype)) for v in engine.variables],
            "adapters": [(k, [(t.shape, str(t.dtype)) for t in v]) for k, v in sorted(tables.items())],
            "engine": [engine.batch_buckets, engine.length_buckets, engine.prompt_blocks, engine.group_sizes,
                       sorted(engine.group_blocks.items()), sorted(engine.unrolled), engine.dispatch_ahead,
                       sorted(engine.stop_ids), engine.vocabulary_size, engine.top_logprobs, engine.mask_words,
                       None if engine.prefix is None else (engine.prefix.blocks, engine.prefix.block_tokens)]}


def abstract(shapes, layout):
    """A pytree of shapes as jax.ShapeDtypeStructs, placed as `layout` says (None: one device)."""
    import jax
    return jax.tree.map(lambda s, l: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=l), shapes,
                        layout if layout is not None else jax.tree.map(lambda _: None, shapes))


# ----------------------------------------------------------------------------- sampling state

class RowSampling:
    """Each row's sampling settings as the arrays the decode programs take (SAMPLE_ARRAYS, then
    ADJUST_ARRAYS), for a DecodeBatch and for the warm-up that compiles its programs. A free row is
    greedy with nothing to adjust: one left sampling or penalising would keep the rest of its batch off
    the cheap paths (sample()'s argmax, adjust_logits' skipped cond)."""
    NEVER = np.iinfo(np.int32).max  # an id past any vocabulary: adjust_logits' scatters drop it

    def __init__(self, size):
        self.temperature, self.top_p = np.zeros(size, np.float32), np.ones(size, np.float32)
        self.top_k, self.seeds = np.full(size, CANDIDATES, np.int32), np.zeros(size, np.uint32)
        self.alternatives = np.zeros(size, np.int32)  # top log-probabilities each row wants
        self.prompt_lengths, self.min_positions = np.zeros(size, np.int32), np.zeros(size, np.int32)
        self.frequency, self.presence = np.zeros(size, np.float32), np.zeros(size, np.float32)
        self.repetition = np.ones(size, np.float32)
        self.stop_ids = np.full((size, STOP_SLOTS), self.NEVER, np.int32)
        self.bias_ids = np.full((size, BIAS_SLOTS), self.NEVER, np.int32)
        self.bias_values = np.zeros((size, BIAS_SLOTS), np.float32)

    def set(self, row, sampling, seed=0, logprobs=None, prompt_length=0, model_stop_ids=()):
        """A row's settings: `sampling` as parse_sampling makes it (SAMPLER_DEFAULTS' keys at least);
        the stop ids min_tokens holds back are the model's and the request's stop_token_ids."""
        self.temperature[row], self.top_k[row], self.top_p[row] = (sampling["temperature"], sampling["top_k"],
                                                                   sampling["top_p"])
        self.seeds[row], self.alternatives[row] = seed, logprobs or 0
        self.prompt_lengths[row] = prompt_length
        self.frequency[row] = sampling.get("frequency_penalty", 0.0)
        self.presence[row] = sampling.get("presence_penalty", 0.0)
        self.repetition[row] = sampling.get("repetition_penalty", 1.0)
        min_tokens = sampling.get("min_tokens", 0)
        self.min_positions[row] = prompt_length - 1 + min_tokens if min_tokens else 0
        stops = sorted(set(model_stop_ids) | set(sampling.get("stop_token_ids", ()))) if min_tokens else []
        self.stop_ids[row] = self.NEVER
        self.stop_ids[row, :len(stops)] = stops
        bias = sampling.get("logit_bias") or {}
        self.bias_ids[row], self.bias_values[row] = self.NEVER, 0
        self.bias_ids[row, :len(bias)], self.bias_values[row, :len(bias)] = list(bias), list(bias.values())

    def clear(self, row):
        self.set(row, SAMPLER_DEFAULTS["greedy"])

    def plain(self, row):
        """Whether a row is greedy, wants no alternatives and adjusts nothing."""
        return (self.temperature[row] <= 0 and self.alternatives[row] <= 0 and self.min_positions[row] == 0
                and self.frequency[row] == 0 and self.presence[row] == 0 and self.repetition[row] == 1
                and not self.bias_values[row].any())

    def arrays(self):
        return [getattr(self, name) for name in SAMPLE_ARRAYS + ADJUST_ARRAYS]

    def take(self, other, kept):
        """Row i's settings from `other`'s row kept[i]."""
        for name in SAMPLE_ARRAYS + ADJUST_ARRAYS:
            getattr(self, name)[:len(kept)] = getattr(other, name)[kept]


class RowGrammars:
    """Each row's grammar mask for its next token (llguidance's bitmask, made on the host), and the check
    that lets a grammar row keep a chunk's later tokens, drawn without it. Free rows allow every token."""

    def __init__(self, engine, size):
        self.engine = engine
        self.masks = np.full((size, engine.mask_words), -1, np.int32)
        self.masked_rows = False  # whether `masks` still holds a grammar's mask
        self.open_masks = engine.open_masks(size)  # on the device: every token allowed, for chunks without a grammar

    def fill(self, rows):
        """Each grammar row's mask for its next token (llguidance, on the host); False when no row of
        `rows` (generations, None for a free row) has a grammar."""
        constrained = [(row, g.matcher) for row, g in enumerate(rows) if g is not None and g.matcher is not None]
        if self.masked_rows:  # a finished grammar's last mask must not reach the row's next request
            self.masks.fill(-1)
            self.masked_rows = False
        if not constrained:
            return False
        import llguidance.numpy
        started = time.time()
        for row, matcher in constrained:
            llguidance.numpy.fill_next_token_bitmask(matcher, self.masks, row)
        self.masked_rows = True
        METRICS.observe_masks(len(constrained), time.time() - started)
        return True

    def inputs(self, masked):
        """The masks a decode chunk takes: the rows' own when `masked` (fill() said a row has a grammar)."""
        return self.engine.feed(self.masks) if masked else self.open_masks

    def candidates(self, row, generation, sampler):
        """How many of the most likely tokens a grammar row's draw picks among: 1 when greedy, top_k when
        top-p cuts none of them (top_p 1) and the step lists them (engine.top_logprobs); 0 when its
        later tokens are never kept (any other sampler, or log-probabilities to report, which must be
        the masked distribution's)."""
        if generation.logprobs is not None:
            return 0
        if sampler.temperature[row] <= 0:
            return 1
        k = int(sampler.top_k[row])
        return k if sampler.top_p[row] >= 1 and k <= self.engine.top_logprobs else 0

    @staticmethod
    def keeps_free_draw(generation, candidates, token, top_ids):
        """Whether a token drawn without the grammar's mask (a chunk's later token) is the one the masked
        draw makes: it is when the grammar allows each of the draw's `candidates` (`top_ids()`: the most
        likely ids at that step, fetched only for a sampled row). The mask then removes none of them, so
        the masked draw sees the same candidates in the same order and, keyed by (seed, position), picks
        the same one; for a greedy row, an argmax the grammar allows is the masked argmax."""
        if not candidates:
            return False
        ids = [token] if candidates == 1 else top_ids()[:candidates].tolist()
        return all(generation.matcher.validate_tokens([i]) == 1 for i in ids)

    def take(self, other, kept):
        """Row i's mask from `other`'s row kept[i]."""
        self.masks[:len(kept)] = other.masks[kept]
        self.masked_rows = other.masked_rows


class DecodeBatch:
    """`size` rows over one cache. Each row holds one generation at its own position; a row frees up
    the moment its generation ends and can take the next one. With Engine.dispatch_ahead (a GPU or TPU)
    a chunk goes to the device before the tokens of the one ahead of it are read, so the host's work
    (reading tokens, stop strings, streaming, admitting) overlaps the device's instead of idling it."""

    def __init__(self, engine, size):
        self.engine, self.size, self.length = engine, size, engine.max_length
        self.new_cache, self.insert, self.decode, self.decode_long, self.next_tokens, _ = engine.programs[size]
        self.cache = self.new_cache()
        self.rows = [None] * size
        self.positions = np.zeros(size, np.int32)  # where each row's next input token goes
        self.tokens = np.full(size, engine.pad, np.int32)
        self.stale = np.zeros(size, bool)  # rows whose next input token is still on the device (see `pending`)
        self.sampler = RowSampling(size)
        self.slots = np.zeros(size, np.int32)  # each row's adapter slot (0: the base alone)
        self.sampling = None  # the slots and the sampler's arrays on the device; re-sent when a row changes hands
        self.grammars = RowGrammars(engine, size)
        self.first_token_due = False  # a one-token chunk next, for a streamed first token (admit_all)
        # The last chunk dispatched whose tokens are not read yet (a Chunk). Its rows' last tokens feed the next
        # chunk on the device.
        self.pending = None
        # Every generation admitted and not yet seen to finish. A row whose generation ends in the pending
        # chunk is refilled before that chunk is read: from then on only this set (and the chunk) holds
        # it, and fail() must still finish it.
        self.taken = set()

    @property
    def free_rows(self):
        return len(self.free_row_ids())

    @property
    def active(self):
        """Rows holding a generation, those that end in the pending chunk included."""
        return self.size - self.rows.count(None)

    def free_row_ids(self):
        """Empty rows, and rows whose generation is sure to end in the pending chunk (its max_tokens or the
        end of the cache, both known before its tokens are read): a request admitted there decodes from
        the next chunk on, as it would have after reading the tokens."""
        return [row for row, g in enumerate(self.rows) if g is None] + self.ending_rows()

    def ending_rows(self):
        """A grammar row is never sure to: the pending chunk's tokens may be dropped for it (hand_out)."""
        if self.pending is None:
            return []
        busy, start, steps = self.pending.busy, self.pending.start, self.pending.steps
        return [row for row, g in busy if self.rows[row] is g and g.finish_reason is None and g.matcher is None
                and (len(g.ids) + steps >= g.max_tokens or start[row] + steps >= self.length)]

    def admit(self, generation):
        self.admit_all([generation])

    def admit_all(self, generations):
        """Prefills the prompts (together where they can be: Prefills.rows) into free rows; a row's
        first decode step re-reads its last prompt token."""
        rows = self.free_row_ids()[:len(generations)]
        assert len(rows) == len(generations), "more generations than free rows"
        decoding = self.active > len(self.ending_rows())  # rows that go on decoding wait for these prefills
        TIMELINE.stalling = decoding
        self.taken = {g for g in self.taken if g.finish_reason is None}
        for row, generation in zip(rows, generations):
            self.rows[row] = generation  # held by the batch from here: a failure below finishes it
            self.taken.add(generation)
            generation.started = time.time()
            self.slots[row] = generation.slot
        # A streamed request's first token comes after a one-token chunk, read at once, only where no other row
        # decodes: under load newcomers arrive every few tokens, and a one-token chunk read before the next is
        # dispatched would stop the dispatching ahead for the whole batch each time (issue #48); they then get
        # it with the next chunk, dispatched ahead like any other.
        for row, generation, (row_cache, cached) in zip(rows, generations, self.engine.prefills.rows(generations)):
            generation.cached_tokens = cached
            self.cache = self.insert(self.cache, row_cache, np.int32(row))
            TIMELINE.dispatched("insert")
            ids = generation.prompt_ids
            self.positions[row], self.tokens[row], self.stale[row] = len(ids) - 1, ids[-1], False
            self.sampler.set(row, generation.sampling, generation.seed, generation.logprobs, len(ids),
                             self.engine.stop_ids)
            self.sampling = None
            self.first_token_due |= generation.events is not None and not decoding

    def chunk_length(self, steps, quiet):
        """One token when a streamed request waits for its first token, when no busy row can keep a
        chunk's later tokens (each has a grammar whose sampler keeps only masked draws), or while the
        batch's multi-token programs are still compiling; up to Engine.long_limit() tokens
        (decode_until_done) when `quiet` (no request waits), no row streams or has a grammar, and one
        still has more than DECODE_CHUNK tokens to make; DECODE_CHUNK otherwise.
        `steps` forces one of the three (the warm-up compiles each)."""
        busy = [g for g in self.rows if g is not None]
        if steps is not None:
            return steps
        if not self.engine.chunked or self.first_token_due or (busy and not any(
                g.matcher is None or self.grammars.candidates(row, g, self.sampler)
                for row, g in enumerate(self.rows) if g is not None)):
            return 1
        # Streamed rows keep DECODE_CHUNK: a long chunk would hold back their text for up to LONGEST_CHUNK
        # tokens. Grammar rows do: their masks are made between chunks.
        long = (quiet and self.decode_long is not None and all(g.events is None and g.matcher is None for g in busy)
                and max((g.max_tokens - len(g.ids) for g in busy), default=0) > DECODE_CHUNK)
        return LONG_CHUNK if long else DECODE_CHUNK

    def step(self, window=None, steps=None, quiet=False):
        with WORKER_CLOCK.part("dispatch"):
            return self.dispatch(window, steps, quiet)

    def dispatch(self, window, steps, quiet):
        """Decodes a chunk (chunk_length) in every row and hands each generation its own tokens: those of
        the chunk before, when this one could be dispatched ahead of reading them. A one-token or a long
        chunk needs the tokens before it first (for the first token's event, or how far each row has got)
        and is read as soon as it is made, as is a chunk with grammar rows (their next masks)."""
        engine = self.engine
        if self.pending is not None:
            held = set(row for row, g in enumerate(self.rows) if g is not None)
            if held and not held - set(self.ending_rows()):
                return self.settle()  # every row ends in the pending chunk: nothing more to dispatch
            if self.chunk_length(steps, quiet) != DECODE_CHUNK:
                self.settle()
        steps = self.chunk_length(steps, quiet)
        with WORKER_CLOCK.part("grammar"):
            # A grammar row whose last tokens are still on the device (this chunk is dispatched ahead of reading
            # them) draws this chunk's first token without its mask too, checked when it is read (hand_out):
            # its mask needs those tokens, and waiting for them would stop the whole batch. The others' masks
            # are made now.
            masked = self.grammars.fill([None if g is None or self.stale[row] else g for row, g in enumerate(self.rows)])
        unmasked = {row for row, g in enumerate(self.rows) if g is not None and g.matcher is not None and self.stale[row]}
        self.first_token_due = False
        busy = [(row, g) for row, g in enumerate(self.rows) if g is not None]
        for row in self.ending_rows():  # what this chunk makes there is dropped: let it not cost the cheap paths
            if not self.sampler.plain(row):
                self.vacate_settings(row)
        if self.sampling is None:
            self.sampling = [engine.feed(a) for a in (self.slots, *self.sampler.arrays())]
        limit = engine.long_limit() if steps == LONG_CHUNK else steps  # the most tokens this dispatch makes
        if window is None:  # one that holds every row's last position of the dispatch
            window = engine.window_for(max((self.positions[row] for row, _ in busy), default=0) + limit)
        tokens = engine.feed(self.tokens)
        if self.pending is not None and self.stale.any():  # rows that carry on: from the pending chunk's tokens
            tokens = self.next_tokens(self.pending[0], engine.feed(self.stale), tokens)
        inputs = tokens, engine.feed(self.positions)
        looped = steps == LONG_CHUNK or engine.long_makes_chunks(self.size)
        # A grammar row that cannot keep a token drawn without its mask (RowGrammars.candidates) is read, and its
        # next mask made, before the next chunk is dispatched.
        must_read = any(g.matcher is not None and not self.grammars.candidates(row, g, self.sampler) for row, g in busy)
        start, read_now = self.positions.copy(), looped or steps != DECODE_CHUNK or must_read or not engine.dispatch_ahead
        if looped:
            remaining = np.zeros(self.size, np.int32)  # free rows: none
            for row, g in busy:  # a row also ends where the cache does; at its end it still runs one chunk,
                # after which settle() finishes it, as after a short chunk
                remaining[row] = max(1, min(g.max_tokens - len(g.ids), self.length - 1 - self.positions[row]))
            stop_ids = np.full(8, -1, np.int32)  # one shape, whatever the model's stop tokens
            stop_ids[:len(engine.stop_ids)] = sorted(engine.stop_ids)
            started = time.perf_counter()
            ((sampled, logprobs), made), self.cache = self.decode_long(
                engine.values, self.cache, window, LONGEST_CHUNK, self.grammars.inputs(masked), *inputs,
                engine.feed(remaining), engine.feed(stop_ids, replicated=True),
                engine.feed(np.int32(limit), replicated=True), engine.lora_tables, *self.sampling)
            TIMELINE.dispatched("decode_long", sampled)
            with WORKER_CLOCK.part("read"):
                made = int(made)
            long, steps = steps == LONG_CHUNK, made
            if long and steps:  # none when no row is busy (the warm-up's)
                engine.token_seconds = (time.perf_counter() - started) / steps
        else:
            (sampled, logprobs), self.cache = self.decode(engine.values, self.cache, window, steps,
                                                          self.grammars.inputs(masked),
                                                          *inputs, engine.lora_tables, *self.sampling)
            TIMELINE.dispatched("decode", sampled)
        self.positions += steps
        self.stale[:] = True
        previous, self.pending = self.pending, Chunk(sampled, logprobs, busy, start, steps, unmasked, set())
        if previous is not None:
            self.settle(previous)
        if read_now:
            self.settle()

    def settle(self, chunk=None):
        """Reads a dispatched chunk's tokens (by default the pending one's, which then feed no other chunk)
        and hands each generation its own; rows whose generation ends free up."""
        with WORKER_CLOCK.part("settle"):
            self.hand_out(chunk)

    def hand_out(self, chunk):
        engine = self.engine
        if chunk is None:
            chunk, self.pending = self.pending, None
            if chunk is None:
                return
        sampled, logprobs, busy, start, made, unmasked, voided = chunk
        with WORKER_CLOCK.part("read"):
            sampled = np.asarray(sampled)
        if self.pending is None:
            self.tokens = np.where(self.stale, sampled[made - 1], self.tokens)
            self.stale[:] = False
        METRICS.add("grammar_dropped", made * len(voided))
        # Not cancelled meanwhile, nor voided: dispatched ahead after tokens of the chunk before it were dropped.
        busy = [(row, g) for row, g in busy if g.finish_reason is None and row not in voided]
        drawn_from = {row: self.grammars.candidates(row, g, self.sampler) for row, g in busy if g.matcher is not None}
        if any(g.logprobs is not None for _, g in busy) or max(drawn_from.values(), default=0) > 1:
            with WORKER_CLOCK.part("read"):
                logprobs = [np.asarray(a) for a in logprobs]  # fetched only when asked for
        for row, generation in busy:
            for offset in range(made):
                if start[row] + offset >= self.length - 1:  # the cache is full (validation prevents it)
                    generation.finish("length", engine)
                    break
                token = int(sampled[offset, row])
                if (offset or row in unmasked) and row in drawn_from and not self.grammars.keeps_free_draw(
                        generation, drawn_from[row], token, lambda: logprobs[2][offset, row]):
                    self.rewind(row, generation, start[row] + offset)
                    METRICS.add("grammar_dropped", made - offset)
                    break
                alternatives = None if generation.logprobs is None else [a[offset, row] for a in logprobs]
                if generation.accept(token, engine, alternatives, emit=False):
                    break
            if generation.finish_reason is None:
                generation.emit(final=False, engine=engine)
            elif self.rows[row] is generation:
                self.vacate(row)

    def rewind(self, row, generation, position):
        """The rest of a grammar row's chunk is dropped: it decodes on from its last kept token at `position`,
        under its mask (what the cache holds past it is overwritten as it goes). A chunk already dispatched
        after this one carried the row on from the dropped tokens: its tokens there are void."""
        self.positions[row], self.tokens[row] = position, (generation.ids or generation.prompt_ids)[-1]
        if self.pending is not None:
            self.pending.voided.add(row)
            self.stale[row] = False

    def release_cancelled(self):
        """Frees the rows of generations whose clients left, before the next chunk decodes for them."""
        for row, generation in enumerate(self.rows):
            if generation is not None and generation.cancelled:
                generation.finish("cancelled")
                self.vacate(row)

    def vacate(self, row):
        """Frees a row; a free row still decodes, with plain settings (RowSampling.clear)."""
        self.rows[row] = None
        self.vacate_settings(row)

    def vacate_settings(self, row):
        self.sampler.clear(row)
        self.sampling = None

    def fail(self, reason):
        self.pending = None
        for generation in self.taken:
            if generation.finish_reason is None:
                generation.finish(reason)
        self.taken = set()
        self.rows = [None] * self.size


class ResizeFailed(Exception):
    """A batch could not be copied into one of another size; `batch` is the last one that holds the rows."""

    def __init__(self, batch):
        super().__init__("resize failed")
        self.batch = batch


def resized_batch(batch, size):
    """A DecodeBatch's rows in a batch of `size` (the next compiled size at a time): the pending chunk is read
    first, then every held row's cache, position and settings are copied. Growing keeps each row
    where it is; shrinking packs the held rows first. ResizeFailed holds the last batch that has them."""
    batch.settle()
    while batch.size != size:
        neighbours = batch.engine.programs[batch.size].resize
        step = max(neighbours) if size > batch.size else min(neighbours)
        kept = list(range(batch.size)) if step > batch.size else [
            row for row, g in enumerate(batch.rows) if g is not None]
        try:
            batch = copied_batch(batch, step, kept)
        except Exception as e:
            raise ResizeFailed(batch) from e
    METRICS.add("batch_resizes")
    return batch


def copied_batch(batch, size, kept):
    """A batch of `size` whose row i is row kept[i] of `batch` (rows past them free); `batch` is left whole if
    the copy fails."""
    new = DecodeBatch(batch.engine, size)
    index = np.array(kept + [0] * (size - len(kept)), np.int32)
    new.cache = batch.engine.programs[batch.size].resize[size](batch.cache, index)
    TIMELINE.dispatched("resize")
    batch.cache = None  # that batch is done: its cache's memory may go before the next copy
    for name in ("positions", "tokens", "slots"):
        getattr(new, name)[:len(kept)] = getattr(batch, name)[kept]
    new.sampler.take(batch.sampler, kept)
    new.grammars.take(batch.grammars, kept)
    new.rows[:len(kept)] = [batch.rows[row] for row in kept]
    new.first_token_due, new.taken = batch.first_token_due, batch.taken
    return new


# ----------------------------------------------------------------------------- scheduler
# Requests become Generations, queue at the Worker, and take rows of its decode batch as they free.

class Generation:
    """One prompt being decoded: collects tokens, applies stops, reports events for streaming."""

    def __init__(self, prompt_ids, max_tokens, sampling, seed, stop, events, index=0, logprobs=None):
        self.prompt_ids, self.max_tokens, self.sampling, self.seed = prompt_ids, max_tokens, sampling, seed
        # The LoRA adapter it decodes with (None: the base) and its slot (start_generations() sets them);
        # `releases` hand back what it holds (its adapter slot, its prefix-cache blocks) when it ends.
        self.adapter, self.slot, self.releases = None, 0, []
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.shares_prompt = False  # one of n answers after the first: usage counts its prompt once
        self.stop_ids = set(sampling.get("stop_token_ids", ()))  # the request's, besides the model's (ignore_eos: not those)
        self.ignore_eos = sampling.get("ignore_eos", False)
        self.min_tokens = sampling.get("min_tokens", 0)
        self.stops_from = 0  # where stop strings are looked for: text made before min_tokens does not count
        self.matcher = None  # an llguidance.LLMatcher when the output must follow a grammar
        self.model = None  # the name it was asked for, for per-model metrics
        self.stop, self.events, self.index = stop, events, index
        self.ids, self.text, self.sent, self.finish_reason = [], "", 0, None
        # detokenize()'s window: text[:decoded_text] is the decoding of the ids it had decoded when it last moved
        # on, and those from decoded_from (whose own decoding is window_text) are decoded again before new ones:
        # their text gives the new ones' leading space
        self.decoded_from = self.decoded_text = 0
        self.window_text = ""
        # None, or how many alternatives to keep per token: then token_logprobs[i] is
        # (ids[i], its logprob, [(alternative id, logprob), ...]).
        self.logprobs, self.token_logprobs, self.logprobs_sent = logprobs, [], 0
        self.cancelled = False  # set by the HTTP thread when the client leaves; the worker acts on it
        self.enqueued = time.time()
        self.started = self.first_token_at = self.finished_at = None
        self.done = threading.Event()

    def latencies(self):
        """(its wait for a row, its time to first token, its mean time per token after the first), None for
        those it did not reach."""
        first, tokens = self.first_token_at, len(self.ids)
        return (None if self.started is None else self.started - self.enqueued,
                None if first is None else first - self.enqueued,
                (self.finished_at - first) / (tokens - 1) if first and self.finished_at and tokens > 1 else None)

    def accept(self, token, engine, alternatives=None, emit=True):
        """Takes one generated token (and, when asked for, its log-probabilities: (logprob, top logprobs,
        top ids)); returns True when this generation has finished. `emit`: stream what is new now (settle()
        says False, and emits once per chunk: one event and one socket write for its tokens, not one each)."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        if token in self.stop_ids or (token in engine.stop_ids and not self.ignore_eos):
            return self.finish("stop", engine)
        if self.matcher is not None:
            self.matcher.consume_token(token)
        self.ids.append(token)
        if alternatives is not None:
            logprob, top_logprobs, top_ids = alternatives
            top = list(zip(top_ids[:self.logprobs].tolist(), top_logprobs[:self.logprobs].tolist()))
            self.token_logprobs.append((token, float(logprob), top))
        if self.stop:  # stop strings are looked for token by token; a stream's text is made when it is sent
            self.detokenize(engine)
        if len(self.ids) < self.min_tokens:
            self.stops_from = len(self.text)
        for stop in self.stop if len(self.ids) >= self.min_tokens else ():
            at = self.text.find(stop, max(self.stops_from - len(stop) + 1, 0))  # it may end after min_tokens
            if at >= 0:
                self.text = self.text[:at]
                return self.finish("stop", engine)
        if self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self.finish("stop", engine)
        if len(self.ids) >= self.max_tokens:
            return self.finish("length", engine)
        if emit:
            self.emit(final=False, engine=engine)
        return False

    def detokenize(self, engine):
        """Makes `text` decode(ids) by decoding only the tokens since decoded_from (incremental detokenization,
        as vLLM and TGI do): what decoding ids[decoded_from:] gives past window_text (the text of the tokens
        from decoded_from it had decoded when it last moved on) is what the tokens since add to the first
        decoded_text characters, a word's leading space included. Decoding every id again each chunk cost a SentencePiece
        call of the whole answer a row (issue #48); this is one call of at most DETOKENIZE_WINDOW tokens and a
        chunk's, and a second when the window starts again from the last token. It moves on only past text
        that does not end inside a UTF-8 character, which a later byte may complete."""
        new = engine.decode(self.ids[self.decoded_from:])
        if not new.startswith(self.window_text):  # a tokenizer whose text is not built piece by piece
            self.text = engine.decode(self.ids)
            self.decoded_from = self.decoded_text = 0
            self.window_text = ""
            return
        self.text = self.text[:self.decoded_text] + new[len(self.window_text):]
        if not new.endswith("\ufffd"):
            self.decoded_text, self.window_text = len(self.text), new
            if len(self.ids) - self.decoded_from > DETOKENIZE_WINDOW:
                self.decoded_from = len(self.ids) - 1
                self.window_text = engine.decode(self.ids[self.decoded_from:])

    def emit(self, final, engine=None):
        if self.events is None:
            return
        if engine is not None and not self.stop:
            self.detokenize(engine)
        # Hold back a trailing partial UTF-8 character and anything that may be the start of a stop string.
        upto = len(self.text) if final else len(self.text.rstrip("\ufffd"))
        if not final and self.stop:
            upto = max(self.sent, upto - max(len(s) for s in self.stop) + 1)
        if upto > self.sent or final:
            entries = self.token_logprobs[self.logprobs_sent:]
            self.logprobs_sent = len(self.token_logprobs)
            self.events.put((self.index, self.text[self.sent:upto], self.finish_reason if final else None, entries))
            self.sent = upto

    def cancel(self):
        self.cancelled = True

    def finish(self, reason, engine=None):
        if engine is not None and not self.stop:  # with stop strings, accept() keeps it (and cuts it)
            self.text = engine.decode(self.ids)
        if reason == "cancelled":
            METRICS.add("cancelled")
        self.finish_reason, self.finished_at = reason, time.time()
        release_all([self])
        self.emit(final=True)
        self.done.set()
        return True


class QueueFull(Exception):
    pass


class WorkerGone(Exception):
    """The model worker's thread has stopped: nothing submitted now would ever be read."""


class Worker:
    """One thread owns the model. Requests queue here and take rows of the decode batch at its next
    dispatch. When more wait than it has free rows, the batch grows in place to the size that holds
    them (resized(): its rows' caches copied by a program compiled at warm-up, nothing drained); when
    few rows are left busy, it shrinks the same way, so a long request alone decodes in a small batch."""

    def __init__(self, engine, max_batch_size, window_seconds, max_queue):
        self.engine, self.max_batch_size, self.window = engine, max_batch_size, window_seconds
        self.queue = queue.Queue()  # from the HTTP threads
        self.waiting = collections.deque()  # the worker's own, in arrival order
        self.max_queue = max_queue
        self.lock = threading.Lock()  # submit's check and put, as one; and the worker's last collect, as one
        self.stopped = False  # set, under the lock, by a worker that is exiting: submit refuses from then on
        self.busy = 0
        self.batch = None  # the DecodeBatch running, if any
        self.thread = None
        METRICS.queue_depth = self.depth
        METRICS.running = self.running

    def running(self):
        batch = self.batch  # read once: the worker drops it when a batch's run ends
        return 0 if batch is None else batch.active

    def start(self):
        self.thread = threading.Thread(target=self.run, daemon=True, name="model-worker")
        self.thread.start()

    def alive(self):
        return self.thread is not None and self.thread.is_alive() and not self.stopped

    def depth(self):
        return self.queue.qsize() + len(self.waiting)

    def submit(self, generations):
        with self.lock:  # concurrent handlers must not both pass the check and overshoot --max-queue
            if not self.alive():
                raise WorkerGone()
            if self.depth() + len(generations) > self.max_queue:
                raise QueueFull()
            for g in generations:
                self.queue.put(g)

    def idle(self):
        return not self.depth() and not self.busy

    def collect(self):
        """Moves what has queued meanwhile to `waiting`."""
        while True:
            try:
                self.waiting.append(self.queue.get_nowait())
            except queue.Empty:
                return

    def run(self):
        WORKER_CLOCK.start()
        TIMELINE.start()
        try:
            while True:
                self.run_batch()
        except BaseException as e:  # the worker is gone: /health says so, and nothing may wait on it
            log(f"error: the model worker stopped: {type(e).__name__}: {e}")
            with self.lock:  # a submit either lands before this last collect or is refused after it
                self.stopped = True
                self.collect()
            while self.waiting:
                self.waiting.popleft().finish("error")
            raise

    def run_batch(self):
        if not self.waiting:
            with WORKER_CLOCK.part("idle"):
                self.waiting.append(self.queue.get())
                # A short window lets a burst of requests start together in a batch of the right size.
                deadline = time.time() + self.window
                while len(self.waiting) < self.max_batch_size and time.time() < deadline:
                    try:
                        self.waiting.append(self.queue.get(timeout=max(0.0, deadline - time.time())))
                    except queue.Empty:
                        break
        TIMELINE.new_run()
        self.busy = 1
        first = list(self.waiting)[:self.max_batch_size]
        size = self.engine.batch_for(len(first))
        try:
            self.batch = DecodeBatch(self.engine, size)
            self.decode()
        except Exception as e:  # never let one bad batch kill the worker
            log(f"error: batch of {self.batch.size if self.batch else size} failed: {type(e).__name__}: {e}")
            if self.batch is not None:
                self.batch.fail("error")
            else:  # the batch could not even be set up: fail those it was for, not the whole line
                for g in first:
                    self.waiting.remove(g)
                    g.finish("error")
        except BaseException:  # the thread itself is ending (run() says why): its rows end with it
            if self.batch is not None:
                self.batch.fail("error")
            raise
        finally:
            self.batch, self.busy = None, 0

    def target_size(self):
        """The batch size for the rows held (past the pending chunk) and those waiting; None to keep it.
        Shrinking waits until a quarter of the rows or fewer are wanted: a row that frees and refills must
        not resize the batch each time."""
        batch = self.batch
        target = min(self.engine.batch_for(batch.size - batch.free_rows + len(self.waiting)), self.max_batch_size)
        if target > batch.size or target * 4 <= batch.size:
            return target
        return None

    def resize(self, target):
        """The batch grown or shrunk to `target` rows. If the copy fails (the device out of memory for a larger
        cache, say), the rows already running go on in the batch they had, and only the requests that were
        waiting for the rows it would have made fail (the last to arrive; those its free rows hold are admitted)."""
        self.batch.settle()  # a chunk that cannot be read is the whole batch's failure, as anywhere else
        try:
            self.batch = resized_batch(self.batch, target)
        except ResizeFailed as e:
            self.batch = e.batch
            doomed = max(0, len(self.waiting) - self.batch.free_rows)
            log(f"error: the batch could not be resized to {target} rows: {type(e.__cause__).__name__}: "
                f"{e.__cause__}; {doomed} waiting requests failed, the {self.batch.active} running go on")
            for _ in range(doomed):
                self.waiting.pop().finish("error")

    def decode(self):
        while True:
            self.collect()
            for g in [g for g in self.waiting if g.cancelled]:
                self.waiting.remove(g)
                g.finish("cancelled")
            self.batch.release_cancelled()
            if not self.batch.active and self.batch.size > self.engine.batch_for(len(self.waiting)):
                return  # emptied (its clients left): what waits now gets a batch of its own size
            target = self.target_size()
            if target is not None:
                with WORKER_CLOCK.part("resize"):
                    self.resize(target)
            if self.waiting and self.batch.free_rows:
                with WORKER_CLOCK.part("admit"):
                    self.batch.admit_all([self.waiting.popleft()
                                          for _ in range(min(self.batch.free_rows, len(self.waiting)))])
            if not self.batch.active:
                return
            METRICS.observe_batch(self.batch.active)
            self.collect()
            self.batch.step(quiet=not self.waiting)


# ----------------------------------------------------------------------------- API
# One small function per route: parse -> validate -> generations -> render. Each takes the shared
# Server state and the request (`req`: .json(), .headers, .watch(generations)) and returns a
# Reply; the HTTP plumbing further down does status lines, errors, auth, metrics and logging.

class RequestError(Exception):
    def __init__(self, status, message, kind="invalid_request_error", headers=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.headers, self.code = status, kind, headers or {}, code


class ClientGone(Exception):
    """The client closed or reset its connection before its answer was ready."""


class Reply:
    """A JSON payload, a text body, or a stream of server-sent-event chunks (None = nothing yet)."""

    def __init__(self, status=200, payload=None, text=None, content_type="application/json", stream=None,
                 headers=None):
        self.status, self.payload, self.text, self.content_type = status, payload, text, content_type
        self.stream, self.headers = stream, headers or {}


class Server:
    """Everything the routes share: configuration, readiness, the worker."""

    def __init__(self, args):
        self.args = args
        self.state = "loading"
        self.worker = None
        self.engine = None
        self.template = dict(TEMPLATES["article"], name="article")
        self.model_name = Path(args.model.rstrip("/")).name or args.model
        self.base_names = (self.model_name, args.model)  # what `model` may say to mean the base
        self.adapters = None  # AdapterSlots when LoRA adapters are served
        self.kernel_shapes = {}  # what adapters are checked against
        self.in_flight = 0
        self.lock = threading.Lock()
        self.rng = random.Random(args.seed)  # seeds for requests that bring none
        self.vocabulary = None  # (tokenizer, size, stop ids): what structured output's token table is built from,
        # until it is (see grammar_tokens)
        self.grammar_table = None  # llguidance's view of the vocabulary (see grammar_tokens)
        self.grammar_lock = threading.Lock()
        self.grammars = collections.OrderedDict()  # grammar text -> compiled LLMatcher, least recently used first
        self.warm_up = None  # the WarmUp: what is still compiling after the server is ready
        self.started = time.time()
        self.memory = MemoryLog()

    def advance(self, state):
        """Moves to `state` unless shutdown has begun: a loader finishing its warm-up after a SIGTERM must
        not announce itself ready."""
        with self.lock:
            if self.state != "shutting_down":
                self.state = state
            return self.state == state

    def grammar_tokens(self):
        """llguidance's view of the vocabulary (None: the tokenizer is not SentencePiece), built by the first
        request that wants structured output: its table of every token, 80 MiB for Gemma's 262,144, is not
        held by a server that never gets one. Its own lock: concurrent first requests build it once while
        others go on. Tried once: `vocabulary` is dropped then, built or not."""
        with self.grammar_lock:
            if self.vocabulary is not None:
                started, size = time.time(), self.vocabulary[1]
                self.grammar_table, self.vocabulary = grammar_tokenizer(*self.vocabulary), None
                release_freed_memory()  # the protobuf of every piece it was read from
                if self.grammar_table is not None:
                    log(f"structured output: llguidance's table of {size:,} tokens built in "
                        f"{time.time() - started:.1f}s, for the first request that wanted it")
            return self.grammar_table

    def status(self):
        """The state, "failed" once the worker thread is gone: /health must not say ok while requests hang."""
        if self.state == "ready" and self.worker is not None and not self.worker.alive():
            return "failed"
        return self.state


def health(server, req):
    state = server.status()
    body = {"status": "ok" if state == "ready" else state}
    if server.warm_up is not None and server.warm_up.pending:  # ready, and these take effect as they compile
        body["compiling"] = list(server.warm_up.pending)
    return Reply(200 if state == "ready" else 503, body)


def metrics_page(server, req):
    return Reply(text=METRICS.render(server.status() == "ready"), content_type="text/plain; version=0.0.4")


def list_models(server, req):
    base = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "local", "root": server.args.model,
            "parent": None}
    adapters = [] if server.adapters is None else server.adapters.loaded()
    return Reply(payload={"object": "list", "data": [base] + [
        {"id": a.name, "object": "model", "created": 0, "owned_by": "local", "root": a.path,
         "parent": server.model_name} for a in adapters]})


def load_lora_adapter(server, req):
    body = req.json()
    slots = adapter_slots(server)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise RequestError(400, "send 'lora_name' and 'lora_path' (an adapter dir on this server), both strings")
    if name in server.base_names:
        raise RequestError(409, f"the name {name} is the base model's")
    vocabulary = server.engine.pieces
    try:
        adapter = read_adapter(name, path, server.engine.model.backbone, server.kernel_shapes, vocabulary)
        slots.load(adapter)
    except AdapterError as e:
        raise RequestError(e.status, f"adapter {name}: {e}", "not_found_error" if e.status == 404 else
                           "invalid_request_error") from None
    trim_heap()  # reading it (h5py, numpy) freed memory in this handler thread's arena, which glibc keeps
    log(f"adapter {name}: loaded from {path} into slot {adapter.slot} ({describe(adapter)})")
    return Reply(payload={"id": name, "object": "model", "root": adapter.path, "parent": server.model_name,
                          "status": "loaded"})


def unload_lora_adapter(server, req):
    body = req.json()
    slots = adapter_slots(server)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise RequestError(400, "send 'lora_name', a string")
    try:
        slots.unload(name)
    except AdapterError as e:
        raise RequestError(e.status, str(e), "not_found_error", code="model_not_found") from None
    trim_heap()  # its slot's host copies, when its last request has ended (and those of requests before)
    log(f"adapter {name}: unloaded")
    return Reply(payload={"id": name, "object": "model", "status": "unloaded"})


def usage_page(server, req):
    return Reply(payload={"service": "Gemma LoRA server", "openapi": "/openapi.json", "endpoints": {
        f"{method.upper()} {path}": operation["summary"] for path, methods in OPENAPI["paths"].items()
        for method, operation in methods.items()}})


def openapi_page(server, req):
    return Reply(payload=OPENAPI)


def article_completion(server, req):
    body = req.json()
    if "prompt" in body:
        prompt, stop = body["prompt"], ()
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string")
    elif "instruction" in body:
        engine = ready_engine(server)
        template = pick_model(server, body)[2]
        prompt, stop = format_instruction(body, template), template_stop(engine, template)
    else:
        raise RequestError(400, "send 'prompt' (raw text) or 'instruction' (with optional 'context')")
    [g] = wait_for(start_generations(server, req, [prompt], body, default_max_tokens=256, extra_stop=stop), req)
    return Reply(payload={"generated_text": prompt + g.text, "completion": g.text,
                          "prompt_tokens": len(g.prompt_ids) - 1, "completion_tokens": len(g.ids),
                          "finish_reason": g.finish_reason})


def completions(server, req):
    body = req.json()
    prompts = body.get("prompt")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "'prompt' must be a string or a non-empty list of strings")
    engine = ready_engine(server)
    n = parse_n(body)
    if body.get("echo"):
        raise RequestError(400, "'echo' is not supported")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= 5):
        raise RequestError(400, "'logprobs' must be an integer from 0 to 5")
    stream, include_usage = parse_stream(body)
    grammar = requested_grammar(body)
    matcher = None if grammar is None else compiled_grammar(server, grammar)
    base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": pick_model(server, body)[0]}
    if stream:
        events, offsets = STREAMS.events(), collections.defaultdict(int)

        def render(index, text, reason, entries):
            rendered = None
            if logprobs is not None:
                rendered = completion_logprobs(engine, entries, offsets[index])
                offsets[index] += sum(map(len, rendered["tokens"]))
            return [base | {"choices": [{"text": text, "index": index, "logprobs": rendered,
                                         "finish_reason": reason}]}]
        gens = start_generations(server, req, prompts, body, default_max_tokens=16, events=events, logprobs=logprobs,
                                 grammar=matcher, n=n)
        return Reply(stream=stream_events(gens, events, render, last=(lambda: base | {"choices": [], "usage": usage(
            gens)}) if include_usage else None))
    gens = wait_for(start_generations(server, req, prompts, body, default_max_tokens=16, logprobs=logprobs,
                                      grammar=matcher, n=n), req)
    return Reply(payload=base | {
        "choices": [{"text": g.text, "index": g.index, "finish_reason": g.finish_reason,
                     "logprobs": None if logprobs is None else completion_logprobs(engine, kept_logprobs(g, engine))}
                    for g in gens],
        "usage": usage(gens)})


def chat_completions(server, req):
    body = req.json()
    engine = ready_engine(server)
    if body.get("functions"):
        raise RequestError(400, "'functions' is not supported: send 'tools' with 'tool_choice'")
    n = parse_n(body)
    model, _, template = pick_model(server, body)
    tools = requested_tools(body)
    grammar = requested_grammar(body)
    if tools is not None and grammar is not None:
        raise RequestError(400, "send 'tools' or a structured output ('response_format', 'structured_outputs'), "
                                "not both")
    messages = body.get("messages")
    check_tool_results(messages)
    if tools is not None:  # the tools are described to the model in a system message before the conversation
        if not isinstance(messages, list):
            raise RequestError(400, "'messages' must be a non-empty list")
        messages = [{"role": "system", "content": tools_prompt(body["tools"], tools)}] + messages
        grammar = ("tools", tools_grammar(tools))
    prompt = chat_prompt(messages, template)
    matcher = None if grammar is None else compiled_grammar(server, grammar)
    logprobs, top_logprobs = body.get("logprobs", False), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(400, "'logprobs' must be a boolean")
    if top_logprobs is not None and (not is_int(top_logprobs) or not 0 <= top_logprobs <= engine.top_logprobs):
        raise RequestError(400, f"'top_logprobs' must be an integer from 0 to {engine.top_logprobs}")
    if top_logprobs is not None and not logprobs:
        raise RequestError(400, "'top_logprobs' needs 'logprobs': true")
    keep = (top_logprobs or 0) if logprobs else None
    stream, include_usage = parse_stream(body)
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model}
    start = functools.partial(start_generations, server, req, [prompt], body, default_max_tokens=None, logprobs=keep,
                              extra_stop=template_stop(engine, template), max_tokens_field=max_tokens_field,
                              grammar=matcher, n=n)
    if stream:
        base["object"] = "chat.completion.chunk"
        events, calls = STREAMS.events(), collections.defaultdict(ToolCallStream)

        def chunk(index, delta, reason=None, entries=None):
            content = {"content": chat_logprobs(engine, entries)} if keep is not None and entries else None
            return base | {"choices": [{"index": index, "delta": delta, "logprobs": content, "finish_reason": reason}]}

        def render(index, text, reason, entries):
            if tools is not None:  # an answer as content, calls as OpenAI streams them: header, then arguments
                deltas = calls[index].feed(text)
                pieces = [chunk(index, delta, entries=entries if i == 0 else None) for i, delta in enumerate(deltas)]
                if reason:
                    made = tool_calls_in(calls[index].text) is not None
                    pieces.append(chunk(index, {}, "tool_calls" if made else reason))
                return pieces
            pieces = [chunk(index, {"content": text}, entries=entries)] if text or entries else []
            return pieces + ([chunk(index, {}, reason)] if reason else [])
        gens = start(events=events)
        return Reply(stream=stream_events(gens, events, render,
                                          first=[chunk(i, {"role": "assistant", "content": ""}) for i in range(n)],
                                          last=(lambda: base | {"choices": [], "usage": usage(gens)})
                                          if include_usage else None))
    gens = wait_for(start(), req)
    choices = []
    for g in gens:
        message, reason = ({"role": "assistant", "content": g.text}, g.finish_reason) if tools is None else \
            tool_call_message(g.text, g.finish_reason)
        choices.append({"index": g.index, "message": message, "finish_reason": reason, "logprobs": None if keep is None
                        else {"content": chat_logprobs(engine, kept_logprobs(g, engine))}})
    return Reply(payload=base | {"choices": choices, "usage": usage(gens)})


def check_tool_results(messages):
    """A tool message answers a call the conversation made: its 'tool_call_id' must be one of an earlier
    assistant message's tool_calls ids (what lets a client match results to calls)."""
    if not isinstance(messages, list):
        return
    ids = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return  # parse_messages says what is wrong with it
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            ids.update(c.get("id") for c in message["tool_calls"] if isinstance(c, dict))
        elif message.get("role") == "tool":
            call = message.get("tool_call_id")
            if not isinstance(call, str) or not call:
                raise RequestError(400, f"messages[{i}]: 'tool_call_id' must be the id of the tool call it answers")
            if call not in ids:
                raise RequestError(400, f"messages[{i}]: 'tool_call_id' {call!r} is not the id of any tool call an "
                                        "earlier assistant message made")


def tokenize(server, req):
    body = req.json()
    engine = ready_engine(server)
    if "messages" in body:
        text = chat_prompt(body["messages"], pick_model(server, body)[2])
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise RequestError(400, "send 'prompt' (a string) or 'messages' (a chat)")
    add_special_tokens = body.get("add_special_tokens", True)
    if not isinstance(add_special_tokens, bool):
        raise RequestError(400, "'add_special_tokens' must be a boolean")
    tokens = [engine.bos] * add_special_tokens + engine.encode(text)
    return Reply(payload={"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_length})


def detokenize(server, req):
    body = req.json()
    engine = ready_engine(server)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < engine.vocabulary_size for t in tokens):
        raise RequestError(400, f"'tokens' must be a list of token ids from 0 to {engine.vocabulary_size - 1}")
    return Reply(payload={"prompt": engine.decode(tokens)})


ROUTES = {
    "/": {"GET": usage_page, "POST": article_completion},
    "/v1/completions": {"POST": completions},
    "/v1/chat/completions": {"POST": chat_completions},
    "/v1/models": {"GET": list_models},
    "/v1/load_lora_adapter": {"POST": load_lora_adapter},
    "/v1/unload_lora_adapter": {"POST": unload_lora_adapter},
    "/tokenize": {"POST": tokenize},
    "/detokenize": {"POST": detokenize},
    "/health": {"GET": health},
    "/metrics": {"GET": metrics_page},
    "/openapi.json": {"GET": openapi_page},
}
PUBLIC_ROUTES = {"/health", "/openapi.json"}  # load balancers and client generators read them without a key


def _json(schema, description="OK"):
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(summary, reply, body=None, stream=False):
    """One OpenAPI operation: its request body, its 200 answer (JSON, or server-sent events too) and
    the error shape every other status has."""
    ok = _json(reply)
    if stream:
        # One schema per event, as OpenAPI 3.2's itemSchema: each `data:` is a JSON chunk or [DONE].
        ok["content"]["text/event-stream"] = {"itemSchema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}
    operation = {"summary": summary, "responses": {"200": ok, "default": _json({"$ref": "#/components/schemas/Error"},
                                                                               "error")}}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return operation


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_SAMPLING = {"temperature": {"type": "number", "minimum": 0, "maximum": 2},
             "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
             "top_k": {"type": "integer", "minimum": -1}, "seed": _INT,
             "stop": {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}, {"type": "null"}]},
             "max_tokens": {"type": "integer", "minimum": 1}, "model": _STR,
             "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
             "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
             "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 2,
                                    "description": "vLLM's and Hugging Face's, over prompt and output tokens"},
             "logit_bias": {"type": ["object", "null"], "maxProperties": BIAS_SLOTS,
                            "propertyNames": {"pattern": "^[0-9]+$"},
                            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
             "min_tokens": {"type": ["integer", "null"], "minimum": 0,
                            "description": "vLLM's: stop tokens and stop strings held back until this many tokens"},
             "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                                "maxItems": MAX_STOP_TOKEN_IDS},
             "ignore_eos": {"type": ["boolean", "null"], "description": "vLLM's: go on past the model's end tokens"}}
_N = {"n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N,
            "description": "answers to each prompt, at indexes i * n + j; usage counts a prompt once"},
      "best_of": {"enum": [1, None]}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                         "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}}}}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}
_TOKEN_LOGPROB = {"type": "object", "required": ["token", "logprob", "bytes"],
                  "properties": {"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": _STR, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"], "properties": {"name": _STR, "arguments": _STR}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [_STR, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {"type": {"enum": ["text"]}, "text": _STR}}}]},
    "tool_calls": {"type": "array", "items": _TOOL_CALL}, "tool_call_id": _STR}}
_STRUCTURED = {  # the structured-output request fields, on both completion endpoints
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"}, "json_schema": {"type": "object", "properties": {
                "name": _STR, "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}]},
    "structured_outputs": {"type": "object", "description": "vLLM's: exactly one of json (a JSON Schema), regex, "
                                                            "choice (strings), grammar (Lark)", "properties": {
        "json": {"type": ["object", "string"]}, "regex": _STR, "choice": {"type": "array", "items": _STR},
        "grammar": _STR}}}
OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "Gemma LoRA server (serve.py)", "version": "2",
             "description": "The article's API, OpenAI-compatible completions and chat completions, and "
                            "vLLM-style tokenize/detokenize and LoRA adapter loading. The `model` field picks "
                            "the base or an adapter. Errors are {\"error\": {\"message\", \"type\", \"code\"?}}."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "required when the server runs with --api-key"}},
        "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": _STR, "type": _STR, "code": _STR}}}}}},
    "security": [{}, {"bearer": []}],
    "paths": {
        "/": {
            "get": _operation("usage", {"type": "object"}),
            "post": _operation(
                "the article's API: prompt (or instruction + context) in, generated_text out",
                {"type": "object", "required": ["generated_text", "completion", "prompt_tokens", "completion_tokens",
                                                "finish_reason"],
                 "properties": {"generated_text": _STR, "completion": _STR, "prompt_tokens": _INT,
                                "completion_tokens": _INT, "finish_reason": _FINISH}},
                {"type": "object", "properties": {"prompt": _STR, "instruction": _STR,
                                                  "context": {"type": ["string", "null"]}, **_SAMPLING}})},
        "/v1/completions": {"post": _operation(
            "OpenAI completions (streaming: server-sent events ending data: [DONE])",
            {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
                "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR, "usage": _USAGE,
                "choices": {"type": "array", "items": {"type": "object", "required": ["text", "index", "finish_reason"],
                            "properties": {"text": _STR, "index": _INT, "finish_reason": _FINISH, "logprobs": {
                                "type": ["object", "null"], "properties": {
                                    "tokens": {"type": "array", "items": _STR},
                                    "token_logprobs": {"type": "array", "items": _NUM},
                                    "top_logprobs": {"type": "array", "items": {"type": "object"}},
                                    "text_offset": {"type": "array", "items": _INT}}}}}}}},
            {"type": "object", "required": ["prompt"], "properties": {
                "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1}]},
                "stream": _BOOL, "stream_options": {"type": ["object", "null"], "properties": {"include_usage": _BOOL}},
                **_N, "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
                "echo": {"const": False}, **_STRUCTURED, **_SAMPLING}},
            stream=True)},
        "/v1/chat/completions": {"post": _operation(
            "OpenAI chat completions, rendered with the model's recorded prompt template",
            {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
                "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR, "usage": _USAGE,
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                        "index": _INT, "finish_reason": _FINISH,
                        "message": {"type": "object", "required": ["role", "content"], "properties": {
                            "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                            "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
                        "logprobs": {"type": ["object", "null"], "properties": {"content": {
                            "type": "array", "items": {"allOf": [_TOKEN_LOGPROB, {"properties": {
                                "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}}}]}}}}}}}}},
            {"type": "object", "required": ["messages"], "properties": {
                "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                "max_completion_tokens": {"type": "integer", "minimum": 1}, "stream": _BOOL,
                "stream_options": {"type": ["object", "null"], "properties": {"include_usage": _BOOL}},
                **_N, "logprobs": _BOOL, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": TOP_LOGPROBS},
                "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
                    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
                        "name": _STR, "description": _STR, "parameters": {"type": "object"}}}}}},
                "tool_choice": {"oneOf": [{"enum": ["none", "required"]}, {
                    "type": "object", "required": ["type", "function"], "properties": {
                        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                                    "properties": {"name": _STR}}}}]},
                **_STRUCTURED, **_SAMPLING}},
            stream=True)},
        "/v1/models": {"get": _operation("the base model and every LoRA adapter over it (parent: the base)", {
            "type": "object", "required": ["object", "data"], "properties": {"object": {"const": "list"}, "data": {
                "type": "array", "items": {"type": "object", "required": ["id", "object", "root", "parent"],
                                           "properties": {"id": _STR, "object": {"const": "model"}, "root": _STR,
                                                          "parent": {"type": ["string", "null"]}}}}}})},
        "/v1/load_lora_adapter": {"post": _operation(
            "load a LoRA adapter (a train_local.py output or a PEFT dir on the server) into a free slot, as vLLM",
            {"type": "object", "required": ["id", "status"], "properties": {"id": _STR, "status": _STR}},
            {"type": "object", "required": ["lora_name", "lora_path"],
             "properties": {"lora_name": _STR, "lora_path": _STR}})},
        "/v1/unload_lora_adapter": {"post": _operation(
            "unload a LoRA adapter; its running requests finish first",
            {"type": "object", "required": ["id", "status"], "properties": {"id": _STR, "status": _STR}},
            {"type": "object", "required": ["lora_name"], "properties": {"lora_name": _STR}})},
        "/tokenize": {"post": _operation(
            "text (or a chat, rendered as for chat completions) to token ids",
            {"type": "object", "required": ["tokens", "count", "max_model_len"],
             "properties": {"tokens": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT}},
            {"type": "object", "properties": {"prompt": _STR, "messages": {"type": "array", "items": _MESSAGE},
                                              "add_special_tokens": _BOOL}})},
        "/detokenize": {"post": _operation(
            "token ids to text", {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
            {"type": "object", "required": ["tokens"], "properties": {"tokens": {
                "type": "array", "items": {"type": "integer", "minimum": 0}}}})},
        "/health": {"get": _operation("200 when ready, 503 while loading", {
            "type": "object", "required": ["status"], "properties": {"status": _STR}}, )},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}},
            "default": _json({"$ref": "#/components/schemas/Error"}, "error")}}},
        "/openapi.json": {"get": _operation("this document", {"type": "object"})},
    },
}
OPENAPI["paths"]["/health"]["get"]["responses"]["503"] = OPENAPI["paths"]["/health"]["get"]["responses"]["200"]


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ready_engine(server):
    state = server.status()
    if state != "ready":
        raise RequestError(503, f"model is {state}", "overloaded_error", {"Retry-After": "5"})
    return server.engine


def parse_n(body):
    n = body.get("n")
    if body.get("best_of") not in (None, 1):
        raise RequestError(400, "'best_of' is not supported: ask for 'n' answers and pick among them")
    if n is None:
        return 1
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise RequestError(400, f"'n' must be an integer from 1 to {MAX_N}")
    return n


def parse_stream(body):
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream, options = body.get("stream", False), body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(400, "'stream_options' must be an object like {\"include_usage\": true}")
    return stream, options.get("include_usage", False)


def format_instruction(body, template):
    instruction, context = body.get("instruction"), body.get("context", "")
    if not isinstance(instruction, str):
        raise RequestError(400, "'instruction' must be a string")
    if context is None:
        context = ""
    if not isinstance(context, str):
        raise RequestError(400, "'context' must be a string")
    if context:
        return template["prompt_with_context"].format(instruction=instruction, context=context)
    return template["prompt"].format(instruction=instruction)


def template_stop(engine, template):
    """The template's end-of-answer marker as a stop string, where the tokenizer has no single token
    for it (then the engine's stop ids cannot catch it)."""
    suffix = template.get("response_suffix") or ""
    return (suffix,) if suffix and len(engine.encode(suffix)) != 1 else ()


def pick_model(server, body):
    """(name, adapter or None, prompt template) for the request's `model`: absent or the base's name
    means the base; an adapter brings the template it was trained with, if it recorded one."""
    name = body.get("model")
    if name is None or name in server.base_names:
        return server.model_name, None, server.template
    if not isinstance(name, str):
        raise RequestError(400, "'model' must be a string")
    adapter = None if server.adapters is None else server.adapters.by_name.get(name)
    if adapter is None:
        raise RequestError(404, f"the model '{name}' does not exist: GET /v1/models lists the base and its adapters",
                           "not_found_error", code="model_not_found")
    return name, adapter, adapter.template or server.template


def adapter_slots(server):
    ready_engine(server)
    if server.adapters is None:
        raise RequestError(400, "this server was started without LoRA adapter slots: restart it with --enable-lora "
                                "(or with --adapter NAME=PATH)")
    return server.adapters


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "user"}


class ChatError(ValueError):
    """A conversation that cannot be rendered, said in one line."""


def message_text(i, message):
    """A message's text: its content (a string, or text parts joined by newlines); an assistant's tool calls
    as the JSON that serve.py's tool calling makes the model write (one call an object, several an array of
    them; arguments a JSON string as OpenAI sends them, or an object as TRL's datasets hold them); a tool's
    result under a heading."""
    role, content = message["role"], message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ChatError(f"messages[{i}]: only text content parts ({{\"type\": \"text\", \"text\"}}) are supported")
        content = "\n".join(part["text"] for part in content)
    calls = message.get("tool_calls") if role == "assistant" else None
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise ChatError(f"messages[{i}]: 'content' must be a string or a list of text parts")
    if calls:
        written = []
        for call in calls if isinstance(calls, list) else [None]:
            function = call.get("function") if isinstance(call, dict) else None
            try:
                arguments = function["arguments"]
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                if not isinstance(function["name"], str) or not isinstance(arguments, dict):
                    raise TypeError
                written.append({"name": function["name"], "arguments": arguments})
            except (TypeError, KeyError, json.JSONDecodeError):
                raise ChatError(f"messages[{i}]: 'tool_calls' must be a list of {{\"type\": \"function\", \"function\": "
                                "{\"name\", \"arguments\": a JSON object or a JSON string of one}}") from None
        calls = json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
        content = "\n".join(([content] if content else []) + [calls])
    return f"Tool result:\n{content}" if role == "tool" else content


def parse_messages(messages):
    """OpenAI / TRL chat messages -> [(role, text, weight)]: developer counts as system and a tool's result
    as a user turn, and weight (OpenAI's fine-tuning field: 0 = context only) is 0 or 1, 1 if absent."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list")
    parsed = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ChatError(f"messages[{i}]: 'role' must be one of system, developer, user, assistant, tool")
        weight = message.get("weight", 1)
        if isinstance(weight, bool) or weight not in (0, 1):
            raise ChatError(f"messages[{i}]: 'weight' must be 0 or 1")
        parsed.append((CHAT_ROLES[role], message_text(i, message), int(weight)))
    return parsed


def render_chat(messages, template, last_role="user"):
    """A conversation as the template renders it: [(text, weight)], weight None for what the template and
    the system/user messages put there, and an assistant message's own weight for its text (and its
    turn's end marker). System text goes before the first user message (neither template has a system
    role) and consecutive messages of one role join with a blank line. Serving ends on a user message,
    whose turn is left open for the model; a single user message gives exactly instruction mode's
    prompt. Training ends on an assistant message."""
    system = "\n\n".join(text for role, text, _ in messages if role == "system")
    turns = []  # [role, [(text, weight), ...]]
    for role, text, weight in messages:
        if role == "system":
            continue
        if turns and turns[-1][0] == role:
            turns[-1][1].append(("\n\n" + text, weight))
        else:
            turns.append([role, [(text, weight)]])
    if not turns or turns[0][0] != "user" or turns[-1][0] != last_role:
        raise ChatError(f"'messages' must start (after system messages) with a user message and end with "
                        f"a{'n' if last_role == 'assistant' else ''} {last_role} message")
    if system:
        turns[0][1].insert(0, (system + "\n\n", None))
    segments = []
    for role, parts in turns:
        if role == "user":
            opener = template["turn_separator"] if segments else ""
            segments.append((opener + template["prompt"].format(instruction="".join(t for t, _ in parts)), None))
        else:
            text, weight = parts[-1]
            segments += parts[:-1] + [(text + template["response_suffix"], weight)]
    return segments


def chat_prompt(messages, template):
    """The prompt a chat request becomes; 400 for a conversation that cannot be rendered."""
    try:
        return "".join(text for text, _ in render_chat(parse_messages(messages), template))
    except ChatError as e:
        raise RequestError(400, str(e)) from None


def token_bytes(engine, token_id):
    """A token's own bytes: SentencePiece's '▁' is a space, '<0xAB>' pieces are single raw bytes."""
    if token_id >= len(engine.pieces):  # a padded vocabulary's unused row (see Engine)
        return b""
    piece = engine.pieces[token_id]
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def token_text(engine, token_id):
    return token_bytes(engine, token_id).decode("utf-8", errors="replace")


def kept_logprobs(g, engine):
    """The log-probability entries of the tokens still in the text after a stop string cut it."""
    if not g.stop:
        return g.token_logprobs
    kept, offset = [], 0
    for entry in g.token_logprobs:
        if offset >= len(g.text):
            break
        kept.append(entry)
        offset += len(token_text(engine, entry[0]))
    return kept


def finite(logprob):
    return max(logprob, -9999.0)  # as OpenAI: JSON has no -Infinity


def chat_logprobs(engine, entries):
    def item(token_id, logprob):
        raw = token_bytes(engine, token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": finite(logprob), "bytes": list(raw)}
    return [item(token, logprob) | {"top_logprobs": [item(i, lp) for i, lp in top]} for token, logprob, top in entries]


def completion_logprobs(engine, entries, offset=0):
    """The legacy completions shape; text_offset counts characters from the start of the completion."""
    tokens = [token_text(engine, token) for token, _, _ in entries]
    offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [finite(lp) for _, lp, _ in entries],
            "top_logprobs": [{token_text(engine, i): finite(lp) for i, lp in top} for _, _, top in entries],
            "text_offset": offsets}


def usage(gens):
    """OpenAI's usage, with the prompt tokens served from the prefix cache as prompt_tokens_details."""
    prompts = [g for g in gens if not g.shares_prompt]  # n answers to one prompt count it once
    prompt_tokens, completion_tokens = sum(len(g.prompt_ids) - 1 for g in prompts), sum(len(g.ids) for g in gens)
    cached = sum(max(g.cached_tokens - 1, 0) for g in prompts)  # <bos> is not a prompt token here either
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def parse_sampling(body, sampler, server):
    sampling = dict(SAMPLER_DEFAULTS[sampler])
    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    if temperature is not None:
        if not is_number(temperature) or not 0 <= temperature <= 2:
            raise RequestError(400, "'temperature' must be a number from 0 to 2")
        sampling["temperature"] = float(temperature)
        if "top_k" not in body and sampler != "top_k":
            sampling["top_k"] = CANDIDATES
    if top_p is not None:
        if not is_number(top_p) or not 0 < top_p <= 1:
            raise RequestError(400, "'top_p' must be a number in (0, 1]")
        sampling["top_p"] = float(top_p)
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise RequestError(400, "'top_k' must be an integer; -1 or 0 disables it")
        sampling["top_k"] = CANDIDATES if top_k <= 0 else min(top_k, CANDIDATES)
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise RequestError(400, "'seed' must be an integer")
    if seed is None:
        with server.lock:
            seed = server.rng.getrandbits(32)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings")
    sampling.update(parse_adjustments(body, server.engine.vocabulary_size))
    return sampling, seed % 2**32, stop


def parse_adjustments(body, vocabulary_size):
    """The fields adjust_logits applies (penalties, logit_bias, min_tokens) and the stop-token ones, as
    OpenAI and vLLM define them; each bad value is a 400 naming its field."""
    found = {}
    for field in ("frequency_penalty", "presence_penalty"):
        value = body.get(field)
        if value is not None:
            if not is_number(value) or not -2 <= value <= 2:
                raise RequestError(400, f"'{field}' must be a number from -2 to 2")
            found[field] = float(value)
    value = body.get("repetition_penalty")
    if value is not None:
        if not is_number(value) or not 0 < value <= 2:
            raise RequestError(400, "'repetition_penalty' must be a number in (0, 2]")
        found["repetition_penalty"] = float(value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > BIAS_SLOTS:
            raise RequestError(400, f"'logit_bias' must be an object of up to {BIAS_SLOTS} token ids to numbers")
        found["logit_bias"] = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isdigit() else None
            if token is None or token >= vocabulary_size:
                raise RequestError(400, f"'logit_bias' has {key!r}, not a token id from 0 to {vocabulary_size - 1}")
            if not is_number(value) or not -100 <= value <= 100:
                raise RequestError(400, f"'logit_bias' of token {key} must be a number from -100 to 100")
            found["logit_bias"][token] = float(value)
    value = body.get("min_tokens")
    if value is not None:
        if not is_int(value) or value < 0:
            raise RequestError(400, "'min_tokens' must be a non-negative integer")
        found["min_tokens"] = value
    ids = body.get("stop_token_ids")
    if ids is not None:
        if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
                or not all(is_int(i) and 0 <= i < vocabulary_size for i in ids)):
            raise RequestError(400, f"'stop_token_ids' must be a list of up to {MAX_STOP_TOKEN_IDS} token ids from 0 to "
                                    f"{vocabulary_size - 1}")
        found["stop_token_ids"] = list(ids)
    value = body.get("ignore_eos")
    if value is not None:
        if not isinstance(value, bool):
            raise RequestError(400, "'ignore_eos' must be a boolean")
        found["ignore_eos"] = value
    return found


def start_generations(server, req, prompts, body, default_max_tokens, events=None, logprobs=None, extra_stop=(),
                      max_tokens_field="max_tokens", grammar=None, n=1):
    """Validates the generation fields and queues `n` Generations per prompt (503 when the queue is full),
    answer j of prompt i at index i * n + j, seeded seed + index. default_max_tokens None means as many as
    fit; `grammar` (a compiled LLMatcher) constrains each one."""
    engine = ready_engine(server)
    args = server.args
    model = pick_model(server, body)[0]
    sampling, seed, stop = parse_sampling(body, args.sampler, server)
    largest = engine.length_buckets[-1]
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise RequestError(400, f"'{max_tokens_field}' must be a positive integer")
    if max_tokens is not None and max_tokens > args.max_tokens_limit:
        raise RequestError(400, f"'{max_tokens_field}' {max_tokens} is over the limit of {args.max_tokens_limit}")
    gens = []
    for i, prompt in enumerate(prompts):
        prompt_ids = [engine.bos] + engine.encode(prompt)
        room = largest - len(prompt_ids)
        wanted = max_tokens or min(default_max_tokens or args.max_tokens_limit, room)
        if wanted > room or room < 1:
            raise RequestError(400, f"prompt ({len(prompt_ids)} tokens) + {max_tokens_field} ({wanted}) exceeds the "
                                    f"longest sequence this server compiled ({largest}); shorten the prompt "
                                    f"or {max_tokens_field}, or start the server with larger --length-buckets")
        if sampling.get("min_tokens", 0) > wanted:
            raise RequestError(400, f"'min_tokens' ({sampling['min_tokens']}) must not exceed {max_tokens_field} "
                                    f"({wanted})")
        for j in range(n):
            index = i * n + j
            gens.append(Generation(prompt_ids, wanted, sampling, (seed + index) % 2**32, stop + list(extra_stop),
                                   events, index, logprobs))
            gens[-1].shares_prompt = j > 0
    for g in gens:
        g.model = model
        if grammar is not None:
            g.matcher = grammar.deep_copy()
        if model != server.model_name:  # held until the generation ends, so an unload cannot pull it away
            g.adapter = server.adapters.acquire(model)
            if g.adapter is None:
                release_all(gens)
                raise RequestError(404, f"the model '{model}' was just unloaded", "not_found_error",
                                   code="model_not_found")
            g.slot = g.adapter.slot
            g.releases.append(functools.partial(server.adapters.release, g.adapter))
    if len(gens) > args.max_queue:  # it would never fit, and a client that obeys Retry-After would retry forever
        release_all(gens)
        raise RequestError(400, f"this request asks for {len(gens)} generations ({len(prompts)} prompt"
                                f"{'s' * (len(prompts) > 1)} x n={n}), more than the server ever queues at once "
                                f"(--max-queue {args.max_queue}): send fewer, or restart the server with a larger "
                                f"--max-queue")
    try:
        server.worker.submit(gens)
    except QueueFull:
        release_all(gens)
        raise RequestError(503, "server is busy: request queue is full", "overloaded_error",
                           {"Retry-After": "1"}) from None
    except WorkerGone:
        release_all(gens)
        raise RequestError(503, "the model worker has stopped: this server cannot generate (see its log)",
                           "server_error") from None
    req.watch(gens)  # a client that hangs up from here on has them cancelled
    return gens


# Structured output: what a request asks for becomes one llguidance grammar, compiled (and checked) on
# the request's own thread, kept in a small cache by its text, and copied per generation; the worker
# only asks each copy for its next token mask.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps' layout:
# a small model given free whitespace can pad an object with newlines until max_tokens
GRAMMAR_CACHE_SIZE = 64


def schema_grammar(schema, where):
    import llguidance
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(schema, dict):
        raise RequestError(400, f"{where} must be a JSON Schema object")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def requested_grammar(body):
    """("json_object" | "json_schema" | "json" | "regex" | "choice" | "grammar", llguidance grammar) for
    OpenAI's response_format or vLLM's structured_outputs, or None for free text."""
    import llguidance
    chosen = []
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise RequestError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                    "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}")
        if kind == "json_object":
            chosen.append((kind, schema_grammar({"type": "object"}, "response_format")))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise RequestError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'")
            chosen.append((kind, schema_grammar(spec.get("schema", {"type": "object"}), "response_format.json_schema"
                                                                                        ".schema")))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        given = [k for k in ("json", "regex", "choice", "grammar") if isinstance(outputs, dict)
                 and outputs.get(k) is not None]
        if len(given) != 1:
            raise RequestError(400, "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar'")
        kind, value = given[0], outputs[given[0]]
        if kind == "json":
            chosen.append((kind, schema_grammar(value, "structured_outputs.json")))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise RequestError(400, "'structured_outputs.choice' must be a non-empty list of non-empty strings")
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            chosen.append((kind, llguidance.LLMatcher.grammar_from_lark(lark)))
        elif not isinstance(value, str) or not value:
            raise RequestError(400, f"'structured_outputs.{kind}' must be a non-empty string")
        else:
            chosen.append((kind, llguidance.LLMatcher.grammar_from_regex(value) if kind == "regex"
                           else llguidance.LLMatcher.grammar_from_lark(value)))
    if len(chosen) > 1:
        raise RequestError(400, "send one of 'response_format' and 'structured_outputs', not both")
    return chosen[0] if chosen else None


def compiled_grammar(server, grammar):
    """An LLMatcher for (kind, grammar), from the server's cache or compiled now; 400 with llguidance's
    message for a schema, regex or grammar it cannot compile."""
    import llguidance
    kind, text = grammar
    tokens = server.grammar_tokens()
    if tokens is None:
        raise RequestError(400, "structured output needs a SentencePiece tokenizer, and this model has none")
    with server.lock:
        matcher = server.grammars.get(text)
        if matcher is not None:
            server.grammars.move_to_end(text)
            return matcher
    error = llguidance.LLMatcher.validate_grammar(text, tokens)
    if error:
        raise RequestError(400, f"the {kind.replace('_', ' ')} cannot be compiled: {error.strip()[:500]}")
    matcher = llguidance.LLMatcher(tokens, text, log_level=0)
    if matcher.is_error():
        raise RequestError(400, f"the {kind.replace('_', ' ')} cannot be compiled: {matcher.get_error()[:500]}")
    with server.lock:
        server.grammars[text] = matcher
        while len(server.grammars) > GRAMMAR_CACHE_SIZE:
            server.grammars.popitem(last=False)
    return matcher


TOOLS_PROMPT = ("You can call these functions. To call one, answer with nothing but a JSON object: "
                '{{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}}{several}.'
                "{answer}\n{functions}")
TOOLS_SEVERAL = "; to call several, a JSON array of such objects"
TOOLS_ANSWER = " To answer without calling any, write your answer as plain text."

# The calls are tried as JSON: an object, or with parallel_tool_calls an array of them. With tool_choice "auto"
# (no tool-call tokens in Gemma to tell a call from an answer) the output is either such a call or plain text
# that does not start with "{" or "[" (llama.cpp's servers do the like for models without a native format).
ToolRequest = collections.namedtuple("ToolRequest", "functions auto parallel")


def requested_tools(body):
    """What a request's tools ask for (a ToolRequest: the functions it may call, whether it may answer instead,
    whether several calls may come), or None: no tools, or tool_choice "none"."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(400, "'parallel_tool_calls' must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError(400, "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"]
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise RequestError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", "
                                "\"description\"?, \"parameters\"?}}")
    if choice == "none":
        return None
    functions = [t["function"] for t in tools]
    if choice is None or choice in ("auto", "required"):
        return ToolRequest(functions, choice != "required", parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise RequestError(400, "'tool_choice' must be 'none', 'required' or {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}")
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise RequestError(400, f"'tool_choice' names {name}, which is not among 'tools'")
    return ToolRequest(named, False, False)


def tools_prompt(tools, request=None):
    """The system text that describes the tools (and, for `request`, how to call several or answer instead)."""
    return TOOLS_PROMPT.format(
        several=TOOLS_SEVERAL if request is not None and request.parallel else "",
        answer=TOOLS_ANSWER if request is not None and request.auto else "", functions="\n".join(
            f"- {t['function']['name']}: {t['function'].get('description') or ''} Arguments (JSON Schema): "
            f"{json.dumps(t['function'].get('parameters') or {'type': 'object'}, ensure_ascii=False)}" for t in tools))


def tools_grammar(request):
    """A call of one of the request's functions, {"name": its name, "arguments": what its parameters schema
    allows}; with `parallel`, or a JSON array of such calls; with `auto`, or else plain text (not starting with
    "{", "[" or a space, so that a call is told from an answer by its first character)."""
    import llguidance
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in request.functions]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"anyOf": [call, {"type": "array", "items": call, "minItems": 1}]} if request.parallel else call
    if not request.auto:
        return schema_grammar(schema, "tools")
    schema = dict(schema, **{"x-guidance": JSON_OPTIONS})
    return llguidance.LLMatcher.grammar_from_lark(
        f"start: calls | text\ncalls: %json {json.dumps(schema, ensure_ascii=False)}\ntext: /[^\\[{{][\\s\\S]*/\n")


def tool_calls_in(text):
    """The calls a generated text holds, [(name, arguments as a JSON string)], or None: an answer, or a call cut
    short (by max_tokens)."""
    if not text.startswith(("{", "[")):
        return None
    try:
        calls = json.loads(text)
        calls = calls if isinstance(calls, list) else [calls]
        return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def call_id():
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_message(text, finish_reason):
    """(assistant message, finish_reason) for generated text: tool_calls and "tool_calls" when it holds complete
    calls; otherwise (an answer, or a call cut short by max_tokens) the text as content, with its own reason."""
    calls = tool_calls_in(text)
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls]}, "tool_calls"


class ToolCallStream:
    """A generated text, piece by piece, as OpenAI streams an assistant's turn: an answer as `content` deltas;
    calls as `tool_calls` deltas, each first with its index, id and name, then its arguments in fragments as
    they are made. The grammar fixes a call's layout ({"name": "...", "arguments": ...}, in that order, with
    json.dumps' separators), so a scan that follows JSON's strings and nesting finds each part."""
    NAME, ARGUMENTS = '{"name": ', ', "arguments": '

    def __init__(self):
        self.text, self.scanned, self.mode = "", 0, None  # mode: "content" or "calls", from the first character
        self.depth, self.in_string, self.escaped = 0, False, False
        self.calls = []  # per call: {"depth" of its object, "start", "arguments" (where they start), "sent" up to}

    def feed(self, piece):
        """The deltas for one more piece of text."""
        self.text += piece
        if self.mode is None and self.text:
            self.mode = "calls" if self.text[0] in "{[" else "content"
        if self.mode == "content":
            return [{"content": piece}] if piece else []
        deltas = []
        while self.scanned < len(self.text):
            deltas += self.step(self.text[self.scanned], self.scanned)
            self.scanned += 1
        return deltas + self.fragment(len(self.text))

    def step(self, char, at):
        if self.in_string:
            self.in_string = not (char == '"' and not self.escaped)
            self.escaped = char == "\\" and not self.escaped
            return []
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            if char == "{" and self.depth == (2 if self.text[0] == "[" else 1):
                self.calls.append({"depth": self.depth, "start": at, "arguments": None, "sent": None})
        elif char in "}]":
            self.depth -= 1
            if self.calls and char == "}" and self.depth == self.calls[-1]["depth"] - 1:
                deltas = self.fragment(at)  # its arguments end before the call's closing brace
                self.calls[-1]["sent"] = float("inf")
                return deltas
        call = self.calls[-1] if self.calls else None
        if call is not None and call["arguments"] is None:
            marker = self.text.find(self.ARGUMENTS, call["start"], at + 1)
            if marker >= 0 and marker + len(self.ARGUMENTS) <= at + 1:  # its name is whole: the call's header
                call["arguments"] = call["sent"] = marker + len(self.ARGUMENTS)
                name = json.loads(self.text[call["start"] + len(self.NAME):marker])
                return [{"tool_calls": [{"index": len(self.calls) - 1, "id": call_id(), "type": "function",
                                         "function": {"name": name, "arguments": ""}}]}]
        return []

    def fragment(self, end):
        """The current call's arguments made since its last fragment, up to `end`."""
        call = self.calls[-1] if self.calls else None
        if call is None or call["arguments"] is None or call["sent"] >= end:
            return []
        piece, call["sent"] = self.text[call["sent"]:end], end
        return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]}]


def release_all(gens):
    for g in gens:
        releases, g.releases = g.releases, []
        for release in releases:
            release()


def wait_for(gens, req):
    """Blocks until every generation has ended; ClientGone if they were cancelled because the client left."""
    for g in gens:
        g.done.wait()
    if any(g.finish_reason == "cancelled" for g in gens):
        raise ClientGone()
    if any(g.finish_reason == "error" for g in gens):
        raise RequestError(500, "generation failed", "server_error")
    return gens


def sse(payload):
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_events(gens, events, render, first=(), last=None):
    """A streamed reply of server-sent events: the payloads in `first`, then what render(index, text,
    finish_reason, logprob entries) makes of each piece the generations put in `events` (an EventStream from
    STREAMS.events(), given to them before they started), then last() and `data: [DONE]`."""
    events.gens, events.render, events.first, events.last = gens, render, first, last
    return events


# ----------------------------------------------------------------------------- HTTP plumbing

LINGER_BYTES, LINGER_SECONDS = 64 << 20, 10.0  # what is read and dropped of a refused body before closing
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/=+-]{1,128}")


# ------------------------------------------------ streams: the worker puts, one thread writes them all

class EventStream:
    """One streamed reply. The worker puts each generation's pieces here as it hands out a chunk; the one
    StreamWriter thread renders and writes them, so that no HTTP thread wakes per chunk. Until the handler
    has written the headers (open), pieces wait. Ended, it cancels what is left of its generations and lets
    the handler go on: with `error` set when the client left or could not be written to."""
    OPEN = object()

    def __init__(self, writer):
        self.writer, self.waiting = writer, []
        self.gens, self.render, self.first, self.last = [], None, (), None
        self.connection, self.out, self.finished, self.closing = None, bytearray(), 0, False
        self.timeout, self.stalled_since, self.error, self.over = None, None, None, False
        self.done = threading.Event()

    def put(self, piece):
        self.writer.put((self, piece))

    def serve(self, connection, wfile, timeout):
        """The handler's part, after the headers: the first payloads at once (the client learns its stream
        has started before the first token is made), then the writer takes the socket until the end."""
        try:
            if self.first:
                wfile.write("".join(sse(payload) for payload in self.first).encode())
            connection.setblocking(False)  # the writer must never wait on one client
            self.connection, self.timeout = connection, timeout
            self.writer.put((self, self.OPEN))
            self.done.wait()
        finally:
            self.over = True
            for g in self.gens:
                g.cancel()
        if self.error is not None:
            raise self.error

    def take(self, piece):
        """The writer's: renders a piece (or, at OPEN, those that waited) into bytes to send."""
        if piece is not self.OPEN and self.waiting is not None:
            self.waiting.append(piece)
            return
        pieces, self.waiting = (self.waiting or []) if piece is self.OPEN else [piece], None
        out = []
        for index, text, reason, entries in pieces:
            if reason == "cancelled":
                return self.end(ClientGone())
            self.finished += reason is not None
            out += [sse(payload) for payload in self.render(index, text, reason, entries)]
        if self.finished == len(self.gens) and not self.closing:
            out += [sse(self.last())] if self.last is not None else []
            out.append("data: [DONE]\n\n")
            self.closing = True
        self.out += "".join(out).encode()

    def flush(self):
        """The writer's: sends what the socket takes now; True while bytes wait for it."""
        if self.over or self.waiting is not None:
            return False
        sent = False
        try:
            while self.out:
                del self.out[:self.connection.send(self.out)]
                sent = True
        except BlockingIOError:
            now = time.monotonic()
            if sent or self.stalled_since is None:
                self.stalled_since = now
            elif now - self.stalled_since > self.timeout:  # as a blocking write's timeout would
                self.end(TimeoutError("the client read nothing of its stream"))
                return False
            return True
        except OSError as e:  # the client went away while we wrote
            self.end(e)
            return False
        self.stalled_since = None
        if self.closing:
            self.end(None)
        return False

    def end(self, error):
        self.error, self.over, self.out = error, True, bytearray()
        self.done.set()


class StreamWriter:
    """The thread that writes every streamed reply (issue #48). With a thread per client woken for each
    chunk's event, the HTTP side cost about 73 us of CPU an event (wake-ups and GIL hand-offs;
    scripts/bench_streams.py, 64 and 256 clients), under load almost as much as the model worker's own;
    one thread that takes every event that has come and sends each client's in one write costs 12-17.
    Sockets are written without blocking: a client that reads slowly keeps its bytes waiting (tried again
    every WRITE_RETRY_SECONDS), and one that reads nothing for its handler's timeout is dropped alone."""

    def __init__(self):
        # The worker appends a chunk's pieces and wakes the writer once: a queue.Queue's lock and notify per
        # piece cost the worker about 2 us each (256 rows: half a millisecond a chunk, on its critical path).
        self.pending, self.wake = collections.deque(), threading.Event()
        self.lock, self.thread = threading.Lock(), None

    def put(self, item):
        self.pending.append(item)
        if not self.wake.is_set():
            self.wake.set()

    def events(self):
        """A new reply's EventStream, for its generations to put their pieces in."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, daemon=True, name="stream-writer")
                self.thread.start()
        return EventStream(self)

    def run(self):
        stalled = set()
        while True:
            self.wake.wait(WRITE_RETRY_SECONDS if stalled else None)
            self.wake.clear()  # before taking: a piece put from here on wakes the next round
            items = []
            while self.pending:
                items.append(self.pending.popleft())
            touched = dict.fromkeys(stream for stream, _ in items)  # in order of arrival
            for stream, piece in items:
                self.guarded(stream, stream.take, piece)
            for stream in list(touched) + [s for s in stalled if s not in touched]:
                (stalled.add if self.guarded(stream, stream.flush) else stalled.discard)(stream)

    @staticmethod
    def guarded(stream, step, *args):
        """A bug in one reply's rendering costs that reply, not every stream."""
        if stream.over:
            return False
        try:
            return step(*args)
        except Exception as e:
            stream.end(e)
            return False


WRITE_RETRY_SECONDS = 0.01
STREAMS = StreamWriter()


# ------------------------------------------------------------- the socket: TCP, or a unix domain socket
UDS_PATH_BYTES = 103 if sys.platform == "darwin" else 107  # sockaddr_un's sun_path, less its closing NUL


class BindError(Exception):
    """Why the server cannot listen where it was told to, in one line for the user."""


def where(args):
    return f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"


def claim_socket_path(path):
    """Makes way for a unix socket at `path`: a socket file left by a crashed run is removed, but a
    socket something still answers on, or a file that is not a socket, is never touched."""
    if len(os.fsencode(path)) > UDS_PATH_BYTES:
        raise BindError(f"--uds {path}: the path is {len(os.fsencode(path))} bytes, and a unix socket's may have at "
                        f"most {UDS_PATH_BYTES}; pick a shorter one, such as /tmp/serve.sock")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BindError(f"--uds {path}: a file that is not a socket is there; remove it or pick another path")
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(2)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):  # nobody listens: a crashed run's leftover
            try:
                os.unlink(path)
            except FileNotFoundError:  # another start removed it first
                pass
            except OSError as e:  # someone else's, in a folder that does not let us (a sticky /tmp)
                raise BindError(f"--uds {path}: a stale socket file is there and cannot be removed "
                                f"({e.strerror.lower() if e.strerror else e}); remove it or pick another path") from None
            return
        except OSError:
            pass  # cannot tell (no permission): say it is taken rather than remove someone else's socket
    raise BindError(f"--uds {path}: another server is listening on it; stop it or pick another path")


def bind_error(args, error):
    """One line for an OSError from creating, binding or listening on the server's socket."""
    at = f"--uds {args.uds}" if args.uds else f"{args.host}:{args.port}"
    if isinstance(error, socket.gaierror):
        return f"cannot listen on {at}: --host {args.host} is not an address of this machine ({error.strerror})"
    reasons = {
        errno.EADDRINUSE: "the address is in use by another program: stop it, or pick another "
                          + ("--uds path" if args.uds else "--port"),
        errno.EACCES: "permission denied" + (" (can this user create files in its folder?)" if args.uds else
                                             " (ports below 1024 need root; pick --port 8080 or above)"),
        errno.EAFNOSUPPORT: "this machine does not allow " + ("unix" if args.uds else "TCP") + " sockets"
                            + ("" if args.uds else " (a sandbox?): serve on a unix socket with --uds PATH"),
        errno.EADDRNOTAVAIL: f"--host {args.host} is not an address of this machine",
        errno.ENOENT: "its folder does not exist",
    }
    return f"cannot listen on {at}: {reasons.get(error.errno, error.strerror or str(error))}"


class Listener(ThreadingHTTPServer):
    """The standard library's threaded server, made fit for real clients: a listen backlog that holds
    a burst (socketserver's is 5, so bursts were reset), a cap on open connections that costs no
    thread to enforce, and a reaper that closes connections idle or still sending their headers past
    --idle-timeout. With --uds it listens on a unix domain socket instead; nothing else changes."""
    daemon_threads = True
    request_queue_size = max(1024, socket.SOMAXCONN)

    def __init__(self, app):
        self.app = app
        self.deadlines = {}  # open connection -> when the reaper closes it; None while a request runs
        self.deadlines_lock = threading.Lock()
        self.uds = app.args.uds
        self.socket_inode = None  # set once our bind made the file: a failed bind must leave any other alone
        if self.uds:
            claim_socket_path(self.uds)
            self.address_family = socket.AF_UNIX
        try:
            super().__init__(self.uds or (app.args.host, app.args.port), Handler)
        except OSError as e:
            raise BindError(bind_error(app.args, e)) from None
        self.hangups = Hangups()
        threading.Thread(target=self.reap, daemon=True, name="reaper").start()

    def server_bind(self):
        if not self.uds:
            return super().server_bind()
        # The file's mode is the socket's access control: it is created owner-only, with no moment in
        # which others could connect, and only then opened up as far as --uds-mode says.
        umask = os.umask(0o177)
        try:
            self.socket.bind(self.uds)
        finally:
            os.umask(umask)
        os.chmod(self.uds, self.app.args.uds_mode)
        self.socket_inode = os.stat(self.uds).st_ino
        self.server_name, self.server_port = "localhost", 0

    def server_close(self):
        super().server_close()
        with contextlib.suppress(OSError):  # only our own file: a later run may have replaced it
            if self.uds and self.socket_inode is not None and os.stat(self.uds).st_ino == self.socket_inode:
                os.unlink(self.uds)

    def get_request(self):
        connection, address = super().get_request()
        return connection, address or ("unix", 0)  # a unix socket's peer has no address; handlers log one

    def process_request(self, request, client_address):
        with self.deadlines_lock:
            full = len(self.deadlines) >= self.app.args.max_connections
            if not full:
                self.deadlines[request] = time.time() + self.app.args.idle_timeout
        if full:
            refuse_connection(request, self.app.args.max_connections)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        with THREAD_CPU.http_thread():
            super().process_request_thread(request, client_address)

    def shutdown_request(self, request):
        with self.deadlines_lock:
            self.deadlines.pop(request, None)
        self.hangups.forget(request)
        super().shutdown_request(request)

    def set_deadline(self, connection, deadline):
        with self.deadlines_lock:
            if connection in self.deadlines:
                self.deadlines[connection] = deadline

    def open_connections(self):
        return len(self.deadlines)

    def reap(self):
        while True:
            time.sleep(0.25)
            now = time.time()
            with self.deadlines_lock:
                late = [c for c, deadline in self.deadlines.items() if deadline is not None and deadline < now]
                for connection in late:
                    self.deadlines[connection] = None
            for connection in late:  # its thread's blocked read then returns, and the thread ends
                METRICS.add("idle_closed")
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Hangups:
    """One thread that learns from the OS the moment a client closes, half-closes or resets a connection
    whose generations are running, and cancels them, so the worker frees their rows at its next chunk
    and the handler threads need not poll their sockets. On Linux it asks epoll for the hang-up alone
    (EPOLLRDHUP): bytes a client pipelines after its request do not end the watch, and a disconnect after
    them is still seen. Elsewhere a readable socket is peeked: the end of the stream is a hang-up, and
    after pipelined bytes the connection is no longer watched (they would make it readable forever)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.epoll = select.epoll() if hasattr(select, "epoll") else None
        self.selector = None if self.epoll else selectors.DefaultSelector()
        self.watched = {}  # fd -> (connection, generations)
        threading.Thread(target=self.run, daemon=True, name="hangups").start()

    def watch(self, connection, generations):
        with self.lock:
            fd = connection.fileno()
            self.watched[fd] = connection, generations
            try:  # an fd seen before: a keep-alive connection's next request, or a closed one's number reused
                if self.epoll:
                    self.epoll.register(fd, select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)
                else:
                    self.selector.register(connection, selectors.EVENT_READ)
            except (KeyError, ValueError, FileExistsError):
                if self.epoll:
                    self.epoll.modify(fd, select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)
                else:
                    self.selector.modify(connection, selectors.EVENT_READ)

    def forget(self, connection):
        with self.lock:  # by identity: a closed connection's fileno() is -1
            fd = next((fd for fd, (c, _) in self.watched.items() if c is connection), None)
            if fd is None:
                return
            del self.watched[fd]
            try:
                if self.epoll:
                    self.epoll.unregister(fd)
                else:
                    self.selector.unregister(connection)
            except (KeyError, ValueError, OSError):
                pass

    def run(self):
        while True:
            try:
                self.check()
            except Exception as e:  # a thread that ends here would leave every later hang-up unseen
                log(f"error: the hang-up watcher: {type(e).__name__}: {e} (it goes on)")
                time.sleep(0.1)

    def check(self):
        """Waits up to half a second for hang-ups and cancels the generations of those seen."""
        if self.epoll:
            fds = [fd for fd, _ in self.epoll.poll(0.5)]
        else:
            fds = [key.fd for key, _ in self.selector.select(timeout=0.5)]
        for fd in fds:
            with self.lock:
                connection, generations = self.watched.get(fd, (None, ()))
            # Asked of the connection itself: the event may be a closed one's whose number is reused.
            gone = None if connection is None else self.hung_up(connection)
            if gone is None:
                continue
            self.forget(connection)  # either way there is nothing more to learn from it
            if gone:
                for g in generations:
                    g.cancel()

    def hung_up(self, connection):
        """True if the client closed, half-closed or reset; None if not (or not yet known); False after
        pipelined bytes where only a peek can tell (then the connection is no longer watched)."""
        if connection.fileno() < 0:  # its handler closed it after the lookup: the request is over, and its
            return False  # generations with it, so there is nothing to cancel (and poll would raise)
        if self.epoll:
            check = select.poll()
            try:
                check.register(connection, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            except (ValueError, OSError):  # closed between the check above and here
                return False
            return True if check.poll(0) else None
        try:
            return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return True


def refuse_connection(connection, limit):
    """503 and close, on the accepting thread: a flood of connections must not cost a thread each."""
    METRICS.add("refused_connections")
    body = json.dumps({"error": {"message": f"too many open connections (--max-connections {limit}); retry later",
                                 "type": "overloaded_error"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        connection.setblocking(False)
        try:
            connection.recv(1 << 16)  # what already came: closing on unread data would reset the answer
        except OSError:
            pass
        connection.send(head + body)
        connection.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        connection.close()


def record_request(method, path, status, started, gens, request_id):
    """A finished request in /metrics and, when it generated or failed, one log line: with its tokens,
    queue wait, speed and finish reasons when it generated."""
    elapsed = time.time() - started
    METRICS.observe_request(path if path in ROUTES else "other", status, elapsed if gens else None)
    if not gens and (status < 400 or path == "/health"):
        return
    line = f"{method} {path} {status} {elapsed * 1000:.0f}ms id={request_id}"
    if gens:
        counts = usage(gens)
        prompt_tokens, completion_tokens = counts["prompt_tokens"], counts["completion_tokens"]
        cached = counts["prompt_tokens_details"]["cached_tokens"]
        METRICS.add("prompt_tokens", prompt_tokens)
        METRICS.add("cached_prompt_tokens", cached)
        METRICS.add("generated_tokens", completion_tokens)
        METRICS.observe_model(gens[0].model, completion_tokens)
        for g in gens:
            METRICS.observe_generation(g.latencies())
        queue_wait = max((g.started or time.time()) - g.enqueued for g in gens)
        reasons = ",".join(sorted({g.finish_reason or "cancelled" for g in gens}))
        line += (f" prompt={prompt_tokens} cached={cached} completion={completion_tokens} "
                 f"queue={queue_wait * 1000:.0f}ms {completion_tokens / max(elapsed, 1e-9):.1f} tok/s "
                 f"finish={reasons}")
    log(line)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests, in turn: read, route, write, log, count."""
    server_version = "gemma-lora-serve"
    protocol_version = "HTTP/1.1"

    def setup(self):
        # A backstop for writes to a client that stopped reading; reads are closed earlier by the reaper.
        self.timeout = self.server.app.args.idle_timeout + 10
        super().setup()

    def log_message(self, *a):  # one structured line per request instead
        pass

    def handle_one_request(self):
        # Idle, or still sending its request line and headers: the reaper closes it at the deadline.
        self.server.set_deadline(self.connection, time.time() + self.server.app.args.idle_timeout)
        self.request_id, self.generations, self.body_read = None, [], False
        super().handle_one_request()

    def end_headers(self):
        self.send_header("X-Request-Id", self.rid())
        super().end_headers()

    def rid(self):
        if self.request_id is None:
            incoming = getattr(self, "headers", None) and self.headers.get("X-Request-Id", "")
            self.request_id = incoming if incoming and REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        return self.request_id

    def send_error(self, code, message=None, explain=None):
        """The standard library's own errors (bad request line, headers too long) as JSON too."""
        self.close_connection = True
        self.send_json(code, {"error": {"message": message or self.responses.get(code, ("error",))[0],
                                        "type": "invalid_request_error"}})

    def handle_expect_100(self):
        """Refuses an oversized body before the client sends it, instead of the automatic 100 Continue."""
        length = self.headers.get("Content-Length", "").strip()
        limit = self.server.app.args.max_body_bytes
        if length.isdigit() and int(length) > limit:
            self.close_connection = True
            self.send_error_reply(RequestError(413, f"body of {length} bytes is over the {limit}-byte limit"))
            METRICS.observe_request("other", 413, None)
            return False
        return super().handle_expect_100()

    def __getattr__(self, name):
        """Every method (do_GET, do_POST, …, even unknown ones) goes through dispatch: the route table
        answers 404/405 itself, where the standard library would answer 501."""
        if name.startswith("do_"):
            return lambda: self.dispatch(name[3:])
        raise AttributeError(name)

    # -------------------------------------------------------------- one request
    def dispatch(self, method):
        app = self.server.app
        self.server.set_deadline(self.connection, None)  # busy: body reads and writes keep their own deadlines
        started, path = time.time(), self.path.split("?", 1)[0]
        status = 500
        with app.lock:
            app.in_flight += 1
        try:
            status = self.send_reply(self.route(app, method, path))
        except RequestError as e:
            status = e.status
            try:
                self.send_error_reply(e)
            except OSError:
                status = 499
        except ClientGone:
            status = 499
        except OSError:  # the client went away while we wrote
            status = 499
            for g in self.generations:
                g.cancel()
        except Exception as e:  # a bug must cost one request, not the server
            log(f"error: {method} {path}: {type(e).__name__}: {e}")
            self.close_connection = True
            try:
                self.send_error_reply(RequestError(500, "internal error", "server_error"))
            except OSError:
                pass
        finally:
            with app.lock:
                app.in_flight -= 1
            self.server.hangups.forget(self.connection)
        if status == 499:
            self.close_connection = True
        elif not self.body_read:
            self.discard_body()
        record_request(method, path, status, started, self.generations, self.rid())

    def route(self, app, method, path):
        methods = ROUTES.get(path)
        if methods is None:
            raise RequestError(404, f"no route {path}", "not_found_error")
        if method not in methods:
            raise RequestError(405, f"{method} not allowed on {path}", "invalid_request_error",
                               {"Allow": ", ".join(methods)})
        if path not in PUBLIC_ROUTES:
            self.check_auth(app.args.api_key)
        return methods[method](app, self)

    def check_auth(self, key):
        # Constant-time, so response timing does not reveal how much of a guessed key was right.
        if key and not hmac.compare_digest(self.headers.get("Authorization", "").encode("latin-1"),
                                           f"Bearer {key}".encode()):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", {"WWW-Authenticate": "Bearer"})

    # -------------------------------------------------------------- reading
    def json(self):
        content_type = self.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise RequestError(415, f"Content-Type must be application/json, got {content_type!r}")
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise RequestError(411, "Content-Length required")
        if not length_header.strip().isdigit():
            raise RequestError(400, f"bad Content-Length {length_header!r}")
        length, limit = int(length_header), self.server.app.args.max_body_bytes
        if length > limit:
            raise RequestError(413, f"body of {length} bytes is over the {limit}-byte limit")
        raw = self.read_body(length)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, "body is not valid UTF-8") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"body must be a JSON object, got {type(body).__name__}")
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise RequestError(400, "body holds a lone surrogate escape (\\ud800-\\udfff), which is not text") from None
        return body

    def read_body(self, length):
        """The body, within --idle-timeout in all (a client trickling bytes gets 408, not a thread forever)."""
        self.body_read = True
        timeout = self.server.app.args.idle_timeout
        deadline, chunks, got = time.time() + timeout, [], 0
        try:
            while got < length:
                remaining = deadline - time.time()
                if remaining <= 0:
                    raise TimeoutError
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(length - got, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        except TimeoutError:
            self.close_connection = True
            raise RequestError(408, f"request body not received within {timeout:g}s (--idle-timeout)",
                               headers={"Connection": "close"}) from None
        finally:
            self.connection.settimeout(self.timeout)
        if got < length:
            self.close_connection = True
            raise RequestError(400, f"body shorter than its Content-Length ({got} < {length})")
        return b"".join(chunks)

    def discard_body(self):
        """Reads and drops a body that was answered without being read (a 413, a 401, …). A client that
        writes its whole body before reading would otherwise see a reset instead of the answer; the
        connection stays usable when the whole body came ("lingering close", as nginx does)."""
        length = self.headers.get("Content-Length", "0").strip()
        if not length.isdigit():
            self.close_connection = True
            return
        left, deadline = int(length), time.time() + LINGER_SECONDS
        if left > LINGER_BYTES:
            self.close_connection = True
        try:
            while left > 0 and time.time() < deadline:
                self.connection.settimeout(max(0.01, deadline - time.time()))
                chunk = self.rfile.read1(min(left, 1 << 16, LINGER_BYTES))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass
        if left > 0:
            self.close_connection = True
        else:
            try:
                self.connection.settimeout(self.timeout)
            except OSError:
                pass

    def watch(self, generations):
        self.generations = generations
        self.server.hangups.watch(self.connection, generations)

    # -------------------------------------------------------------- writing
    def send_json(self, status, payload, headers=None):
        self.send_body(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json", headers)

    def send_body(self, status, body, content_type, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error_reply(self, error):
        payload = {"message": str(error), "type": error.kind} | ({"code": error.code} if error.code else {})
        self.send_json(error.status, {"error": payload}, error.headers)

    def send_reply(self, reply):
        if reply.stream is None:
            if reply.text is not None:
                self.send_body(reply.status, reply.text.encode(), reply.content_type, reply.headers)
            else:
                self.send_json(reply.status, reply.payload, reply.headers)
            return reply.status
        self.send_response(reply.status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        reply.stream.serve(self.connection, self.wfile, self.timeout)
        return reply.status


def batch_buckets(max_batch_size, batch_axis, sizes=None):
    if sizes is None:
        # Past a CPU's sizes, by fours up to BATCH_BY_FOURS_UP_TO rows and by twos above: each size is a set of
        # programs (minutes of warm-up for a 2B model on a TPU: nine sizes up to 256 compiled 192 programs in
        # 431 s, issue #48) and a copy of the cache for a batch that fills through it. Up to 64 rows a step costs
        # about the weights' read whatever the rows (gemma_2b on a TPU v5e: 7.5 ms at 1 row, 14 at 64); above,
        # it grows with them (38 ms at 256), and 128 clients in a batch of 256 made 1,935 tok/s against 2,415
        # in one of 128.
        sizes, size = set(), 1
        while size < max_batch_size:
            sizes.add(size)
            size *= 4 if BATCH_BY_TWOS_UP_TO < max_batch_size and size < BATCH_BY_FOURS_UP_TO else 2
        sizes.add(max_batch_size)
    # Under data parallelism every batch must split evenly over the batch axis.
    return sorted({-(-s // batch_axis) * batch_axis for s in sizes})


AUTO_BATCH_CAP = 256
BATCH_BY_TWOS_UP_TO, BATCH_BY_FOURS_UP_TO = 16, 64  # batch_buckets' default sizes
MIN_QUEUE = 64


def auto_max_queue(max_batch_size):
    """--max-queue auto. A queue shorter than the batch turns a burst away with 503s while rows stand empty: on a
    TPU v5e, 128 and 256 clients against a 64-long queue retried 90 and 469 times, their first tokens 3-4 s late
    and the device idle 45% of the time (issue #48)."""
    return max(MIN_QUEUE, 2 * max_batch_size)


CPU_BATCH_SIZE = 8  # a CPU's matrix units are full long before its memory is


def auto_batch_size(model, args):
    """--max-batch-size auto: CPU_BATCH_SIZE on a CPU; on a GPU or TPU what fitting_batch_size allows in the
    memory the device has left after the weights and adapters (loaded by now), logged with its reasons."""
    import jax
    device = jax.local_devices()[0]
    stats = device.memory_stats() if jax.default_backend() != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        log(f"--max-batch-size auto: {CPU_BATCH_SIZE} ({device.platform}: no device memory to fill)")
        return CPU_BATCH_SIZE
    # A row's KV cache over the longest request, split over the devices (by rows or by heads).
    row = cache_bytes(model, 1, args.length_buckets[-1])
    row /= jax.device_count()
    pool = row / args.length_buckets[-1] * args.prefix_block_tokens * (args.prefix_cache_blocks + 1)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - pool
    size, need = fitting_batch_size(free, row, model.backbone.vocabulary_size / jax.device_count())
    log(f"--max-batch-size auto: {size} on {device.device_kind}: a row's KV cache is {row / 2**20:,.1f} MiB over "
        f"{args.length_buckets[-1]} positions; {free / 2**30:.2f} GiB free after the weights, adapters and the "
        f"prefix pool ({pool / 2**20:,.0f} MiB)" + (f"; batch {size * 2} would need {need / 2**30:.2f} GiB"
                                                     if size < AUTO_BATCH_CAP else f" (capped at {AUTO_BATCH_CAP})"))
    return size


def fitting_batch_size(free_bytes, row_bytes, vocabulary, headroom=0.15, cap=AUTO_BATCH_CAP):
    """(the largest power of two up to `cap` whose decoding fits `free_bytes`, the bytes the next size up
    would need). Decoding batch b holds its cache and, while it grows in place, the next smaller one's
    (1.5 caches), and per row a step's float32 logits with the sampler's copies of them and the penalties'
    counts (6 x vocabulary x 4 bytes); `headroom` of the free memory is left for XLA's other temporaries."""
    def need(batch):
        return 1.5 * batch * row_bytes + 6 * 4 * batch * vocabulary
    size = 1
    while size * 2 <= cap and need(size * 2) <= (1 - headroom) * free_bytes:
        size *= 2
    return size, need(size * 2)


def adapter_slots_for(server, model, distribution):
    """The adapter slots, with every --adapter read, checked and loaded (None when none are asked for)."""
    args, shapes = server.args, server.kernel_shapes
    if not args.adapter and not args.enable_lora:
        return None
    import jax
    pieces = pieces_of(model.preprocessor.tokenizer)
    adapters = []
    for name, path in args.adapter.items():
        try:
            if name in server.base_names:
                raise AdapterError(f"{name} is the base model's name: give the adapter another")
            if not shapes:
                raise AdapterError(f"{type(model.backbone).__name__} is not a Gemma decoder this server can adapt")
            adapters.append(read_adapter(name, path, model.backbone, shapes, pieces))
        except AdapterError as e:
            raise LoadError(f"--adapter {name}={path}: {e}") from None
    modules = args.lora_modules or sorted(set(DEFAULT_LORA_MODULES).union(*(a.modules for a in adapters)))
    replicated = None if distribution is None else jax.sharding.NamedSharding(
        distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec())
    slots = AdapterSlots(model.backbone, shapes, modules, args.max_adapters, args.max_lora_rank,
                         put=lambda tree: jax.device_put(tree, replicated))
    for adapter in adapters:
        try:
            slots.load(adapter)
        except AdapterError as e:
            raise LoadError(f"--adapter {adapter.name}={adapter.path}: {e}") from None
        log(f"adapter {adapter.name}: slot {adapter.slot}, {describe(adapter)}")
    return slots


def describe(adapter):
    return (f"{adapter.kind} LoRA from {adapter.path}, rank {adapter.rank} on {','.join(adapter.modules)}, "
            f"{adapter.nbytes / 2**20:,.2f} MiB")


def load(server):
    """Loads and warms the model on a background thread while /health answers 503."""
    args = server.args
    try:
        import jax.monitoring
        start_backend()
        import keras_hub  # noqa: F401  (its imports, in the memory table)
        server.memory.stage("imports")
        if args.compile_cache:
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compile_cache))
            # Every program, however quick to compile, so that a restart loads them all. XLA's cache key is the
            # program itself (shapes, dtypes, adapter slots, flags baked in) with the compiler's version: a
            # changed model, dtype or flag makes a new program, never a stale hit. Weights are inputs.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            watch_xla_cache()
        on_compilation(count_compilation)
        distribution, batch_axis = setup_distribution(args)
        log(f"imports and the {jax.default_backend()} runtime: {time.time() - server.started:.1f}s after launch")
        programs = Path(args.compile_cache).expanduser() / "programs" if args.compile_cache else None
        prefetch = Prefetch(programs, args) if programs else None
        if prefetch is not None and prefetch.jobs:
            log(f"program store: loading the {len(prefetch.jobs)} programs the last start needed to be ready, while "
                f"the model loads")
        started = time.time()
        model, dtype, server.kernel_shapes = load_model(args, server.memory, alone=True)
        server.template = read_prompt_template(args.model, pieces_of(model.preprocessor.tokenizer))
        METRICS.weight_bytes = sum(v.value.nbytes for v in model.weights)
        METRICS.weights = {"dtype": dtype, "quantize": args.quantize}
        log(f"model: {type(model).__name__} from {args.model} loaded in {time.time() - started:.1f}s: {dtype}"
            f"{'' if args.quantize == 'none' else ' with ' + args.quantize + ' weights'}, "
            f"weights {METRICS.weight_bytes / 2**20:,.1f} MiB")
        if not server.advance("warming"):
            return
        server.adapters = adapter_slots_for(server, model, distribution)
        if args.max_batch_size is None:
            args.max_batch_size = auto_batch_size(model, args)
        engine = Engine(model, batch_buckets(args.max_batch_size, batch_axis, args.batch_sizes), args.length_buckets,
                        distribution, adapters=server.adapters, prefix_blocks=args.prefix_cache_blocks,
                        block_tokens=args.prefix_block_tokens)
        if engine.prefix is not None:
            METRICS.prefix_bytes, METRICS.prefix_blocks = engine.prefix.pool_bytes, engine.prefix.blocks
            METRICS.prefix_used = engine.prefix.used
        server.memory.stage("adapters and pool")
        server.memory.held = [("weights", METRICS.weight_bytes)] + [
            (f"KV cache batch {batch}", cache_bytes(model, batch, engine.max_length)) for batch in engine.batch_buckets]
        if engine.prefix is not None:
            server.memory.held.append(("prefix pool", engine.prefix.pool_bytes))
        if server.adapters is not None:
            server.memory.held.append((f"{server.adapters.max_adapters} adapter slots",
                                       server.adapters.slot_bytes * server.adapters.max_adapters))
        server.vocabulary = (model.preprocessor.tokenizer, engine.vocabulary_size, engine.stop_ids)
        started = time.time()
        store = ProgramStore(programs, engine, prefetch) if programs else None
        server.warm_up = WarmUp(engine, store=store)
        METRICS.warm_up_pending = lambda: len(server.warm_up.pending)
        server.warm_up.first()
        release_freed_memory()
        server.memory.stage("warm-up")
        server.engine = engine
        if args.max_queue is None:
            args.max_queue = auto_max_queue(engine.batch_buckets[-1])
            log(f"--max-queue auto: {args.max_queue} (twice the largest batch, at least {MIN_QUEUE})")
        server.worker = Worker(engine, engine.batch_buckets[-1], args.batch_window_ms / 1000, args.max_queue)
        server.worker.start()
        if not server.advance("ready"):
            return
        log(f"ready on {where(args)} after {time.time() - server.started:.1f}s"
            f"{', compiling the rest in the background' if server.warm_up.pending else ''}")
        try:
            server.warm_up.rest()  # each part serves as soon as it is compiled
        except Exception as e:  # what is compiled keeps serving; the rest stays listed as compiling
            log(f"error: the background warm-up stopped: {type(e).__name__}: {e}")
            return
        if store is not None:
            store.remember(prefetch.early, server.warm_up.first_names)
        server.warm_up.build.drop_tracing()
        log(f"warm-up: {len(engine.batch_buckets)} batch sizes x {len(engine.length_buckets)} windows, "
            f"{server.warm_up.build.counts()}; {METRICS.compilations} XLA compilations in all "
            f"({METRICS.compile_cache_hits} from the compilation cache) in {time.time() - started:.1f}s")
        release_freed_memory()
        server.memory.stage("background warm-up")
        for line in server.memory.lines():
            log(line)
    except LoadError as e:
        log(f"error: {e}")
        server.advance("unloadable")
        os.kill(os.getpid(), signal.SIGTERM)
    except Exception as e:
        log(f"error: could not serve {args.model}: {type(e).__name__}: {e}")
        server.advance("failed")
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv=None):
    args = parse_args(argv)
    keep_unused_imports_out(args.model)  # before anything imports keras-hub
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a server that hangs is waiting on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.modules.setdefault("matplotlib", None)  # Keras imports pyplot when it is installed; nothing here draws
    check_model_exists(args.model)
    check_adapters_exist(args)
    server = Server(args)
    if not args.uds and args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log(f"warning: listening on {args.host} without --api-key: anyone who can reach this port can use it")
    try:
        httpd = Listener(server)
    except BindError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    METRICS.open_connections = httpd.open_connections
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    log(f"listening on {where(args)}; loading {args.model} (/health is 503 until ready)")
    loader = threading.Thread(target=load, args=(server,), daemon=True, name="loader")
    loader.start()
    while not stop.wait(0.5):
        pass  # a wait with no timeout sleeps through a signal another thread took: Python runs handlers here
    with server.lock:
        failed = {"failed": 1, "unloadable": 2}.get(server.state, 0)
        server.state = "shutting_down"
    log("shutting down: no new connections; finishing in-flight requests")
    httpd.shutdown()
    deadline = time.time() + args.shutdown_timeout
    while time.time() < deadline and (server.in_flight or (server.worker and not server.worker.idle())):
        time.sleep(0.05)
    httpd.server_close()
    log("stopped")
    # Nothing is left to save, and finalising the interpreter with threads inside XLA can abort it (seen on a
    # TPU mid-warm-up: "terminate called ...", SIGABRT, a core dump) or wait on them: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(failed)


if __name__ == "__main__":
    sys.exit(main())
