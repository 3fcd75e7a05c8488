"""Structured output and tool calls: what a request asks for becomes one llguidance grammar, compiled (and
checked) on the request's own thread, kept in a small cache by its text, and copied per generation; the worker
only asks each copy for its next token mask. Tool calls are parsed back out of the text, streamed or whole."""
import json
import uuid

from gemma_lora.chat import ToolRequest
from gemma_lora.frontend.server import RequestError


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


def requested_tools(body):
    """What a request's tools ask for (a ToolRequest: the functions it may call, whether it may answer instead,
    whether several calls may come), or None: no tools, or tool_choice "none"."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # a client that sends unset options as null means the default
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
        f"start: calls | text\ncalls: %json {json.dumps(schema, ensure_ascii=False)}\ntext: /[^\\[{{\\s][\\s\\S]*/\n")


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
    """(assistant message, finish_reason) for generated text, as its stream adds up to (ToolCallStream): an
    answer as content; calls as tool_calls and "tool_calls" when the text holds complete calls, and when it was
    cut short (by max_tokens) the calls begun, the last one's arguments as far as they were written, with the
    text's own reason; a call cut before its name was whole, as content."""
    stream = ToolCallStream()
    deltas = stream.feed(text) + stream.finish()
    calls = {}
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"id": part.get("id"), "type": "function",
                                                    "function": {"name": part["function"].get("name"), "arguments": ""}})
            call["function"]["arguments"] += part["function"].get("arguments", "")
    if not calls:  # an answer, or a call cut before its name was whole: the text as it is
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]}, \
        stream.finish_reason(finish_reason)


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

    def finish(self):
        """The deltas that end the turn: a call cut before its name was whole (by max_tokens) has sent nothing,
        and goes as the content it is."""
        if self.mode == "calls" and not any(call["arguments"] is not None for call in self.calls):
            return [{"content": self.text}]
        return []

    def finish_reason(self, reason):
        """"tool_calls" when the text holds complete calls, else the generation's own reason."""
        return "tool_calls" if tool_calls_in(self.text) is not None else reason

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
