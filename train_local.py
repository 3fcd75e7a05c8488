"""LoRA fine-tuning of Gemma on Dolly-15k with Keras 3 + KerasHub on JAX.

Run with no flags it does what the article does: the first 1000 Dolly records formatted as
"Instruction:\\n…\\n\\nResponse:\\n…", Gemma 2B from hf://google/gemma-2b, rank-16 LoRA, 512-token
sequences, AdamW 5e-5, batch 4, one epoch, a Keras preset saved to ./gemma-2b-dolly-lora.

What it does better without changing what is trained: examples are grouped into a few fixed
sequence-length buckets so short examples do not pay for 512 positions; the loss it prints is the
true per-token loss; a crash never leaves a half-written model; progress, truncation and
throughput are reported honestly. Options that change what is trained are flags (see --help).

    python3 train_local.py                                   # the article's run
    python3 train_local.py --model DIR --data FILE.jsonl     # offline, any Gemma preset
"""
import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gemma_lora.adapters import (AdapterError, DEFAULT_LORA_MODULES, LORA_MODULES, keras_lora_scale, lora_kernel_shapes,
                                 lora_layer, parse_lora_modules, read_keras_adapter)
from gemma_lora.chat import ChatError, TEMPLATES, ToolRequest, parse_messages, render_chat, tools_prompt
from gemma_lora.memory import one_collection_after, release_freed_memory
from gemma_lora.model import explain_load_error, keep_unused_imports_out, layout_map_for, load_causal_lm
from gemma_lora.tokens import make_text_codec

os.environ.setdefault("KERAS_BACKEND", "jax")

DOLLY_URL = ("https://huggingface.co/datasets/databricks/databricks-dolly-15k/resolve/main/"
             "databricks-dolly-15k.jsonl")
