"""Structured output: JSON schemas, regexes, choices, Lark grammars and forced tool calls, masked inside the
compiled decode step with llguidance."""
import concurrent.futures
import json
import re
import urllib.request

import jsonschema
import numpy as np
import pytest

import serve
from conftest import REPO, http
from gemma_lora.chat import ToolRequest, tools_prompt
from gemma_lora.engine.batch import DecodeBatch
from gemma_lora.engine.engine import Engine
from gemma_lora.engine.programs import DECODE_CHUNK, apply_token_mask
from gemma_lora.frontend.structured import requested_grammar, tool_call_message, tool_calls_in, tools_grammar
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.metrics import METRICS
from gemma_lora.model import load_model
from gemma_lora.tokens import grammar_tokenizer, make_text_codec

TOOL_DATA = REPO / "tests" / "data" / "tool_sample.jsonl"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
          "required": ["name", "age", "role", "address"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Describe a user of the system."}]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def tools_server(trained_model, start_server):
    """Room for the tool descriptions, which the tiny tokenizer spells out in hundreds of tokens."""
    return start_server(trained_model, "--length-buckets", "64,768", "--max-batch-size", "2")


def chat(server, extra, messages=MESSAGES, **fields):
    body = {"messages": messages, "max_tokens": 120, "temperature": 0} | fields | extra
    status, answer, _ = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 200, answer
    return answer["choices"][0]


def streamed_chat(server, extra, messages=MESSAGES, **fields):
    body = {"messages": messages, "max_tokens": 120, "temperature": 0, "stream": True} | fields | extra
    request = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return [json.loads(e[6:]) for e in response.read().decode().split("\n\n") if e and e != "data: [DONE]"]


FORMS = {
    "json_object": ({"response_format": {"type": "json_object"}},
                    lambda text: isinstance(json.loads(text), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                "strict": True}}},
                    lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    "json": ({"structured_outputs": {"json": PERSON}}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    "regex": ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
              lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) is not None),
    "choice": ({"structured_outputs": {"choice": ["positive", "negative", "neutral ✓"]}},
               lambda text: text in ("positive", "negative", "neutral ✓")),
    "grammar": ({"structured_outputs": {"grammar": 'start: "(" NUM " + " NUM ") = " NUM\nNUM: /[0-9]{1,3}/'}},
                lambda text: re.fullmatch(r"\([0-9]{1,3} \+ [0-9]{1,3}\) = [0-9]{1,3}", text) is not None),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_keeps_to_its_grammar_plain_and_streaming(server, form):
    extra, check = FORMS[form]
    compiled = server.metric("serve_compilations_total")
    choice = chat(server, extra)
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and check(text), choice
    chunks = streamed_chat(server, extra)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["stop"]
    # Sampled, too: whatever the sampler draws stays inside the grammar.
    sampled = chat(server, extra, temperature=1.0, top_p=1.0, top_k=-1, seed=3)
    assert sampled["finish_reason"] == "stop" and check(sampled["message"]["content"]), sampled
    assert server.metric("serve_compilations_total") == compiled


def test_completions_take_structured_outputs_too(server):
    status, answer, _ = http("POST", server.url + "/v1/completions", {
        "prompt": ["Instruction:\nA phone number?\n\nResponse:\n", "Instruction:\nAnother?\n\nResponse:\n"],
        "max_tokens": 20, "temperature": 0, "structured_outputs": {"regex": r"\+[0-9]{2} [0-9]{6}"}})
    assert status == 200, answer
    assert all(re.fullmatch(r"\+[0-9]{2} [0-9]{6}", c["text"]) and c["finish_reason"] == "stop"
               for c in answer["choices"]), answer


