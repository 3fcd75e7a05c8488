"""Prompt templates and chat rendering, shared by training and serving: the text before each assistant turn
in training is the prompt serve.py builds for the same conversation, tools described the same way."""
import collections
import json
from pathlib import Path


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


TOOLS_PROMPT = ("You can call these functions. To call one, answer with nothing but a JSON object: "
                '{{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}}{several}.'
                "{answer}\n{functions}")
TOOLS_SEVERAL = "; to call several, a JSON array of such objects"
TOOLS_ANSWER = " To answer without calling any, write your answer as plain text."
# The calls are tried as JSON: an object, or with parallel_tool_calls an array of them. With tool_choice "auto"
# (no tool-call tokens in Gemma to tell a call from an answer) the output is either such a call or plain text
# that does not start with "{" or "[" (llama.cpp's servers do the like for models without a native format).
ToolRequest = collections.namedtuple("ToolRequest", "functions auto parallel")


def tools_prompt(tools, request=None):
    """The system text that describes the tools (and, for `request`, how to call several or answer instead)."""
    return TOOLS_PROMPT.format(
        several=TOOLS_SEVERAL if request is not None and request.parallel else "",
        answer=TOOLS_ANSWER if request is not None and request.auto else "", functions="\n".join(
            f"- {t['function']['name']}: {t['function'].get('description') or ''} Arguments (JSON Schema): "
            f"{json.dumps(t['function'].get('parameters') or {'type': 'object'}, ensure_ascii=False)}" for t in tools))