RUN_RECORD = "training.json"
EXPORTS = ("peft", "transformers")
ADAPTER_FILE = "adapter.lora.h5"
CHECKPOINT_FILE = "checkpoint.npz"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the article's settings")
    g.add_argument("--model", default="hf://google/gemma-2b",
                   help="keras-hub preset: hf://…, kaggle://…, a built-in name such as gemma2_2b_en, a local "
                        "Keras preset dir, or a local transformers-layout dir (default: %(default)s)")
    g.add_argument("--data", default=DOLLY_URL, help="JSONL URL or local path (default: Dolly-15k)")
    g.add_argument("--limit", type=int, default=1000, help="train on the first N records; 0 = all (default: 1000)")
    g.add_argument("--output", default="./gemma-2b-dolly-lora", help="where the model goes (default: %(default)s)")
    g.add_argument("--lora-rank", type=int, default=16)
    g.add_argument("--sequence-length", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=4, help="global batch size (default: 4)")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--learning-rate", type=float, default=5e-5)

    g = p.add_argument_group("what is trained (each changes the result; defaults are the article's)")
    g.add_argument("--data-format", choices=["auto", *DATA_FORMATS], default="auto",
                   help="dolly: instruction/response records (the article's); messages: chat conversations "
                        "{\"messages\": [{\"role\", \"content\"}, ...]} as OpenAI and TRL have them; "
                        "prompt-completion: {\"prompt\", \"completion\"}, the prompt as is; text: {\"text\"}, plain "
                        "language modelling. auto (default) decides from the first good record. JSONL or a JSON array")
    g.add_argument("--template", choices=sorted(TEMPLATES), default="article",
                   help="prompt format for dolly and messages records: 'article' (Instruction:/Response:) or "
                        "'gemma-chat' (Gemma's <start_of_turn> turns, answers end with <end_of_turn>); recorded "
                        "for serve.py")
    g.add_argument("--use-context", action="store_true",
                   help="put Dolly's context into the prompt under a 'Context:' heading")
    g.add_argument("--loss-on", choices=["all", "response", "assistant"], default=None,
                   help="'all': every token; 'response' (or 'assistant'): only the answers (Dolly's response, the "
                        "completion, the assistant turns) and their end. Default: all for dolly (the article) and "
                        "text, the answers for messages and prompt-completion")
    g.add_argument("--instruction-field", default="instruction")
    g.add_argument("--context-field", default="context")
    g.add_argument("--response-field", default="response")
    g.add_argument("--lora-modules", default=",".join(DEFAULT_LORA_MODULES),
                   help="projections that get a LoRA adapter, by PEFT's names: any of " + ",".join(LORA_MODULES) +
                        ", or all-linear for all seven (default: %(default)s, the article's)")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA scale numerator: updates are scaled alpha/rank (default: the rank, scale 1, the article's)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "mixed_bfloat16"], default=None,
                   help="weights/compute precision (default: whatever the preset loads as, like the article)")
    g.add_argument("--quantize", choices=["none", "int8", "int4"], default="none",
                   help="QLoRA: freeze the base with its dense layers in int8/int4 (LoRA weights stay float32); "
                        "the saved preset merges the adapter into the original-dtype base (default: none)")
    g.add_argument("--seed", type=int, default=0, help="data order and LoRA initialisation (default: 0)")
    g.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps; 0 = no cap")

    g = p.add_argument_group("optimisation (defaults are the article's: AdamW, constant learning rate)")
    g.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="constant",
                   help="learning rate after the warm-up: constant, or decaying to 0 at the last step linearly or "
                        "along a half cosine (Hugging Face's schedules) (default: constant)")
    g.add_argument("--warmup-steps", type=int, default=0,
                   help="learning rate rises linearly from 0 over the first N optimizer steps (default: 0)")
    g.add_argument("--gradient-accumulation", type=int, default=1,
                   help="one optimizer step per N batches of --batch-size, equal to one step on all their tokens "
                        "(default: 1)")
    g.add_argument("--max-grad-norm", type=float, default=None,
                   help="clip the gradient to this global norm (default: no clipping, like the article)")
    g.add_argument("--weight-decay", type=float, default=0.004,
                   help="AdamW's decoupled weight decay (default: 0.004, Keras's AdamW default the article used)")

    g = p.add_argument_group("evaluation, data hygiene, speed")
    g.add_argument("--eval-examples", type=int, default=100,
                   help="held-out records after the training slice, scored on response tokens before and "
                        "after training; 0 disables (default: 100)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed JSONL lines instead of stopping")
    g.add_argument("--buckets", default="auto",
                   help="comma-separated sequence-length buckets, each compiled once; 'auto' = L/4,L/2,L; "
                        "pass just the sequence length to pad everything to it like the article")
    g.add_argument("--eval-every", type=int, default=0,
                   help="also measure the held-out loss every N optimizer steps (logged, in training.json and "
                        "loss.png); 0 = only before and after training (default: 0)")
    g.add_argument("--keep-best", action="store_true",
                   help="publish the step with the lowest held-out loss (needs --eval-every), not the last")
    g.add_argument("--remat", action="store_true",
                   help="gradient checkpointing: recompute each decoder block's activations in the backward pass, "
                        "trading compute for memory (same result)")
    g.add_argument("--compile-cache", default=str(Path.home() / ".cache" / "gemma-lora-xla"),
                   help="JAX persistent compilation cache dir; '' disables (default: %(default)s)")

    g = p.add_argument_group("output safety")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --output (atomically, at the end)")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a resumable checkpoint every N steps (Ctrl-C always saves one)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint of an interrupted run")

    g = p.add_argument_group("export (for the Hugging Face stack, vLLM, llama.cpp)")
    g.add_argument("--export", default="",
                   help="also write OUTPUT/peft (a PEFT LoRA adapter for the same base in transformers layout) "
                        "and/or OUTPUT/transformers (the merged model); a comma list: peft,transformers")
    g.add_argument("--export-only", action="store_true",
                   help="export the existing --output (see --export) without training again")

    g = p.add_argument_group("distribution (write once, scale everywhere)")
    g.add_argument("--distribution", choices=["auto", "off", "data", "model"], default="auto",
                   help="auto: data parallel when there is more than one device, else off")
    g.add_argument("--mesh", default=None,
                   help="B,M device mesh for --distribution model (default: 1,<all devices>)")
    g.add_argument("--coordinator-address", default=None, help="multi-host: host:port of process 0")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    args = p.parse_args(argv)
    for name in ("lora_rank", "sequence_length", "batch_size", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("limit", "eval_examples", "max_steps", "checkpoint_every", "warmup_steps", "eval_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    if args.gradient_accumulation < 1:
        p.error("--gradient-accumulation must be at least 1")
    for name in ("lora_alpha", "max_grad_norm"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.weight_decay < 0:
        p.error("--weight-decay must not be negative")
    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        p.error(f"--lora-modules: {e}")
    if args.lora_alpha is None:
        args.lora_alpha = float(args.lora_rank)
    if args.keep_best and not args.eval_every:
        p.error("--keep-best needs --eval-every N (and held-out records: --eval-examples)")
    if args.eval_every and not args.eval_examples:
        p.error("--eval-every needs held-out records: --eval-examples N")
    args.export = [f.strip() for f in args.export.split(",") if f.strip()]
    if set(args.export) - set(EXPORTS):
        p.error(f"--export {','.join(args.export)}: choose from {','.join(EXPORTS)}")
    if args.export_only and not args.export:
        p.error("--export-only needs --export peft, transformers or peft,transformers")
    return args


class UserError(Exception):
    """A problem the user can fix: printed as one clear message, no traceback."""


IS_MAIN_PROCESS = True  # only process 0 of a multi-host run prints and writes


def log(*parts):
    if IS_MAIN_PROCESS:
        print(*parts, flush=True)


# ----------------------------------------------------------------------------- data
# Every record becomes a list of (text, kind) segments, tokenized one by one and joined: "prompt" is
# what the template and the user put there, "answer" is what the model is taught to say, "context" is
# an answer it sees but is not taught (an assistant message with "weight": 0). --loss-on decides what
# a prompt weighs; answers always weigh 1 and context 0.

DATA_FORMATS = ("dolly", "messages", "prompt-completion", "text")


class BadRecord(Exception):
    """What is wrong with one record, in a few words."""


def fetch(source):
    """Returns a local path for `source`, downloading a URL once (atomically) and reusing it after."""
    if not source.startswith(("http://", "https://")):
        if not Path(source).is_file():
            raise UserError(f"--data {source}: no such file")
        return Path(source)
    path = Path(source.rsplit("/", 1)[-1].split("?")[0] or "dataset.jsonl")
    if path.is_file():
        log(f"data: reusing {path} (delete it to download again)")
        return path
    partial = path.with_name(path.name + ".part")
    log(f"data: downloading {source}")
    try:
        with urllib.request.urlopen(source, timeout=60) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done, last_report = 0, 0.0
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if time.time() - last_report > 1 or done == total:
                    last_report = time.time()
                    show_download_progress(done, total)
        os.replace(partial, path)
        log("")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        partial.unlink(missing_ok=True)
        raise UserError(f"could not download {source}: {e}. Without network, pass a local JSONL "
                        f"file: --data path/to/data.jsonl") from None
    return path


def show_download_progress(done, total):
    if IS_MAIN_PROCESS:
        pct = f" {100 * done / total:5.1f}%" if total else ""
        print(f"\r  downloaded {done / 1e6:8.1f} MB{pct}", end="", flush=True)


def json_records(path):
    """Yields (where, record or BadRecord) for a JSONL file ("file:LINE") or a JSON array ("file[INDEX]").
    Hugging Face's to_json writes JSONL into .json files, so the content decides, not the name."""
    with open(path, encoding="utf-8", errors="strict") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not a valid JSON array ({e.msg} at line {e.lineno} column {e.colno})") from None
        for index, record in enumerate(records):
            yield f"{path}[{index}]", record
        return
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{line_number}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{line_number}", BadRecord(f"not valid JSON ({e.msg})")


def detect_format(record, args):
    """The format a record's fields say it is in (--data-format auto), or None."""
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    if "text" in record:
        return "text"
    if args.instruction_field in record and args.response_field in record:
        return "dolly"
    return None


def string_field(record, field):
    if field not in record:
        raise BadRecord(f"missing field '{field}'")
    if not isinstance(record[field], str):
        raise BadRecord(f"field '{field}' is {type(record[field]).__name__}, not a string")
    return record[field]


def format_prompt(record, args):
    template = TEMPLATES[args.template]
    context = record.get(args.context_field) or "" if args.use_context else ""
    if context:
        return template["prompt_with_context"].format(instruction=record[args.instruction_field], context=context)
    return template["prompt"].format(instruction=record[args.instruction_field])


def dolly_example(record, args):
    """The article's instruction/response pair in the template (Dolly's field names, or --*-field)."""
    string_field(record, args.instruction_field)
    response = string_field(record, args.response_field)
    context = record.get(args.context_field, "")
    if args.use_context and context is not None and not isinstance(context, str):
        raise BadRecord(f"field '{args.context_field}' is {type(context).__name__}, not a string")
    return [(format_prompt(record, args), "prompt"),
            (response + TEMPLATES[args.template]["response_suffix"], "answer")]


def record_tools(record):
    """The functions of a record's `tools` column (a list, or a JSON string of one, of OpenAI function specs),
    or None."""
    tools = record.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadRecord("'tools' is a string that is not JSON") from None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRecord("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", \"parameters\"?}}")
    return tools


def messages_example(record, args, messages=None):
    """A conversation (OpenAI fine-tuning files, TRL's conversational data sets), rendered by the very
    renderer serve.py's chat completions use, so it tokenizes the same in training and serving. A `tools`
    column is described first, as serve.py describes a request's tools."""
    if messages is None:
        if "messages" not in record:
            raise BadRecord("missing field 'messages'")
        messages = record["messages"]
    tools = record_tools(record)
    if tools and isinstance(messages, list):
        request = ToolRequest([t["function"] for t in tools], True, True)
        messages = [{"role": "system", "content": tools_prompt(tools, request)}] + messages
    try:
        parsed = parse_messages(messages)
        segments = render_chat(parsed, TEMPLATES[args.template], last_role="assistant")
    except ChatError as e:
        raise BadRecord(str(e)) from None
    if args.loss_on != "all" and not any(weight == 1 for role, _, weight in parsed if role == "assistant"):
        raise BadRecord("every assistant message has weight 0: nothing to learn")
    return [(text, "prompt" if weight is None else "answer" if weight else "context") for text, weight in segments]


def prompt_completion_example(record, args):
    """TRL's prompt/completion pairs: the prompt as it is (no template), the completion taught. Both may
    be lists of chat messages instead (TRL's conversational form): then the prompt's answers are context."""
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        context = [dict(m, weight=0) if isinstance(m, dict) and m.get("role") == "assistant" else m for m in prompt]
        return messages_example(record, args, context + completion)
    return [(string_field(record, "prompt"), "prompt"), (string_field(record, "completion"), "answer")]


def text_example(record, args):
    """Plain language modelling: every token taught."""
    return [(string_field(record, "text"), "answer")]


EXAMPLE_MAKERS = {"dolly": dolly_example, "messages": messages_example,
                  "prompt-completion": prompt_completion_example, "text": text_example}


def read_examples(path, args):
    """Yields the examples of the good records, in order, deciding --data-format auto from the first
    good one (args.data_format is set to what it found); raises UserError naming the first bad record,
    or skips and counts it (read_examples.skipped) with --skip-bad-lines."""
    read_examples.skipped = 0
    for where, record in json_records(path):
        try:
            if isinstance(record, BadRecord):
                raise record
            if not isinstance(record, dict):
                raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
            if args.data_format == "auto":
                found = detect_format(record, args)
                if found is None:
                    raise BadRecord("its fields fit no format: expected 'messages', 'prompt' and 'completion', "
                                    f"'text', or '{args.instruction_field}' and '{args.response_field}'")
                args.data_format = found
                resolve_loss_on(args)
                log(f"data: format {found} (--data-format auto, from the fields of {where})")
            example = EXAMPLE_MAKERS[args.data_format](record, args)
        except BadRecord as problem:
            if not args.skip_bad_lines:
                raise UserError(f"{where}: {problem}. Fix the record or pass --skip-bad-lines.") from None
            read_examples.skipped += 1
            continue
        yield example


def resolve_loss_on(args):
    """--loss-on's default for the format: every token for Dolly records (the article) and plain text,
    the answers for conversations and prompt/completion pairs (as TRL does)."""
    if args.loss_on is None:
        args.loss_on = {"dolly": "all", "text": "all"}.get(args.data_format, "response")
    if args.loss_on == "assistant":
        args.loss_on = "response"  # one meaning: the answers (Dolly's response, a completion, assistant turns)


def load_data(args):
    """Returns (train, eval) lists of examples: the first --limit records, then the held-out ones."""
    path = fetch(args.data)
    if args.data_format != "auto":
        resolve_loss_on(args)
    limit = args.limit or math.inf
    train, held_out = [], []
    for example in read_examples(path, args):
        if len(train) < limit:
            train.append(example)
        elif len(held_out) < args.eval_examples:
            held_out.append(example)
        else:
            break
    if not train:
        raise UserError(f"{path}: no usable records")
    if read_examples.skipped:
        log(f"data: skipped {read_examples.skipped} bad records (--skip-bad-lines)")
    if args.eval_examples and len(held_out) < args.eval_examples:
        log(f"data: only {len(held_out)} records remain after the training slice; evaluating on those"
            if held_out else "data: no records remain after the training slice; evaluation disabled")
    log(f"data: {len(train)} training records, {len(held_out)} held-out eval records from {path}")
    if args.data_format == "messages" and args.template == "article" and \
            any(sum(kind != "prompt" for _, kind in example) > 1 for example in train):
        log("note: the article template has no end-of-turn marker, so only a conversation's last answer "
            "teaches the model to stop; --template gemma-chat marks every turn's end")
    return train, held_out


# ----------------------------------------------------------------------------- tokens


def tokenize(examples, encode, tokenizer, sequence_length, loss_on):
    """Each example becomes (token_ids, weights) with len(token_ids) <= sequence_length + 1.

    token_ids = <bos> segment... <eos>, like keras-hub's Gemma preprocessor; each segment is encoded on
    its own, so a prompt's tokens are those serve.py sees for it. weights[i] says whether predicting
    token_ids[i+1] counts towards the loss: answers 1, context 0, prompts 1 only with --loss-on all, and
    <eos> 1 when the example ends with an answer. A truncated example loses its <eos>, so the model is
    never taught to stop mid-answer.
    """
    import numpy as np
    bos, eos = tokenizer.start_token_id, tokenizer.end_token_id
    weight_of = {"prompt": float(loss_on == "all"), "answer": 1.0, "context": 0.0}
    out, truncated, tokens_cut = [], 0, 0
    for segments in examples:
        ids, weights = [bos], []
        for text, kind in segments:
            piece = encode(text)
            ids += piece
            weights += [weight_of[kind]] * len(piece)
        ids.append(eos)
        weights.append(float(segments[-1][1] == "answer"))
        weights = np.asarray(weights, np.float32)
        if len(ids) > sequence_length + 1:
            truncated += 1
            tokens_cut += len(ids) - (sequence_length + 1)
            ids, weights = ids[: sequence_length + 1], weights[:sequence_length]
        out.append((np.asarray(ids, np.int32), weights))
    return out, truncated, tokens_cut


def parse_buckets(spec, sequence_length):
    if spec == "auto":
        sizes = {max(8, sequence_length // 4), max(8, sequence_length // 2), sequence_length}
    else:
        try:
            sizes = {int(s) for s in spec.split(",") if s.strip()}
        except ValueError:
            raise UserError(f"--buckets {spec!r}: expected comma-separated integers") from None
        sizes = {min(s, sequence_length) for s in sizes if s > 0} | {sequence_length}
    return sorted(sizes)


def bucket_for(length, buckets):
    return next(b for b in buckets if b >= length)


def make_batches(examples, buckets, batch_size, rng):
    """Groups examples by bucket into batches of exactly batch_size rows, in a shuffled order.

    Every example appears exactly once; a bucket's last batch is filled with empty rows (zero
    weight), so no example is dropped or split and every shape is one that was compiled.
    """
    by_bucket = {}
    for index in rng.permutation(len(examples)):
        by_bucket.setdefault(bucket_for(len(examples[index][0]) - 1, buckets), []).append(int(index))
    batches = [(bucket, indices[i: i + batch_size])
               for bucket, indices in sorted(by_bucket.items())
               for i in range(0, len(indices), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(examples, indices, length, batch_size, pad_id):
    """(token_ids, padding_mask, labels, weights), each [batch_size, length]."""
    import numpy as np
    token_ids = np.full((batch_size, length), pad_id, np.int32)
    padding_mask = np.zeros((batch_size, length), bool)
    labels = np.full((batch_size, length), pad_id, np.int32)
    weights = np.zeros((batch_size, length), np.float32)
    for row, index in enumerate(indices):
        ids, w = examples[index]
        n = len(ids) - 1
        token_ids[row, :n], padding_mask[row, :n] = ids[:-1], True
        labels[row, :n], weights[row, :n] = ids[1:], w
    return token_ids, padding_mask, labels, weights


# ----------------------------------------------------------------------------- model & devices

COMPILE_CACHE_HITS = [0]  # programs loaded from the persistent compilation cache (warm_up says which)


def setup_runtime(args):
    global IS_MAIN_PROCESS
    import jax
    import jax.monitoring
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compile_cache))
        # Every program, however quick to compile, so that a second run loads them all. XLA's cache key is
        # the program itself (shapes, dtypes, flags baked in) with the compiler's version: a changed model,
        # dtype or flag makes a new program, never a stale hit. The weights are inputs, not part of it.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.monitoring.register_event_listener(lambda event, **_: COMPILE_CACHE_HITS.__setitem__(
            0, COMPILE_CACHE_HITS[0] + 1) if event.endswith("/cache_hits") else None)
    import keras
    explicit = any(v is not None for v in (args.coordinator_address, args.num_processes, args.process_id)) or \
        any(os.environ.get(f"KERAS_DISTRIBUTION_{k}") for k in ("JOB_ADDRESSES", "NUM_PROCESSES", "PROCESS_ID"))
    if explicit:
        keras.distribution.initialize(args.coordinator_address, args.num_processes, args.process_id)
    elif on_cloud_tpu_vm():
        try:  # JAX finds the pod slice's hosts itself; on a single-host TPU VM this is one process
            keras.distribution.initialize()
        except Exception as e:
            print(f"note: multi-host initialisation skipped ({e}); running as a single process", flush=True)
    IS_MAIN_PROCESS = jax.process_index() == 0


def on_cloud_tpu_vm():
    import glob
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def setup_distribution(args, preset):
    """Sets the global keras distribution before any variable exists. Returns (mode, distribution)."""
    import keras
    devices = keras.distribution.list_devices()
    mode = args.distribution
    if mode == "auto":
        mode = "data" if len(devices) > 1 else "off"
    if mode == "off":
        return mode, None
    if mode == "data":
        distribution = keras.distribution.DataParallel(devices=devices)
        batch_axis = len(devices)
    else:
        batch_axis, model_axis = parse_mesh(args.mesh, len(devices))
        mesh = keras.distribution.DeviceMesh(shape=(batch_axis, model_axis), axis_names=("batch", "model"),
                                             devices=devices)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map_for(preset, mesh, model_axis),
            batch_dim_name="batch")
    if args.batch_size % batch_axis:
        raise UserError(f"--batch-size {args.batch_size} does not divide over the {batch_axis} devices of the "
                        f"batch axis; use a multiple of {batch_axis}")
    keras.distribution.set_distribution(distribution)
    log(f"distribution: {mode} over {len(devices)} {devices[0].split(':')[0]} devices"
        + (f", mesh batch={batch_axis} model={len(devices) // batch_axis}" if mode == "model" else ""))
    return mode, distribution


def parse_mesh(spec, n_devices):
    if spec is None:
        return 1, n_devices
    try:
        batch_axis, model_axis = (int(s) for s in spec.split(","))
    except ValueError:
        raise UserError(f"--mesh {spec!r}: expected B,M, e.g. 2,4") from None
    if batch_axis * model_axis != n_devices:
        raise UserError(f"--mesh {spec}: {batch_axis}x{model_axis} != {n_devices} devices")
    return batch_axis, model_axis


def load_model(args):
    kwargs = {"dtype": args.dtype} if args.dtype else {}
    try:
        return load_causal_lm(args.model, **kwargs)
    except Exception as e:
        raise UserError(explain_load_error(args.model, e)) from None


def save_preset(model, out):
    """The Keras preset: config, weights and tokenizer. Without task.json and preprocessor.json, which would
    name load_causal_lm's plain preprocessor: keras-hub's from_preset then builds the task and its own
    preprocessor from the backbone and the tokenizer, as it does for a transformers-layout dir."""
    model.save_to_preset(str(out))
    for name in ("task.json", "preprocessor.json"):
        (Path(out) / name).unlink(missing_ok=True)


def quantize_base(model, mode):
    """QLoRA (the keras.io recipe): quantize the frozen base's dense layers, then enable LoRA on them.
    The embedding stays as loaded: Keras 3.15's int8 ReversibleEmbedding passes almost no gradient back
    through the output projection, and LoRA then barely learns (loss 7.7 -> 7.2 instead of -> 2.7)."""
    import keras
    started = time.time()
    try:
        with one_collection_after():
            model.backbone.quantize(mode, filters=lambda layer: isinstance(layer, (keras.layers.Dense,
                                                                                  keras.layers.EinsumDense)))
    except Exception as e:
        raise UserError(f"--quantize {mode}: {type(model.backbone).__name__} cannot be quantized so: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    release_freed_memory()
    log(f"model: base's dense layers quantized to {mode} in {time.time() - started:.1f}s; LoRA stays float32")


@contextlib.contextmanager


def enable_lora(backbone, rank, alpha, modules):
    """LoRA of rank `rank`, scaled alpha/rank, on the named projections of every decoder block; all else
    frozen. keras-hub's backbone.enable_lora picks layers by Keras name and passes no alpha, so this
    enables layer by layer, recording what backbone.save_lora_weights and load_lora_weights read."""
    targets = {id(lora_layer(backbone, i, m)) for i in range(len(backbone.transformer_layers)) for m in modules}
    backbone.trainable = True  # first: it sets every sublayer's flag too
    for layer in backbone._flatten_layers(include_self=False):
        layer.trainable = False
    backbone._lora_enabled_layers, backbone._lora_rank = [], rank
    for index, layer in enumerate([layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]):
        if id(layer) in targets:
            layer.trainable = True
            layer.enable_lora(rank, lora_alpha=alpha)
            backbone._lora_enabled_layers.append(index)


def export_peft(model_dir, backbone, base_handle):
    """model_dir/peft: the adapter as Hugging Face PEFT saves one, for the same base in transformers layout.
    Keras's query LoRA shares B across heads, so its exact PEFT form has rank heads x r; every module is
    zero-padded to that one r (vLLM ignores per-module ranks), and lora_alpha = (alpha / rank) x r keeps
    the trained scale, so PEFT computes exactly what Keras did and further training scales alike."""
    import numpy as np
    from safetensors.numpy import save_file
    factors = read_keras_adapter(model_dir / ADAPTER_FILE, backbone, lora_kernel_shapes(backbone))
    r = max(down.shape[1] for down, _ in factors.values())
    alpha = keras_lora_scale(model_dir) * r
    tensors = {}
    for (i, module), (down, up) in sorted(factors.items()):
        where = "self_attn" if LORA_MODULES[module][0] == "attention" else "mlp"
        prefix = f"base_model.model.model.layers.{i}.{where}.{module}"
        a, b = np.zeros((r, down.shape[0]), np.float32), np.zeros((up.shape[1], r), np.float32)
        a[:down.shape[1]], b[:, :up.shape[0]] = down.T, up.T
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    out = fresh_dir(model_dir / "peft")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": int(alpha) if alpha == int(alpha)
              else alpha, "lora_dropout": 0.0,
              "target_modules": sorted({m for _, m in factors}), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_handle.removeprefix("hf://")}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    publish(out, model_dir / "peft")
    return r, config["lora_alpha"], config["target_modules"]


def export_transformers(model_dir, model):
    """model_dir/transformers: the merged model and tokenizer in transformers layout. keras-hub's exporter
    reads each layer's raw kernel, so it is given the saved merged preset: an unmerged LoRA would be dropped."""
    if any(getattr(layer, "lora_enabled", False) for layer in model.backbone._flatten_layers()):
        raise UserError("export_transformers needs a merged model: keras-hub's exporter would drop the LoRA")
    out = fresh_dir(model_dir / "transformers")
    model.export_to_transformers(str(out))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    # keras-hub 0.32's Gemma exporter leaves out what from_pretrained and keras-hub's loader look for.
    config.setdefault("architectures", [{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                         "gemma3_text": "Gemma3ForCausalLM"}.get(config.get("model_type"),
                                                                                 "AutoModelForCausalLM")])
    config.setdefault("torch_dtype", model.dtype_policy.variable_dtype)
    config_path.write_text(json.dumps(config, indent=2))
    publish(out, model_dir / "transformers")


def fresh_dir(path):
    """An empty PATH.partial beside PATH, swapped into place by publish() once complete."""
    work = path.with_name(path.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def export(model_dir, formats):
    """--export: from what model_dir holds (its merged preset, adapter and record), so a finished run and
    --export-only take the same path."""
    record = json.loads((model_dir / RUN_RECORD).read_text())
    started = time.time()
    try:
        model = load_causal_lm(str(model_dir))
    except Exception as e:
        raise UserError(explain_load_error(str(model_dir), e)) from None
    if "peft" in formats:
        try:
            r, alpha, modules = export_peft(model_dir, model.backbone, record["args"]["model"])
        except AdapterError as e:
            raise UserError(f"--export peft: {e}") from None
        log(f"export: {model_dir / 'peft'} (PEFT LoRA on {','.join(modules)}, r={r}, lora_alpha={alpha}, for "
            f"{record['args']['model']})")
    if "transformers" in formats:
        export_transformers(model_dir, model)
        log(f"export: {model_dir / 'transformers'} (merged model and tokenizer, transformers layout)")
    log(f"export: done in {time.time() - started:.1f}s")


def export_only(args):
    model_dir = Path(args.output)
    if not (model_dir / RUN_RECORD).is_file() or not (model_dir / ADAPTER_FILE).is_file():
        raise UserError(f"--export-only: {model_dir} is not a train_local.py output (no {RUN_RECORD} and "
                        f"{ADAPTER_FILE}); train first, or pass --output with one")
    export(model_dir, args.export)
    return 0


def merged_on_original_base(args, adapter_path):
    """The preset to save after QLoRA: the adapter merged into the base as loaded (its original dtype).
    Merging into the quantized kernels would round a second time and lose part of what was learned."""
    model = load_model(args)
    enable_lora(model.backbone, args.lora_rank, args.lora_alpha, args.lora_modules)
    model.backbone.load_lora_weights(str(adapter_path))
    return model


def explain_oom(args):
    return ("out of accelerator memory. Try a smaller --batch-size or --sequence-length, or --dtype bfloat16 "
            f"(now: batch {args.batch_size}, sequence {args.sequence_length}, dtype {args.dtype or 'preset'}).")


# ----------------------------------------------------------------------------- training

class Trainer:
    """JAX-compiled train and eval steps over the model's variables, one program per bucket.

    Keras' fit() divides the weighted loss by every position, padding included, so the loss it
    prints shrinks as padding grows. Here the objective is sum(weight * nll) / sum(weight): the true
    per-token loss, identical whatever bucket an example is padded to. AdamW is invariant to the
    overall gradient scale, so this trains like the article while reporting honestly.

    With gradient accumulation each batch adds the gradient of its loss *sum* to a buffer, and the
    update divides by the tokens of all of them: one step on their union, not a mean of means (which
    would over-weight a batch of short answers).
    """

    def __init__(self, model, optimizer, distribution, accumulation=1):
        import jax
        import jax.numpy as jnp
        self.model, self.optimizer, self.distribution = model, optimizer, distribution
        self.accumulation = accumulation
        optimizer.build(model.trainable_variables)
        self.trainable = [v.value for v in model.trainable_variables]
        self.non_trainable = [v.value for v in model.non_trainable_variables]
        self.opt_state = [v.value for v in optimizer.variables]

        def totals(trainable, non_trainable, token_ids, padding_mask, labels, weights, training):
            x = {"token_ids": token_ids, "padding_mask": padding_mask}
            logits, _ = model.stateless_call(trainable, non_trainable, x, training=training)
            logits = logits.astype(jnp.float32)
            nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
            correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
            return (nll * weights).sum(), weights.sum(), (correct * weights).sum()

        def grads_of(trainable, non_trainable, batch, divide_by_count):
            def loss_fn(trainable):
                loss_sum, count, correct = totals(trainable, non_trainable, *batch, True)
                scale = jnp.maximum(count, 1.0) if divide_by_count else 1.0
                return loss_sum / scale, (loss_sum, count, correct)
            return jax.grad(loss_fn, has_aux=True)(trainable)

        def update(trainable, opt_state, grads):
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))  # before any clipping, as HF logs it
            trainable, opt_state = optimizer.stateless_apply(opt_state, grads, trainable)
            return trainable, opt_state, norm

        def train_step(trainable, opt_state, non_trainable, *batch):
            grads, sums = grads_of(trainable, non_trainable, batch, True)
            trainable, opt_state, norm = update(trainable, opt_state, grads)
            return trainable, opt_state, sums + (norm,)

        def accumulate_step(accumulated, trainable, non_trainable, *batch):
            grads, sums = grads_of(trainable, non_trainable, batch, False)
            return [a + g for a, g in zip(accumulated, grads)], sums

        def apply_step(trainable, opt_state, accumulated, count):
            return update(trainable, opt_state, [a / jnp.maximum(count, 1.0) for a in accumulated])

        def eval_step(trainable, non_trainable, token_ids, padding_mask, labels, weights):
            return totals(trainable, non_trainable, token_ids, padding_mask, labels, weights, False)

        # Updated weights and optimizer state must keep their shardings, or under model parallelism XLA
        # may hand them back laid out differently from what the next step was compiled for.
        weights_layout, state_layout = [v.sharding for v in self.trainable], [v.sharding for v in self.opt_state]
        self._train_step = jax.jit(train_step, donate_argnums=(0, 1),
                                   out_shardings=(weights_layout, state_layout, None))
        self._accumulate_step = jax.jit(accumulate_step, donate_argnums=(0,), out_shardings=(weights_layout, None))
        self._apply_step = jax.jit(apply_step, donate_argnums=(0, 1),
                                   out_shardings=(weights_layout, state_layout, None))
        self._zeros = jax.jit(lambda trainable: [jnp.zeros_like(v) for v in trainable], out_shardings=weights_layout)
        self._eval_step = jax.jit(eval_step)
        self.compiled_train, self.compiled_eval = {}, {}

    def put_batch(self, arrays):
        """Places a global batch on the devices, split along the batch axis when distributed."""
        import jax
        if self.distribution is None:
            return arrays
        import numpy as np
        sharding = self.distribution.get_data_layout(arrays[0].shape).backend_layout
        if jax.process_count() == 1:
            return [jax.device_put(a, sharding) for a in arrays]
        rows = arrays[0].shape[0] // jax.process_count()
        start = jax.process_index() * rows
        return [jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(a[start:start + rows]),
                                                       a.shape) for a in arrays]

    def warm_up(self, buckets, batch_size, pad_id, with_eval):
        """Compiles every program training will run, up front, and says what it compiled."""
        import numpy as np
        hits = COMPILE_CACHE_HITS[0]
        for length in buckets:
            batch = self.put_batch(collate([], [], length, batch_size, pad_id))
            started = time.time()
            if self.accumulation == 1:
                self.compiled_train[length] = self._train_step.lower(
                    self.trainable, self.opt_state, self.non_trainable, *batch).compile()
                message = f"compiled train step [{batch_size} x {length}] in {time.time() - started:.1f}s"
            else:
                self.compiled_train[length] = self._accumulate_step.lower(
                    self.trainable, self.trainable, self.non_trainable, *batch).compile()
                message = (f"compiled gradient step [{batch_size} x {length}] (accumulated over "
                           f"{self.accumulation}) in {time.time() - started:.1f}s")
            if with_eval:
                started = time.time()
                self.compiled_eval[length] = self._eval_step.lower(
                    self.trainable, self.non_trainable, *batch).compile()
                message += f", eval step in {time.time() - started:.1f}s"
            log(message)
        if self.accumulation > 1:
            self._zeros = self._zeros.lower(self.trainable).compile()
            self._apply_step = self._apply_step.lower(self.trainable, self.opt_state, self.trainable,
                                                      np.float32(1)).compile()
        if COMPILE_CACHE_HITS[0] > hits:
            log(f"compilation cache: {COMPILE_CACHE_HITS[0] - hits} of these programs loaded, not compiled")

    def train_on(self, batches):
        """One optimizer step on `batches` ([(bucket length, collated arrays)], one per accumulated batch);
        returns (loss sum, weighted tokens, correct, gradient norm) of their union."""
        import numpy as np
        if self.accumulation == 1:
            [(length, batch)] = batches
            self.trainable, self.opt_state, sums = self.compiled_train[length](
                self.trainable, self.opt_state, self.non_trainable, *self.put_batch(batch))
            return [float(s) for s in sums]
        accumulated, totals = self._zeros(self.trainable), []
        for length, batch in batches:
            accumulated, sums = self.compiled_train[length](accumulated, self.trainable, self.non_trainable,
                                                            *self.put_batch(batch))
            totals.append(sums)
        count = np.float32(sum(batch[3].sum() for _, batch in batches))  # known on the host: no round trip
        self.trainable, self.opt_state, norm = self._apply_step(self.trainable, self.opt_state, accumulated, count)
        return [sum(float(s[i]) for s in totals) for i in range(3)] + [float(norm)]

    def evaluate(self, examples, buckets, batch_size, pad_id, rng):
        """Mean loss per weighted token over `examples`."""
        loss_sum = count = 0.0
        for length, indices in make_batches(examples, buckets, batch_size, rng):
            batch = self.put_batch(collate(examples, indices, length, batch_size, pad_id))
            s, c, _ = self.compiled_eval[length](self.trainable, self.non_trainable, *batch)
            loss_sum, count = loss_sum + float(s), count + float(c)
        return loss_sum / max(count, 1.0)

    def write_back(self):
        for variable, value in zip(self.model.trainable_variables, self.trainable):
            variable.assign(value)
        for variable, value in zip(self.optimizer.variables, self.opt_state):
            variable.assign(value)

    def host_weights(self):
        import jax
        import numpy as np
        return [np.asarray(jax.device_get(v)) for v in self.trainable]

    def set_weights(self, arrays):
        import jax
        self.trainable = [jax.device_put(a, v.sharding) for a, v in zip(arrays, self.trainable)]

    def state_arrays(self):
        import numpy as np
        import jax
        host = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
        return ({f"t{i}": host(v) for i, v in enumerate(self.trainable)}
                | {f"o{i}": host(v) for i, v in enumerate(self.opt_state)})

    def load_state_arrays(self, arrays):
        import jax
        self.trainable = [jax.device_put(arrays[f"t{i}"], v.sharding) for i, v in enumerate(self.trainable)]
        self.opt_state = [jax.device_put(arrays[f"o{i}"], v.sharding) for i, v in enumerate(self.opt_state)]


