"""train_local.py's data formats (dolly, messages, prompt-completion, text; JSONL or a JSON array) and
which tokens each one teaches; the learning-rate schedules."""
import json

import numpy as np
import pytest
import sentencepiece as spm

import train_local
from conftest import CHAT_DATA, REPO
from gemma_lora.adapters import LORA_MODULES, parse_lora_modules
from gemma_lora.chat import ChatError, message_text, TEMPLATES, parse_messages, render_chat, tools_prompt
from gemma_lora.frontend.protocol import chat_prompt
from gemma_lora.frontend.structured import requested_tools, tool_calls_in

GEMMA = TEMPLATES["gemma-chat"]


class FakeTokenizer:
    start_token_id, end_token_id, pad_token_id = 2, 1, 0


@pytest.fixture(scope="module")
def encode(tiny_model):
    return spm.SentencePieceProcessor(model_file=str(tiny_model / "tokenizer.model")).encode


def args_for(data, *flags):
    return train_local.parse_args(["--data", str(data), "--eval-examples", "0", *map(str, flags)])


def write(tmp_path, records, name="data.jsonl", array=False):
    path = tmp_path / name
    path.write_text(json.dumps(records) if array else "".join(json.dumps(r) + "\n" for r in records))
    return path


CONVERSATION = {"messages": [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "APPLE.", "weight": 0},
    {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one?"}]},
    {"role": "assistant", "content": "Pear."},
    {"role": "user", "content": "And a vegetable?"},
    {"role": "assistant", "content": "Leek."}]}
RECORDS = {
    "dolly": {"instruction": "Say hi.", "context": "", "response": "Hi!"},
    "messages": CONVERSATION,
    "prompt-completion": {"prompt": "The sky is", "completion": " blue."},
    "text": {"text": "Once upon a time."},
}


@pytest.mark.parametrize("data_format", list(RECORDS))
def test_auto_decides_the_format_from_the_first_good_record_and_says_so(tmp_path, capsys, data_format):
    path = write(tmp_path, ["not an object", RECORDS[data_format]])
    args = args_for(path, "--skip-bad-lines")
    train, _ = train_local.load_data(args)
    assert args.data_format == data_format and len(train) == 1
    assert f"format {data_format} (--data-format auto" in capsys.readouterr().out
    expected_loss_on = "all" if data_format in ("dolly", "text") else "response"
    assert args.loss_on == expected_loss_on


def test_prompt_completion_uses_the_prompt_as_is_and_teaches_the_completion(tmp_path):
    [example], _ = train_local.load_data(args_for(write(tmp_path, [RECORDS["prompt-completion"]])))
    assert example == [("The sky is", "prompt"), (" blue.", "answer")]
    [example], _ = train_local.load_data(args_for(write(tmp_path, [RECORDS["text"]])))
    assert example == [("Once upon a time.", "answer")]


def test_conversational_prompt_completion_renders_as_a_chat_with_the_prompt_as_context(tmp_path):
    record = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "Bye"}],
              "completion": [{"role": "assistant", "content": "Goodbye."}]}
    [example], _ = train_local.load_data(args_for(write(tmp_path, [record]), "--template", "gemma-chat"))
    assert [kind for _, kind in example] == ["prompt", "context", "prompt", "answer"]
    assert example[-1] == ("Goodbye.<end_of_turn>", "answer")


def test_a_json_array_file_and_jsonl_in_a_json_file_both_load(tmp_path):
    records = [RECORDS["messages"], RECORDS["messages"]]
    array, _ = train_local.load_data(args_for(write(tmp_path, records, "a.json", array=True)))
    lines, _ = train_local.load_data(args_for(write(tmp_path, records, "b.json")))  # as Hugging Face's to_json
    assert array == lines and len(array) == 2


BAD = [
    ("messages", {"messages": []}, "non-empty list"),
    ("messages", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0]: 'role' must be one of"),
    ("messages", {"messages": [{"role": "user", "content": 5}]}, "messages[0]: 'content' must be a string"),
    ("messages", {"messages": [{"role": "user", "content": "a"}]}, "end with an assistant message"),
    ("messages", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}]},
     "messages[1]: 'weight' must be 0 or 1"),
    ("messages", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]},
     "nothing to learn"),
    ("prompt-completion", {"prompt": "a"}, "missing field 'completion'"),
    ("prompt-completion", {"prompt": "a", "completion": 3}, "field 'completion' is int"),
    ("text", {"text": ["a"]}, "field 'text' is list"),
    ("dolly", {"instruction": "a"}, "missing field 'response'"),
]


@pytest.mark.parametrize("data_format, bad, reason", BAD)
def test_a_bad_record_names_its_line_or_index_and_stops_before_training(tmp_path, data_format, bad, reason):
    good = RECORDS[data_format]
    for path, where in ((write(tmp_path, [good, good, bad]), ":3:"),
                        (write(tmp_path, [good, good, bad], "data.json", array=True), "[2]:")):
        with pytest.raises(train_local.UserError) as error:
            train_local.load_data(args_for(path, "--data-format", data_format))
        assert f"{path}{where} " in str(error.value) and reason in str(error.value), str(error.value)
        assert "--skip-bad-lines" in str(error.value)
    train, _ = train_local.load_data(args_for(write(tmp_path, [good, bad, good]), "--data-format", data_format,
                                              "--skip-bad-lines"))
    assert len(train) == 2


