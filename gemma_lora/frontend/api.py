"""The routes: one small function per route, parse -> validate -> generations -> render. Each takes the
shared Server state and the request (`req`: .json(), .headers, .watch(generations)) and returns a Reply; the HTTP
plumbing (http.py) does status lines, errors, auth, metrics and logging."""
import collections
import functools
import time
import uuid

from gemma_lora.adapters import AdapterError, describe
from gemma_lora.chat import tools_prompt
from gemma_lora.frontend.openapi import OPENAPI
from gemma_lora.frontend.protocol import (adapters_ready, chat_logprobs, chat_prompt, completion_logprobs,
                                          format_instruction, is_int, kept_logprobs, parse_n, parse_stream, pick_model,
                                          start_generations, template_stop, usage)
from gemma_lora.frontend.server import ClientGone, Reply, RequestError, ready_engine
from gemma_lora.frontend.streams import STREAMS, stream_events
from gemma_lora.frontend.structured import (ToolCallStream, compiled_grammar, requested_grammar, requested_tools,
                                            tool_call_message, tools_grammar)
from gemma_lora.log import log
from gemma_lora.metrics import METRICS


def health(server, req):
    state = server.status()
    body = {"status": "ok" if state == "ready" else state}
    compiling = [] if server.core is None else server.core.compiling()
    if compiling:  # ready, and these take effect as they compile
        body["compiling"] = compiling
    return Reply(200 if state == "ready" else 503, body)


def metrics_page(server, req):
    return Reply(text=METRICS.render(server.status() == "ready"), content_type="text/plain; version=0.0.4")


def list_models(server, req):
    base = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "local", "root": server.args.model,
            "parent": None}
    adapters = [] if server.core is None else server.core.loaded_adapters()
    return Reply(payload={"object": "list", "data": [base] + [
        {"id": a.name, "object": "model", "created": 0, "owned_by": "local", "root": a.path,
         "parent": server.model_name} for a in adapters]})


def load_lora_adapter(server, req):
    body = req.json()
    core = adapters_ready(server)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise RequestError(400, "send 'lora_name' and 'lora_path' (an adapter dir on this server), both strings")
    if name in server.base_names:
        raise RequestError(409, f"the name {name} is the base model's")
    try:
        adapter = core.load_adapter(name, path)
    except AdapterError as e:
        raise RequestError(e.status, f"adapter {name}: {e}", "not_found_error" if e.status == 404 else
                           "invalid_request_error") from None
    log(f"adapter {name}: loaded from {path} into slot {adapter.slot} ({describe(adapter)})")
    return Reply(payload={"id": name, "object": "model", "root": adapter.path, "parent": server.model_name,
                          "status": "loaded"})


def unload_lora_adapter(server, req):
    body = req.json()
    core = adapters_ready(server)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise RequestError(400, "send 'lora_name', a string")
    try:
        core.unload_adapter(name)
    except AdapterError as e:
        raise RequestError(e.status, str(e), "not_found_error", code="model_not_found") from None
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
        held = collections.defaultdict(list)  # log-probabilities of tokens whose text no delta has carried yet

        def chunk(index, delta, reason=None, entries=None):
            content = {"content": chat_logprobs(engine, entries)} if keep is not None and entries else None
            return base | {"choices": [{"index": index, "delta": delta, "logprobs": content, "finish_reason": reason}]}

        def render(index, text, reason, entries):
            if tools is not None:  # an answer as content, calls as OpenAI streams them: header, then arguments
                stream = calls[index]
                held[index] += entries or []
                deltas = stream.feed(text) + (stream.finish() if reason else [])
                pieces = [chunk(index, delta, entries=held.pop(index, None)) for delta in deltas]
                if reason:
                    pieces.append(chunk(index, {}, stream.finish_reason(reason), entries=held.pop(index, None)))
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
            for j, call in enumerate(message["tool_calls"]):
                if isinstance(call, dict) and call.get("id") is not None:
                    if not isinstance(call["id"], str):
                        raise RequestError(400, f"messages[{i}].tool_calls[{j}]: 'id' must be a string")
                    ids.add(call["id"])
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


def wait_for(gens, req):
    """Blocks until every generation has ended; ClientGone if they were cancelled because the client left."""
    for g in gens:
        g.done.wait()
    if any(g.finish_reason == "cancelled" for g in gens):
        raise ClientGone()
    if any(g.finish_reason == "error" for g in gens):
        raise RequestError(500, "generation failed", "server_error")
    return gens