def test_log_probabilities_are_those_of_the_masked_distribution(server):
    choice = chat(server, {"structured_outputs": {"choice": ["positive", "negative"]}}, logprobs=True,
                  top_logprobs=20)
    first = choice["logprobs"]["content"][0]
    allowed = [t for t in first["top_logprobs"] if t["logprob"] > -9999]  # forbidden tokens: -inf, sent as -9999
    assert allowed and all("positive".startswith(t["token"]) or "negative".startswith(t["token"]) for t in allowed)
    assert len(allowed) < 20  # so every allowed first token is listed, and they hold all the probability
    assert sum(np.exp(t["logprob"]) for t in allowed) == pytest.approx(1.0, abs=1e-4)


def test_constrained_and_free_rows_share_a_batch_and_each_answers_as_alone(server):
    jobs = [({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, {}),
            ({}, {"max_tokens": 24}), ({"structured_outputs": {"regex": r"[a-z]{4,8}"}}, {}), ({}, {"max_tokens": 40})]
    alone = [chat(server, extra, **fields) for extra, fields in jobs]

    def shared_steps():  # decode steps that ran with more than one request in the batch
        return sum(server.metric("serve_batches_total", labels=f'size="{n}"') for n in (2, 3, 4))
    before = shared_steps()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: chat(server, job[0], **job[1]), jobs))
    assert [t["message"]["content"] for t in together] == [a["message"]["content"] for a in alone]
    assert shared_steps() > before
    jsonschema.validate(json.loads(together[0]["message"]["content"]), PERSON)


def test_the_token_table_is_built_once_by_the_first_request_that_wants_it(tools_server):
    """llguidance's table of every token costs memory (80 MiB for Gemma 3) that a server never asked for
    structured output should not hold: it is built after the server is ready, once, however many first
    requests arrive together."""
    schemas = [{"type": "object", "properties": {f"k{i}": {"enum": [i]}}, "required": [f"k{i}"],
                "additionalProperties": False} for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(lambda schema: chat(tools_server, {"response_format": {
            "type": "json_schema", "json_schema": {"name": "k", "schema": schema}}}), schemas))
    assert [json.loads(c["message"]["content"]) for c in choices] == [{f"k{i}": i} for i in range(4)]
    lines = tools_server.output().splitlines()
    built = [i for i, line in enumerate(lines) if "structured output: llguidance's table" in line]
    assert len(built) == 1 and built[0] > next(i for i, line in enumerate(lines) if " ready on " in line)


@pytest.mark.parametrize("tool_choice, names", [("required", {"get_weather", "get_time"}),
                                                ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_forced_tool_calls_answer_with_tool_calls(tools_server, tool_choice, names):
    server = tools_server
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "parallel_tool_calls": False}  # one call
    choice = chat(server, forced, messages=messages)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
    schema = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]["function"]["parameters"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    chunks = streamed_chat(server, forced, messages=messages)
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == call["function"]["name"]
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["tool_calls"]
    # The call and its result go back into the conversation, rendered as text the model can read.
    follow_up = messages + [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]
    assert chat(server, {}, messages=follow_up, max_tokens=8)["finish_reason"] in ("stop", "length")


def test_tool_choice_none_is_no_tools_and_the_prompt_describes_tools(server):
    messages = [{"role": "user", "content": "Hi"}]
    plain = chat(server, {}, messages=messages, max_tokens=8)
    assert chat(server, {"tools": [WEATHER], "tool_choice": "none"}, messages=messages, max_tokens=8) == plain
    described = tools_prompt([WEATHER])
    assert "get_weather: Current weather in a city." in described and '"enum": ["celsius", "fahrenheit"]' in described


@pytest.mark.parametrize("extra, status, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, 400,
     "cannot be compiled"),
    ({"structured_outputs": {"regex": "[0-9"}}, 400, "regex cannot be compiled"),
    ({"structured_outputs": {"grammar": "start: foo |"}}, 400, "grammar cannot be compiled"),
    ({"structured_outputs": {"json": "{not json"}}, 400, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one of"),
    ({"structured_outputs": {"choice": []}}, 400, "non-empty list"),
    ({"response_format": {"type": "xml"}}, 400, "'response_format' must be"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400, "not both"),
    ({"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": "yes"}, 400, "'parallel_tool_calls' must be"),
    ({"tools": [WEATHER], "messages": MESSAGES + [{"role": "tool", "content": "x"}]}, 400,
     "messages[1]: 'tool_call_id' must be"),
    ({"tools": [WEATHER], "messages": MESSAGES + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, 400,
     "'call_9' is not the id of any tool call"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function",
                                                                                     "function": {"name": "get_weather", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "call_9", "content": 7}]}, 400,
     "messages[2]: 'content' must be a string"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "not among"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, 400, "'tools' must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "not both"),
])
def test_what_cannot_be_constrained_is_a_400_saying_why(server, extra, status, words):
    got, answer, _ = http("POST", server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4} | extra)
    assert got == status and words in answer["error"]["message"], answer