def test_a_record_that_fits_no_format_is_bad_under_auto(tmp_path):
    with pytest.raises(train_local.UserError, match=r"data.jsonl:1: its fields fit no format"):
        train_local.load_data(args_for(write(tmp_path, [{"question": "a", "answer": "b"}])))


def test_a_record_of_another_format_after_the_first_is_bad(tmp_path):
    with pytest.raises(train_local.UserError, match=r"data.jsonl:2: missing field 'messages'"):
        train_local.load_data(args_for(write(tmp_path, [RECORDS["messages"], RECORDS["text"]])))


def test_exactly_the_taught_turns_carry_weight_in_a_three_turn_conversation(tmp_path, encode):
    """<bos> [system+user 1 prompt] [APPLE., weight 0] [user 2 prompt] [Pear.] [user 3 prompt] [Leek.] <eos>:
    only Pear., Leek., their <end_of_turn> and the final <eos> are taught; with --loss-on all the
    prompts are too, never the weight-0 answer."""
    [example], _ = train_local.load_data(args_for(write(tmp_path, [CONVERSATION]), "--template", "gemma-chat"))
    texts = [
        "<start_of_turn>user\nBe brief.\n\nName a fruit.<end_of_turn>\n<start_of_turn>model\n",
        "APPLE.<end_of_turn>",
        "\n<start_of_turn>user\nAnother\none?<end_of_turn>\n<start_of_turn>model\n",
        "Pear.<end_of_turn>",
        "\n<start_of_turn>user\nAnd a vegetable?<end_of_turn>\n<start_of_turn>model\n",
        "Leek.<end_of_turn>"]
    assert example == list(zip(texts, ["prompt", "context", "prompt", "answer", "prompt", "answer"]))
    pieces = [encode(t) for t in texts]
    [(ids, weights)], _, _ = train_local.tokenize([example], encode, FakeTokenizer, 512, "response")
    assert ids.tolist() == [2] + sum(pieces, []) + [1]
    # weights[i] scores the prediction of ids[i + 1]: one weight per segment token, then <eos>'s.
    taught = [1.0 if k in (3, 5) else 0.0 for k, piece in enumerate(pieces) for _ in piece] + [1.0]
    assert weights.tolist() == taught
    [(_, everything)], _, _ = train_local.tokenize([example], encode, FakeTokenizer, 512, "all")
    assert everything.tolist() == [0.0 if k == 1 else 1.0 for k, piece in enumerate(pieces) for _ in piece] + [1.0]


def test_conversations_render_exactly_as_serve_renders_them():
    """The renderer is one helper copied into both scripts: training's text up to each answer is the
    prompt serve.py builds for the conversation so far."""
    segments = render_chat(parse_messages(CONVERSATION["messages"]), GEMMA, "assistant")
    prompts = ["".join(t for t, _ in segments[:k]) for k in (1, 3, 5)]
    assert prompts == [chat_prompt(CONVERSATION["messages"][:n], dict(GEMMA, name="gemma-chat"))
                       for n in (2, 4, 6)]


def test_lora_modules_take_peft_names_or_all_linear():
    assert train_local.parse_args([]).lora_modules == ["q_proj", "v_proj"]
    args = train_local.parse_args(["--lora-modules", "all-linear", "--lora-rank", "8"])
    assert args.lora_modules == list(LORA_MODULES) and args.lora_alpha == 8.0
    assert train_local.parse_args(["--lora-modules", "down_proj, q_proj"]).lora_modules == ["q_proj", "down_proj"]
    with pytest.raises(ValueError, match="query.*choose from"):
        parse_lora_modules("query")


