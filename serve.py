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

This file is the command and the story of a run: its flags, then main() binds the socket (the front end,
gemma_lora/frontend/, answers /health with 503 meanwhile) and load() builds the engine (gemma_lora/engine/)
on a thread: the model, the adapter slots, the Engine, the warm-up, the worker. The two halves meet in
gemma_lora/interface.py: a Generation goes in through EngineCore, its events come out.
"""
import argparse
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

from gemma_lora.adapters import AdapterError, LORA_MODULES, adapter_kind, parse_lora_modules
from gemma_lora.chat import read_prompt_template
from gemma_lora.engine.compilation import Prefetch, ProgramStore, count_compilation, on_compilation, watch_xla_cache
from gemma_lora.engine.core import (EngineCore, MIN_QUEUE, adapter_slots_for, auto_batch_size, auto_max_queue,
                                    batch_buckets, setup_distribution)
from gemma_lora.engine.engine import Engine
from gemma_lora.engine.programs import cache_bytes
from gemma_lora.engine.warmup import WarmUp
from gemma_lora.frontend.http import BindError, Listener, where
from gemma_lora.frontend.server import Server
from gemma_lora.interface import SAMPLER_DEFAULTS
from gemma_lora.log import log
from gemma_lora.memory import release_freed_memory
from gemma_lora.metrics import METRICS
from gemma_lora.model import LoadError, keep_unused_imports_out, load_model, start_backend
from gemma_lora.tokens import pieces_of


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
        model, dtype, kernel_shapes = load_model(args, server.memory, alone=True)
        server.template = read_prompt_template(args.model, pieces_of(model.preprocessor.tokenizer))
        METRICS.weight_bytes = sum(v.value.nbytes for v in model.weights)
        METRICS.weights = {"dtype": dtype, "quantize": args.quantize}
        log(f"model: {type(model).__name__} from {args.model} loaded in {time.time() - started:.1f}s: {dtype}"
            f"{'' if args.quantize == 'none' else ' with ' + args.quantize + ' weights'}, "
            f"weights {METRICS.weight_bytes / 2**20:,.1f} MiB")
        if not server.advance("warming"):
            return
        adapters = adapter_slots_for(args, model, kernel_shapes, server.base_names, distribution)
        if args.max_batch_size is None:
            args.max_batch_size = auto_batch_size(model, args)
        engine = Engine(model, batch_buckets(args.max_batch_size, batch_axis, args.batch_sizes), args.length_buckets,
                        distribution, adapters=adapters, prefix_blocks=args.prefix_cache_blocks,
                        block_tokens=args.prefix_block_tokens)
        if engine.prefix is not None:
            METRICS.prefix_bytes, METRICS.prefix_blocks = engine.prefix.pool_bytes, engine.prefix.blocks
            METRICS.prefix_used = engine.prefix.used
        server.memory.stage("adapters and pool")
        server.memory.held = [("weights", METRICS.weight_bytes)] + [
            (f"KV cache batch {batch}", cache_bytes(model, batch, engine.max_length)) for batch in engine.batch_buckets]
        if engine.prefix is not None:
            server.memory.held.append(("prefix pool", engine.prefix.pool_bytes))
        if adapters is not None:
            server.memory.held.append((f"{adapters.max_adapters} adapter slots",
                                       adapters.slot_bytes * adapters.max_adapters))
        server.vocabulary = (model.preprocessor.tokenizer, engine.vocabulary_size, engine.stop_ids)
        started = time.time()
        store = ProgramStore(programs, engine, prefetch) if programs else None
        warm_up = WarmUp(engine, store=store)
        server.core = EngineCore(engine, warm_up, adapters, kernel_shapes)
        METRICS.warm_up_pending = lambda: len(warm_up.pending)
        warm_up.first()
        release_freed_memory()
        server.memory.stage("warm-up")
        if args.max_queue is None:
            args.max_queue = auto_max_queue(engine.batch_buckets[-1])
            log(f"--max-queue auto: {args.max_queue} (twice the largest batch, at least {MIN_QUEUE})")
        server.core.start(args.max_queue, args.batch_window_ms / 1000)
        if not server.advance("ready"):
            return
        log(f"ready on {where(args)} after {time.time() - server.started:.1f}s"
            f"{', compiling the rest in the background' if warm_up.pending else ''}")
        try:
            warm_up.rest()  # each part serves as soon as it is compiled
        except Exception as e:  # what is compiled keeps serving; the rest stays listed as compiling
            log(f"error: the background warm-up stopped: {type(e).__name__}: {e}")
            return
        if store is not None:
            store.remember(prefetch.early, warm_up.first_names)
        warm_up.build.drop_tracing()
        log(f"warm-up: {len(engine.batch_buckets)} batch sizes x {len(engine.length_buckets)} windows, "
            f"{warm_up.build.counts()}; {METRICS.compilations} XLA compilations in all "
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
    while time.time() < deadline and (server.in_flight or (server.core and not server.core.idle())):
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