def test_the_openai_client_parses_into_a_pydantic_model(server):
    import openai
    import pydantic

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        zip: str = pydantic.Field(pattern="^[0-9]{5}$")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)
        address: Address
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    parsed = client.chat.completions.parse(model="model", messages=MESSAGES, response_format=Person, max_tokens=120,
                                           temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address) and 0 <= person.age <= 120
    assert server.metric("serve_grammar_masks_total") > 0


@pytest.mark.device
def test_the_grammar_vocabulary_keeps_markers_special_and_bytes_raw(tiny_model):
    import keras_hub
    tokenizer = keras_hub.models.CausalLM.from_preset(str(tiny_model)).preprocessor.tokenizer
    vocabulary = tokenizer.get_vocabulary()
    stop = {tokenizer.end_token_id, tokenizer.token_to_id("<end_of_turn>")}
    grammar_tokens = grammar_tokenizer(tokenizer, len(vocabulary), stop)
    for marker in ("<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>", "<pad>"):
        assert grammar_tokens.is_special_token(tokenizer.token_to_id(marker)), marker
    assert grammar_tokens.decode_bytes([tokenizer.token_to_id("<0x41>")]) == b"A"
    assert grammar_tokens.decode_str(make_text_codec(tokenizer)[0]("Hello world\n")) == "Hello world\n"


@pytest.mark.device
def test_apply_token_mask_on_a_hand_made_mask():
    logits = np.zeros((2, 70), np.float32)
    masks = np.zeros((2, 3), np.int32)
    masks[0, 0] = 1 << 5  # token 5
    masks[0, 2] = 1 << 1  # token 65
    masks[1] = -1  # every token
    out = np.asarray(apply_token_mask(logits, masks))
    assert np.isfinite(out[0]).nonzero()[0].tolist() == [5, 65] and np.isfinite(out[1]).all()


@pytest.fixture(scope="module")
def grammar_engine(trained_model):
    model, _, _ = load_model(serve.parse_args(["--model", str(trained_model)]))
    engine = Engine(model, [8], [64, 320], None)
    return engine, grammar_tokenizer(model.preprocessor.tokenizer, engine.vocabulary_size, engine.stop_ids)


ENGINE_FORMS = [FORMS["json_schema"], FORMS["regex"], FORMS["choice"],
                ({"tools": tools_grammar(ToolRequest([WEATHER["function"], TIME["function"]], False, False))},
                 lambda text: tool_call_message(text, "stop")[0]["content"] is None)]


@pytest.mark.device
@pytest.mark.parametrize("ahead", [False, True], ids=["read-each-chunk", "dispatched-ahead"])
@pytest.mark.parametrize("sampling", [SAMPLER_DEFAULTS["greedy"], {"temperature": 0.9, "top_k": 3, "top_p": 1.0},
                                      {"temperature": 1.0, "top_k": 40, "top_p": 0.9}])