@pytest.mark.parametrize("flags, message", [
    (["--keep-best"], "--keep-best needs --eval-every"),
    (["--eval-every", "5", "--eval-examples", "0"], "--eval-every needs held-out records"),
    (["--gradient-accumulation", "0"], "--gradient-accumulation must be at least 1"),
    (["--lora-modules", "embed"], "--lora-modules: embed"),
])
def test_recipe_flags_that_cannot_work_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        train_local.parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind, expected", [
    # Hugging Face's get_*_schedule_with_warmup at steps 0, 5, 10 (end of warm-up), 55 (half-way), 100 (end).
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.5, 0.0]),
    ("cosine", [0.0, 0.5, 1.0, 0.5, 0.0]),
])
def test_learning_rate_schedules_at_chosen_steps(kind, expected):
    args = train_local.parse_args(["--learning-rate", "2e-4", "--warmup-steps", "10", "--lr-schedule", kind])
    schedule = train_local.learning_rate_schedule(args, 100)
    got = [float(schedule(step)) for step in (0, 5, 10, 55, 100)]
    assert got == pytest.approx([2e-4 * e for e in expected], abs=1e-9)
    quarter = float(schedule(10 + 90 // 4 + 0.5))  # a quarter of the way through the decay
    assert quarter == pytest.approx(2e-4 * {"constant": 1, "linear": 0.75, "cosine": 0.5 + 0.5 * np.cos(np.pi / 4)}[kind],
                                    rel=1e-5)
    without_warmup = train_local.learning_rate_schedule(train_local.parse_args(["--learning-rate", "2e-4"]), 100)
    assert float(without_warmup(0)) == pytest.approx(2e-4)  # the article's constant rate


def test_the_chat_sample_has_every_shape_chat_logs_have():
    records = [json.loads(line) for line in CHAT_DATA.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 200 and all(set(r) == {"messages"} for r in records)
    roles = [m["role"] for r in records for m in r["messages"]]
    assert {"system", "developer", "user", "assistant"} <= set(roles)
    assert any(m.get("weight") == 0 for r in records for m in r["messages"])
    assert any(isinstance(m["content"], list) for r in records for m in r["messages"])
    assert all(sum(m["role"] == "user" for m in r["messages"]) >= 2 for r in records)
    taught = [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant" and m.get("weight", 1)]
    assert all(t.endswith("Anything else?") for t in taught)


def test_tool_calls_and_results_render_as_serving_makes_and_reads_them(tmp_path):
    """An OpenAI fine-tuning record with a function call: the call is taught as the JSON serve.py's tool
    calling constrains the model to write, the result is a user turn."""
    record = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "assistant", "content": "It is -3 C in Oslo."}]}
    [example], _ = train_local.load_data(args_for(write(tmp_path, [record]), "--template", "gemma-chat"))
    assert example[1] == ('{"name": "get_weather", "arguments": {"city": "Oslo"}}<end_of_turn>', "answer")
    assert "<start_of_turn>user\nTool result:\n-3 C<end_of_turn>" in example[2][0]
    prompt = chat_prompt(record["messages"][:3], dict(GEMMA, name="gemma-chat"))
    assert prompt == "".join(text for text, _ in example[:3])
    bad = dict(record, messages=record["messages"][:1] + [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{broken"}}]}])
    with pytest.raises(train_local.UserError, match="'tool_calls' must be a list"):
        train_local.load_data(args_for(write(tmp_path, [bad])))


def test_several_tool_calls_and_trl_s_object_arguments_render_as_the_model_writes_them():
    """Several calls of one turn are the JSON array parallel tool calling lets the model write; TRL's datasets
    hold arguments as objects, OpenAI sends them as JSON strings: both render the same (one renderer, for both
    scripts)."""
    calls = [{"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
    text = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]'
    assert message_text(1, {"role": "assistant", "content": None, "tool_calls": calls}) == text
    assert message_text(1, {"role": "assistant", "tool_calls": calls[:1]}) == \
        '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    with pytest.raises(ChatError, match=r"messages\[1\]: 'tool_calls' must be"):
        message_text(1, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]})
    assert [(n, json.loads(a)) for n, a in tool_calls_in(text)] == [("get_time", {"zone": "UTC"}),
                                                                    ("get_time", {"zone": "CET"})]


def test_a_tools_column_is_described_as_serving_describes_a_request_s_tools(tmp_path):
    """TRL's tool-calling records: the text before each assistant turn is the prompt serve.py builds for that
    conversation sent with the same `tools` (tool_choice auto, parallel calls: its defaults); the call is
    taught as the JSON the server constrains the model to, and with --loss-on response only the assistant's
    turns (calls and answers) are scored."""
    [record] = [json.loads(line) for line in (REPO / "tests/data/tool_sample.jsonl").read_text().splitlines()[:1]]
    assert record["messages"][1]["tool_calls"] and record["messages"][2]["role"] == "tool"
    [example], _ = train_local.load_data(args_for(write(tmp_path, [record]), "--template", "gemma-chat"))
    template = dict(GEMMA, name="gemma-chat")
    body = {"tools": record["tools"], "messages": record["messages"][:1]}
    served = [{"role": "system", "content": tools_prompt(record["tools"], requested_tools(body))}]
    assert "".join(text for text, _ in example[:1]) == chat_prompt(served + record["messages"][:1], template)
    call = record["messages"][1]["tool_calls"][0]["function"]
    assert example[1] == (json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "<end_of_turn>",
                          "answer")
    assert [kind for _, kind in example] == ["prompt", "answer", "prompt", "answer"]
    # The follow-up prompt, after the tool's result, is what serving renders for the conversation so far.
    call_id = {"id": "call_1", **record["messages"][1]["tool_calls"][0]}
    so_far = record["messages"][:1] + [dict(record["messages"][1], tool_calls=[call_id])] + \
        [dict(record["messages"][2], tool_call_id="call_1")]
    assert "".join(text for text, _ in example[:3]) == chat_prompt(served + so_far, template)
    for bad, words in ((dict(record, tools="{not json"), "not JSON"), (dict(record, tools=[{"type": "x"}]), "'tools'")):
        with pytest.raises(train_local.UserError, match=words):
            train_local.load_data(args_for(write(tmp_path, [bad])))