def learning_rate_schedule(args, total_steps):
    """--learning-rate shaped by --warmup-steps and --lr-schedule, as a Keras schedule of the optimizer's
    step count. The shapes are Hugging Face's (get_{constant,linear,cosine}_schedule_with_warmup), so a
    TRL recipe's numbers mean the same here: the first warm-up step uses 0, decay reaches 0 at the end."""
    import keras
    from keras import ops

    class WarmupThenDecay(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            step = ops.cast(step, "float32")
            warmup, total = float(args.warmup_steps), float(total_steps)
            progress = ops.clip((step - warmup) / max(1.0, total - warmup), 0.0, 1.0)
            after = {"constant": ops.ones_like(progress), "linear": 1.0 - progress,
                     "cosine": 0.5 * (1.0 + ops.cos(math.pi * progress))}[args.lr_schedule]
            return args.learning_rate * ops.where(step < warmup, step / max(1.0, warmup), after)

        def get_config(self):
            return {}
    return WarmupThenDecay()


def remat_decoder_blocks(backbone):
    """--remat: each decoder block is jax.checkpoint-ed, so the backward pass recomputes its activations
    from the block's input instead of keeping them all: activation memory of one block, not every one,
    for about a third more compute."""
    import jax

    def rematted(call):
        @functools.wraps(call)
        def call_with_remat(x, *args, **kwargs):
            # Only the hidden states are checkpoint inputs: masks and flags stay Python values.
            return jax.checkpoint(lambda x: call(x, *args, **kwargs))(x)
        return call_with_remat
    for block in backbone.transformer_layers:
        object.__setattr__(block, "call", rematted(block.call))


# Arguments that must match for a checkpoint to be resumed.
RESUME_KEYS = ("model", "data", "limit", "lora_rank", "sequence_length", "batch_size", "epochs", "learning_rate",
               "use_context", "loss_on", "dtype", "seed", "max_steps", "buckets", "instruction_field",
               "context_field", "response_field", "template", "quantize", "data_format", "lora_modules", "lora_alpha",
               "lr_schedule", "warmup_steps", "gradient_accumulation", "max_grad_norm", "weight_decay", "eval_every",
               "keep_best")


def save_checkpoint(work_dir, trainer, step, progress, args):
    """progress: what the run has learned so far (history, evals, eval before, best step), and the best
    step's weights under "best_weights" with --keep-best."""
    import numpy as np
    meta = {"step": step, "progress": {k: v for k, v in progress.items() if k != "best_weights"},
            "args": {k: getattr(args, k) for k in RESUME_KEYS}}
    best = {f"b{i}": a for i, a in enumerate(progress.get("best_weights") or [])}
    partial = work_dir / (CHECKPOINT_FILE + ".part.npz")
    np.savez(partial, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **trainer.state_arrays(), **best)
    os.replace(partial, work_dir / CHECKPOINT_FILE)
    log(f"checkpoint saved at step {step}")


def load_checkpoint(work_dir, trainer, args):
    import numpy as np
    with np.load(work_dir / CHECKPOINT_FILE) as arrays:
        meta = json.loads(arrays["meta"].tobytes())
        changed = [k for k in RESUME_KEYS if meta["args"].get(k) != getattr(args, k)]
        if changed:
            raise UserError("--resume: the checkpoint was made with different settings: "
                            + ", ".join(f"--{k.replace('_', '-')} {meta['args'].get(k)!r}" for k in changed))
        trainer.load_state_arrays(arrays)
        progress = meta["progress"]
        best = sorted((k for k in arrays.files if k.startswith("b")), key=lambda k: int(k[1:]))
        progress["best_weights"] = [arrays[k] for k in best] or None
    return meta["step"], progress


def plan_steps(buckets, batch_size, epochs, seed, examples, accumulation=1):
    """Every optimizer step's batches: [[(bucket, example indices), ...], ...], `accumulation` batches per
    step (the last step of a run takes what is left)."""
    import numpy as np
    batches = []
    for epoch in range(epochs):
        rng = np.random.default_rng([seed, epoch])
        batches += make_batches(examples, buckets, batch_size, rng)
    return [batches[i: i + accumulation] for i in range(0, len(batches), accumulation)]


def write_loss_plot(path, history, evals, eval_before):
    """Train loss per step (and a running mean), held-out loss at each evaluation, learning rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], lw=0.8, alpha=0.5, label="train loss (per token)")
    if len(history) >= 10:
        window = max(2, len(history) // 20)
        smooth = [sum(h["loss"] for h in history[max(0, i - window + 1): i + 1]) / min(window, i + 1)
                  for i in range(len(history))]
        ax.plot(steps, smooth, lw=1.5, label=f"train loss, {window}-step mean")
    if eval_before is not None:
        points = [(0, eval_before)] + [(e["step"], e["loss"]) for e in evals]
        ax.plot(*zip(*points), color="red", marker="o", ms=3, zorder=3, label="held-out loss (answer tokens)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lr.plot(steps, [h["learning_rate"] for h in history], color="grey", lw=1, ls="--", label="learning rate")
    lr.set_ylabel("learning rate")
    lr.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    more = lr.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def optional_artefact(name, write, *args):
    """Writes an extra the model does not need (a plot): should it fail (matplotlib missing or broken, a
    full disk), the run warns and still publishes the model it trained. True if it was written."""
    try:
        write(*args)
        return True
    except Exception as e:
        log(f"warning: {name} was not written ({type(e).__name__}: {e}); the model is saved without it")
        return False


def check_output(args):
    """Refuses to clobber, before any work; returns the dir beside --output that becomes it at the end."""
    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
        raise UserError(f"--output {output} already exists and is not empty; pass --overwrite to replace it "
                        "(the old one is kept until the new one is complete)")
    work_dir = output.with_name(output.name + ".partial")
    if args.resume and not (work_dir / CHECKPOINT_FILE).exists():
        raise UserError(f"--resume: no checkpoint of an interrupted run in {work_dir}; start without --resume")
    return work_dir


def start_work_dir(work_dir, resume):
    """A fresh work dir, unless resuming into the interrupted one; leftovers of a crash are discarded."""
    if resume or not IS_MAIN_PROCESS:
        return
    if work_dir.exists():
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)


def publish(work_dir, output):
    """Swaps the finished work dir into place; the old output survives until the swap succeeded."""
    output = Path(output)
    (work_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    if output.exists():
        old = output.with_name(output.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
        os.replace(work_dir, output)
        shutil.rmtree(old)
    else:
        os.replace(work_dir, output)


def memory_summary():
    import jax
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"peak device memory {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
    try:
        import resource
        return f"peak host RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    except ImportError:
        return "peak memory unknown"


def interrupt_on_sigterm(*_):
    """A kill (or a pre-empted VM) then saves a checkpoint like Ctrl-C does."""
    raise KeyboardInterrupt


def build_model(args):
    """The base as loaded (quantized with --quantize), LoRA on --lora-modules, remat with --remat."""
    import numpy as np
    log(f"model: loading {args.model}")
    model = load_model(args)
    if args.quantize != "none":
        quantize_base(model, args.quantize)
    enable_lora(model.backbone, args.lora_rank, args.lora_alpha, args.lora_modules)
    if args.remat:
        remat_decoder_blocks(model.backbone)
    n_params = model.backbone.count_params()
    n_lora = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log(f"model: {type(model).__name__}, {n_params / 1e6:.1f}M parameters; LoRA rank {args.lora_rank}, alpha "
        f"{args.lora_alpha:g} on {','.join(args.lora_modules)}: {n_lora / 1e6:.2f}M trainable"
        + (", decoder blocks rematerialised" if args.remat else ""))
    return model


def describe_steps(steps, buckets, accumulation):
    batches = [length for step in steps for length, _ in step]
    per_step = f" ({accumulation} batches each)" if accumulation > 1 else ""
    return (f"{len(steps)} optimizer steps{per_step}, batches in buckets "
            + ", ".join(f"{b} ({batches.count(b)})" for b in buckets))


def main(argv=None):
    args = parse_args(argv)
    keep_unused_imports_out(args.model)  # before anything imports keras-hub
    started = time.time()
    setup_runtime(args)
    if args.export_only:
        return export_only(args)
    import jax
    import keras
    import numpy as np

    work_dir = check_output(args)
    train_data, eval_data = load_data(args)
    buckets = parse_buckets(args.buckets, args.sequence_length)

    mode, distribution = setup_distribution(args, args.model)
    keras.utils.set_random_seed(args.seed)
    model = build_model(args)
    tokenizer = model.preprocessor.tokenizer
    encode, _ = make_text_codec(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    train_examples, truncated, tokens_cut = tokenize(train_data, encode, tokenizer, args.sequence_length,
                                                     args.loss_on)
    eval_examples, _, _ = tokenize(eval_data, encode, tokenizer, args.sequence_length, "response")
    log(f"data: {truncated} of {len(train_examples)} training examples exceed --sequence-length "
        f"{args.sequence_length}; {tokens_cut} tokens cut; loss on {args.loss_on} tokens")

    steps = plan_steps(buckets, args.batch_size, args.epochs, args.seed, train_examples, args.gradient_accumulation)
    if args.max_steps:
        steps = steps[: args.max_steps]
    used = buckets if eval_examples else sorted({length for step in steps for length, _ in step})
    log(f"data: {describe_steps(steps, buckets, args.gradient_accumulation)}")

    schedule = learning_rate_schedule(args, len(steps))
    optimizer = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=args.weight_decay,
                                       global_clipnorm=args.max_grad_norm)
    trainer = Trainer(model, optimizer, distribution, args.gradient_accumulation)
    compile_started = time.time()
    trainer.warm_up(used, args.batch_size, pad_id, with_eval=bool(eval_examples))
    compile_seconds = time.time() - compile_started

    def evaluate():
        return trainer.evaluate(eval_examples, buckets, args.batch_size, pad_id, np.random.default_rng(0))

    start_work_dir(work_dir, args.resume)
    first_step = 0
    progress = {"history": [], "evals": [], "eval_before": None, "best_step": None, "best_loss": None,
                "best_weights": None}
    if args.resume:
        first_step, progress = load_checkpoint(work_dir, trainer, args)
        log(f"resume: continuing after step {first_step} of {len(steps)}")
    elif eval_examples:
        progress["eval_before"] = evaluate()
        log(f"eval: loss before training {progress['eval_before']:.4f} on {len(eval_examples)} held-out examples")

    def held_out_loss_at(step):
        loss = evaluate()
        progress["evals"].append({"step": step, "loss": loss})
        better = progress["best_loss"] is None or loss < progress["best_loss"]
        if better:
            progress.update(best_step=step, best_loss=loss)
            if args.keep_best:
                progress["best_weights"] = trainer.host_weights()
        return loss, better

    history = progress["history"]
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    step, padded_tokens, real_tokens, train_seconds = first_step, 0, 0, 0.0
    try:
        for step in range(first_step + 1, len(steps) + 1):
            batches = [(length, collate(train_examples, indices, length, args.batch_size, pad_id))
                       for length, indices in steps[step - 1]]
            step_started = time.time()
            loss_sum, count, correct, grad_norm = trainer.train_on(batches)
            elapsed = time.time() - step_started
            train_seconds += elapsed
            computed = sum(args.batch_size * length for length, _ in batches)
            padded_tokens += computed
            real_tokens += sum(int(batch[1].sum()) for _, batch in batches)
            history.append({"step": step, "loss": loss_sum / max(count, 1.0), "accuracy": correct / max(count, 1.0),
                            "learning_rate": float(schedule(step - 1)), "grad_norm": grad_norm})
            log(f"step {step}/{len(steps)} loss {history[-1]['loss']:.4f} acc {history[-1]['accuracy']:.3f} "
                f"lr {history[-1]['learning_rate']:.3g} grad-norm {grad_norm:.3g} {elapsed * 1000:.0f} ms/step "
                f"{computed / elapsed:.0f} tok/s [{'+'.join(str(length) for length, _ in batches)}]")
            if args.eval_every and step % args.eval_every == 0 and step < len(steps):
                loss, better = held_out_loss_at(step)
                log(f"eval: step {step} held-out loss {loss:.4f}" + (" (best so far)" if better else ""))
            if args.checkpoint_every and step % args.checkpoint_every == 0 and step < len(steps):
                if IS_MAIN_PROCESS:
                    save_checkpoint(work_dir, trainer, step, progress, args)
    except KeyboardInterrupt:
        if IS_MAIN_PROCESS and step > first_step:
            save_checkpoint(work_dir, trainer, len(history), progress, args)
        log(f"interrupted: run the same command with --resume to continue from step {len(history)}")
        return 130

    eval_before, eval_after, published_step = progress["eval_before"], None, len(steps)
    if eval_examples:
        eval_after, _ = held_out_loss_at(len(steps))
        log(f"eval: loss after training {eval_after:.4f} (before {eval_before:.4f})")
    if args.keep_best and progress["best_step"] != len(steps):
        published_step = progress["best_step"]
        trainer.set_weights(progress["best_weights"])
        log(f"keep-best: publishing step {published_step} (held-out loss {progress['best_loss']:.4f}); the last "
            f"step, {len(steps)}, had {eval_after:.4f}")
        eval_after = progress["best_loss"]

    trainer.write_back()
    record = {
        "args": vars(args),
        "data_format": args.data_format,
        "prompt_template": TEMPLATES[args.template] | {
            "name": args.template, "prompt_with_context": TEMPLATES[args.template]["prompt_with_context"]
            if args.use_context else None},
        "history": history,
        "eval_history": progress["evals"],
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "published_step": published_step,
        "tokens_per_second": padded_tokens / train_seconds if train_seconds else None,
        "nonpad_tokens_per_second": real_tokens / train_seconds if train_seconds else None,
        "seconds": train_seconds,
        "compile_seconds": compile_seconds,
        "truncated_examples": truncated,
        "truncated_tokens": tokens_cut,
        "buckets": buckets,
        "distribution": mode,
        "devices": jax.device_count(),
        "model_class": type(model).__name__,
        "base_quantization": args.quantize,
    }
    plotted = False
    if IS_MAIN_PROCESS:
        model.backbone.save_lora_weights(str(work_dir / ADAPTER_FILE))
        if args.quantize != "none":
            model = merged_on_original_base(args, work_dir / ADAPTER_FILE)
        save_preset(model, work_dir)
        (work_dir / RUN_RECORD).write_text(json.dumps(record, indent=2))
        plotted = optional_artefact("loss.png", write_loss_plot, work_dir / "loss.png", history, progress["evals"],
                                    eval_before)
        publish(work_dir, args.output)
    done = len(history) - first_step
    log(f"done: {done} steps in {train_seconds:.1f}s ({compile_seconds:.1f}s compiling), "
        f"{record['nonpad_tokens_per_second'] or 0:.0f} real tok/s of {record['tokens_per_second'] or 0:.0f} "
        f"computed, {memory_summary()}, total {time.time() - started:.0f}s")
    if eval_before is not None:
        log(f"eval loss {eval_before:.4f} -> {eval_after:.4f}" +
            (f" (step {published_step})" if published_step != len(steps) else ""))
    log(f"saved: {args.output} (merged Keras preset, {ADAPTER_FILE}, {RUN_RECORD}{', loss.png' if plotted else ''})")
    if args.export and IS_MAIN_PROCESS:
        export(Path(args.output), args.export)
    return 0


def run():
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # out-of-memory is the one crash users can act on
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            print(f"error: {explain_oom(parse_args())}", file=sys.stderr)
            sys.exit(3)
        raise


if __name__ == "__main__":
    run()