def test_grammar_rows_keep_multi_token_dispatches_and_answer_as_a_token_a_step(grammar_engine, sampling, ahead,
                                                                               monkeypatch):
    """A batch of four grammar rows (JSON schema, regex, choice, a tool call) and four free ones decodes
    DECODE_CHUNK tokens a dispatch, masked at each chunk's first token: the free rows make theirs as fast
    as without a grammar beside them. Each row's tokens are those of the masked draw at every token (the
    engine held to a token a dispatch), greedy or sampled with a seed. Dispatched ahead (an accelerator; forced
    here), a chunk goes out before the grammar rows' tokens of the one before are read: their first token is
    then drawn free too and checked, and a dropped token voids the row's next chunk; the answers are the same."""
    import llguidance
    engine, tokenizer = grammar_engine
    monkeypatch.setattr(engine, "dispatch_ahead", ahead)
    rewind, voided = DecodeBatch.rewind, []  # whether a chunk in flight was voided at each dropped token
    monkeypatch.setattr(DecodeBatch, "rewind", lambda self, row, g, position: (
        voided.append(self.pending is not None), rewind(self, row, g, position))[1])
    grammars = [requested_grammar(extra)[1] if "tools" not in extra else extra["tools"]
                for extra, _ in ENGINE_FORMS]
    programs, dispatches = engine.programs[8], []

    def counted(program, long):  # a long decode makes `limit` tokens (rest[4]), on a CPU its batch's chunks too
        def decode(values, cache, window, steps, masks, *rest):
            dispatches.append((int(np.asarray(rest[4])) if long else steps, masks is not engine.open_masks(8)))
            return program(values, cache, window, steps, masks, *rest)
        return decode

    def run(chunked):
        rows = []
        for i, grammar in enumerate(grammars):
            prompt = [engine.bos] + engine.encode(f"Instruction:\nAnswer number {i}.\n\nResponse:\n")
            constrained = Generation(prompt, 96, sampling, 10 + i, [], None)
            constrained.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            free = Generation(prompt, 24 + i, sampling, 20 + i, [], None)
            free.finish = lambda reason, engine=None, finish=free.finish: (
                freed.append(len(dispatches)), finish(reason, engine))[1]
            rows += [constrained, free]
        engine.chunked, freed = chunked, []
        try:
            engine.generate(rows, len(rows))
        finally:
            engine.chunked = True
        return rows, max(freed)  # the dispatches the free rows took
    engine.programs[8] = programs._replace(decode=counted(programs.decode, False), decode_long=None if (
        programs.decode_long is None) else counted(programs.decode_long, True))
    try:
        dropped = METRICS.grammar_dropped
        chunked, free_dispatches = run(True)
        chunked_dispatches, dispatches[:] = list(dispatches), []
        single, single_free_dispatches = run(False)
    finally:
        engine.programs[8] = programs
    assert [g.ids for g in chunked] == [g.ids for g in single]
    for (_, check), constrained in zip(ENGINE_FORMS, chunked[::2]):
        assert constrained.finish_reason == "stop" and check(constrained.text), constrained.text
    # Beside the free rows every dispatch made 4 tokens, masked (read each chunk; dispatched ahead, a chunk after
    # one not read yet is masked only for rows whose tokens were dropped). Left alone, grammar rows that may
    # keep a chunk's later tokens go on in chunks; those that keep only masked draws (top-p), a token a dispatch.
    assert [steps for steps, _ in chunked_dispatches[:free_dispatches]] == [DECODE_CHUNK] * free_dispatches
    assert ahead or all(masked for _, masked in chunked_dispatches[:free_dispatches])
    alone = {1} if sampling["temperature"] > 0 and sampling["top_p"] < 1 else {DECODE_CHUNK}
    assert {steps for steps, _ in chunked_dispatches[free_dispatches:]} <= alone
    assert free_dispatches <= -(-27 // DECODE_CHUNK) + 1 < single_free_dispatches / 3
    if sampling["temperature"] <= 0 or sampling["top_p"] >= 1:  # their later tokens were checked, some dropped
        assert METRICS.grammar_dropped > dropped
        assert any(voided) == ahead  # dispatched ahead, some drops voided the chunk in flight


def opening(model_dir, characters):
    """logit_bias entries for every token whose text starts with one of `characters`: how a test forces a
    call ("{", "[") or an answer (pushing both away) out of a random model."""
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "assets" / "tokenizer" / "vocabulary.spm"))
    starts = tuple(characters) + tuple(f"<0x{ord(c):02X}>" for c in characters)  # a byte-fallback piece too
    return [str(i) for i in range(sp.get_piece_size()) if sp.id_to_piece(i).startswith(starts)]


