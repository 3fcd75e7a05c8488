"""The OpenAI and vLLM request fields, checked (sampling, penalties, n, stop, the model asked for), turned
into Generations and submitted; and what comes back rendered as the API spells it (usage, log-probabilities)."""
import functools

from gemma_lora.chat import ChatError, parse_messages, render_chat
from gemma_lora.frontend.server import RequestError, ready_engine
from gemma_lora.interface import (BIAS_SLOTS, CANDIDATES, Generation, MAX_N, MAX_STOP_TOKEN_IDS, QueueFull,
                                  SAMPLER_DEFAULTS, WorkerGone, release_all)


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    adapter = None if server.core is None else server.core.adapter(name)
    if adapter is None:
        raise RequestError(404, f"the model '{name}' does not exist: GET /v1/models lists the base and its adapters",
                           "not_found_error", code="model_not_found")
    return name, adapter, adapter.template or server.template


def adapters_ready(server):
    core = ready_engine(server)
    if not core.has_adapters():
        raise RequestError(400, "this server was started without LoRA adapter slots: restart it with --enable-lora "
                                "(or with --adapter NAME=PATH)")
    return core


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
    sampling.update(parse_adjustments(body, server.core.vocabulary_size))
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
            g.adapter = server.core.acquire(model)
            if g.adapter is None:
                release_all(gens)
                raise RequestError(404, f"the model '{model}' was just unloaded", "not_found_error",
                                   code="model_not_found")
            g.slot = g.adapter.slot
            g.releases.append(functools.partial(server.core.release, g.adapter))
    if len(gens) > args.max_queue:  # it would never fit, and a client that obeys Retry-After would retry forever
        release_all(gens)
        raise RequestError(400, f"this request asks for {len(gens)} generations ({len(prompts)} prompt"
                                f"{'s' * (len(prompts) > 1)} x n={n}), more than the server ever queues at once "
                                f"(--max-queue {args.max_queue}): send fewer, or restart the server with a larger "
                                f"--max-queue")
    try:
        server.core.submit(gens)
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
