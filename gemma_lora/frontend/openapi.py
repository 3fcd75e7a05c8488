"""The OpenAPI document GET /openapi.json serves: every route, its fields and its answers."""
from gemma_lora.interface import BIAS_SLOTS, MAX_N, MAX_STOP_TOKEN_IDS, TOP_LOGPROBS


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