def auto_chat(server, bias, stream=False, **fields):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    extra = {"tools": [WEATHER, TIME], "logit_bias": bias} | fields  # no tool_choice: "auto"
    return (streamed_chat if stream else chat)(server, extra, messages=messages, max_tokens=200)


def test_tool_choice_auto_reaches_both_a_call_and_an_answer(tools_server, trained_model):
    calls = dict.fromkeys(opening(trained_model, "{"), 100)
    called = auto_chat(tools_server, calls)
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None, called
    for call in called["message"]["tool_calls"]:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    answer = auto_chat(tools_server, dict.fromkeys(opening(trained_model, "{["), -100))
    assert answer["finish_reason"] in ("stop", "length") and "tool_calls" not in answer["message"], answer
    assert answer["message"]["content"] and answer["message"]["content"][0] not in "{["
    # The call and its result go back into the conversation, and the model answers from there.
    [first] = called["message"]["tool_calls"][:1]
    follow_up = [{"role": "user", "content": "What is the weather in Paris?"}, called["message"],
                 {"role": "tool", "tool_call_id": first["id"], "content": "18 C"}]
    after = chat(tools_server, {"tools": [WEATHER, TIME]}, messages=follow_up, max_tokens=8)
    assert after["finish_reason"] in ("stop", "length", "tool_calls")


def test_parallel_tool_calls_allows_an_array_of_calls_and_false_allows_one(tools_server, trained_model):
    arrays = dict.fromkeys(opening(trained_model, "["), 100)
    several = auto_chat(tools_server, arrays)  # the bias pushes "[" at every token: the array may run to max_tokens
    assert several["message"].get("tool_calls") or several["message"]["content"].startswith('[{"name": "'), several
    single = auto_chat(tools_server, arrays, parallel_tool_calls=False)  # "[" is not allowed: a call or an answer
    assert len(single["message"].get("tool_calls") or [None]) == 1
    if single["message"].get("content"):
        assert not single["message"]["content"].startswith("[")
    # What each form admits, token by token (the random model need not write two calls by itself).
    engine_tokens = grammar_tokenizer(*grammar_vocabulary(trained_model))
    import llguidance
    two = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]'
    for parallel, auto, text, whole in [(True, True, two, True), (False, True, two, False), (True, False, two, True),
                                        (True, True, "It is sunny.", True), (True, False, "It is sunny.", False)]:
        grammar = tools_grammar(ToolRequest([WEATHER["function"], TIME["function"]], auto, parallel))
        matcher = llguidance.LLMatcher(engine_tokens, grammar, log_level=0)
        ids = grammar_vocabulary.encode(text)
        assert (matcher.validate_tokens(ids) == len(ids)) == whole, (parallel, auto, text)
    assert [(n, json.loads(a)) for n, a in tool_calls_in(two)] == [("get_time", {"zone": "UTC"}),
                                                                   ("get_time", {"zone": "CET"})]


def test_with_tool_choice_auto_an_answer_cannot_start_with_a_space_or_newline_before_a_call():
    """Gemma's vocabulary has pieces such as "▁{" and "\n{": the plain-text branch of tool_choice "auto" must not
    let them open an answer, or a call written after them comes back as content and is never run (issue #63)."""
    import io
    import types
    import llguidance
    import sentencepiece as spm
    model = io.BytesIO()
    lines = ["The weather is sunny in Paris today.", '{"name": "get_weather", "arguments": {"city": "Oslo"}}'] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=400, hard_vocab_limit=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, byte_fallback=True, add_dummy_prefix=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n", "\u2581{", "\n{", "{", "\u2581"], minloglevel=2, num_threads=1)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    table = grammar_tokenizer(types.SimpleNamespace(proto=model.getvalue(), start_token_id=2), sp.get_piece_size(), {1})
    for parallel in (True, False):
        matcher = llguidance.LLMatcher(table, tools_grammar(ToolRequest([WEATHER["function"]], True, parallel)),
                                       log_level=0)
        first = {piece: matcher.validate_tokens([sp.piece_to_id(piece)]) for piece in
                 ("\u2581{", "\n{", "\u2581", "\n", "{", "The")}
        assert first == {"\u2581{": 0, "\n{": 0, "\u2581": 0, "\n": 0, "{": 1, "The": 1}, (parallel, first)


def assembled(chunks):
    """(message, finish_reason, log-probability entries) of a streamed chat answer, as the openai client's stream
    helper adds it up."""
    content, calls, reason, entries = [], {}, None, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for part in delta.get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
                call["name"] = part["function"].get("name") or call["name"]
                call["arguments"] += part["function"].get("arguments") or ""
            entries += (choice.get("logprobs") or {}).get("content") or []
            reason = choice["finish_reason"] or reason
    return "".join(content) or None, [calls[i] for i in sorted(calls)], reason, entries


def test_a_tool_call_streamed_or_not_cut_or_whole_is_the_same_call_with_the_same_logprobs(tools_server,
                                                                                              trained_model):
    """The same request streamed and not: the same content or calls (a call cut by max_tokens too: its name and
    the arguments written so far, or the text when its name was not whole), the same finish reason, and a
    log-probability for every token in both (issue #63: a piece that made no delta dropped its entries)."""
    bias = dict.fromkeys(opening(trained_model, "{"), 100)
    for max_tokens in (3, 6, 14, 200):
        fields = {"logprobs": True, "top_logprobs": 1, "max_tokens": max_tokens}
        plain = auto_chat(tools_server, bias, **fields)
        content, calls, reason, entries = assembled(auto_chat(tools_server, bias, stream=True, **fields))
        message = plain["message"]
        assert (content, reason) == (message.get("content"), plain["finish_reason"]), (max_tokens, plain)
        assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in message.get("tool_calls") or []], (max_tokens, plain)
        assert len(entries) == len(plain["logprobs"]["content"]) == (max_tokens if reason == "length" else
                                                                     len(entries)), max_tokens
        assert [(e["token"], e["logprob"]) for e in entries] == [(e["token"], e["logprob"])
                                                                 for e in plain["logprobs"]["content"]]
        if max_tokens == 200:
            assert reason == "tool_calls" and calls
        elif reason == "length" and calls:  # cut inside the arguments: as far as they were written
            assert not calls[-1]["arguments"] or not tool_calls_in(calls[-1]["arguments"])


def test_tool_options_a_client_leaves_unset_or_gets_wrong_are_answered_as_such(tools_server):
    """"parallel_tool_calls": null is the default, as "tool_choice": null is; a tool call id that is not a string
    is a 400 that says so, not a 500 (issue #63)."""
    answer = chat(tools_server, {"tools": [WEATHER], "parallel_tool_calls": None, "tool_choice": None},
                  messages=[{"role": "user", "content": "Weather?"}], max_tokens=4)
    assert answer["finish_reason"] in ("stop", "length", "tool_calls")
    for bad in (["call_1"], {"id": "call_1"}, 7):
        messages = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "tool_calls": [{"id": bad, "type": "function", "function": {
                        "name": "get_weather", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
        status, reply, _ = http("POST", tools_server.url + "/v1/chat/completions",
                                {"messages": messages, "tools": [WEATHER], "max_tokens": 4})
        assert status == 400 and "'id' must be a string" in reply["error"]["message"], (bad, reply)


def grammar_vocabulary(model_dir):
    """(tokenizer, vocabulary size, stop ids) of a model dir, as the server builds its grammar table from."""
    if not hasattr(grammar_vocabulary, "cached"):
        model, _, _ = load_model(serve.parse_args(["--model", str(model_dir)]))
        tokenizer = model.preprocessor.tokenizer
        grammar_vocabulary.encode = make_text_codec(tokenizer)[0]
        grammar_vocabulary.cached = (tokenizer, model.backbone.vocabulary_size, {tokenizer.end_token_id})
    return grammar_vocabulary.cached


def test_streamed_tool_calls_rebuild_in_the_openai_client(tools_server, trained_model):
    """Calls stream as OpenAI streams them: a delta with the call's index, id and name, then its arguments in
    fragments; the openai client's stream helper rebuilds the same calls as the plain answer's."""
    import openai
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused")
    ask = dict(model="model", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
               max_tokens=200, temperature=0, logit_bias=dict.fromkeys(opening(trained_model, "{"), 100))
    plain = client.chat.completions.create(**ask)
    with client.chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion()
    want = [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == want
    assert final.choices[0].finish_reason == "tool_calls"
    chunks = auto_chat(tools_server, ask["logit_bias"], stream=True, temperature=0)
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == want[0][0]
    assert len(deltas) > 2 and all("id" not in d for d in deltas[1:] if d["index"] == 0)  # then fragments
    # An answer streams as content.
    text = auto_chat(tools_server, dict.fromkeys(opening(trained_model, "{["), -100), stream=True)
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in text)


def test_langchain_bind_tools_invokes_and_streams_calls(tools_server, trained_model):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model="model", base_url=tools_server.url + "/v1", api_key="unused", temperature=0,
                     max_tokens=200, logit_bias={int(i): 100 for i in opening(trained_model, "{")})
    bound = llm.bind_tools([WEATHER, TIME])
    message = bound.invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] in ("get_weather", "get_time"), message
    streamed = None
    for chunk in bound.stream("Weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tiny_model, run_train, start_server):
    """The tiny Gemma tuned on tests/data/tool_sample.jsonl (TRL's tool-calling format), served."""
    out = tmp_path_factory.mktemp("tools") / "model"
    run_train("--model", tiny_model, "--data", TOOL_DATA, "--eval-examples", 0, "--epochs", 6, "--learning-rate",
              1e-2, "--loss-on", "response", "--template", "gemma-chat", "--output", out, check=True)
    return start_server(out, "--length-buckets", "64,768", "--max-batch-size", "2")


def test_a_model_tuned_on_tool_use_calls_the_tools_it_was_taught(tool_server):
    """Held-out questions (cities the sample never asks about), tools sent as TRL's column had them and no
    tool_choice: the tuned model opens a call, whose name and arguments the grammar keeps valid."""
    tools = json.loads(TOOL_DATA.read_text().splitlines()[0])["tools"]
    asked = ["What is the weather in Oslo?", "Is it cold in Lima right now?", "What time is it in Quito?"]
    opened = 0
    for question in asked:
        choice = chat(tool_server, {"tools": tools}, messages=[{"role": "user", "content": question}], max_tokens=160)
        text = choice["message"]["content"] or ""
        for call in choice["message"].get("tool_calls") or []:
            spec = next(t["function"] for t in tools if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), spec["parameters"])
        opened += bool(choice["message"].get("tool_calls")) or text.startswith('{"name": "get_')
    assert opened >= 2, opened
