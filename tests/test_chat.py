"""Chat completions, log-probabilities, tokenize/detokenize and the OpenAPI document of serve.py."""
import json
import math
import subprocess
import sys
import types
import urllib.request

import pytest

from conftest import http
from gemma_lora.chat import TEMPLATES, read_prompt_template
from gemma_lora.frontend.api import ROUTES
from gemma_lora.frontend.openapi import OPENAPI
from gemma_lora.frontend.protocol import chat_prompt, format_instruction, template_stop
from gemma_lora.frontend.server import RequestError
from gemma_lora.tokens import SentencePieces, pieces_of

ARTICLE = dict(TEMPLATES["article"], name="article")
GEMMA = dict(TEMPLATES["gemma-chat"], name="gemma-chat")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one?"}]}]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def post(server, path, body):
    return http("POST", server.url + path, body)


def render(messages, template):
    return chat_prompt(messages, template)


# ----------------------------------------------------------------------------- rendering (no server)

def test_multi_turn_chat_renders_in_the_article_template():
    assert render(CONVERSATION, ARTICLE) == ("Instruction:\nBe brief.\n\nName a fruit.\n\nResponse:\nApple.\n\n"
                                             "Instruction:\nAnother\none?\n\nResponse:\n")


def test_multi_turn_chat_renders_in_gemma_turns():
    assert render(CONVERSATION, GEMMA) == (
        "<start_of_turn>user\nBe brief.\n\nName a fruit.<end_of_turn>\n<start_of_turn>model\nApple.<end_of_turn>\n"
        "<start_of_turn>user\nAnother\none?<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("template", [ARTICLE, GEMMA])
def test_one_user_message_is_exactly_instruction_mode(template):
    assert render([{"role": "user", "content": "Why?"}], template) == \
        format_instruction({"instruction": "Why?"}, template)


def test_a_conversation_must_end_with_the_user():
    with pytest.raises(RequestError, match="end with a user message"):
        render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], ARTICLE)


def test_template_without_a_record_follows_the_tokenizer(tmp_path):
    assert read_prompt_template(tmp_path, ["<pad>", "<start_of_turn>"])["name"] == "gemma-chat"
    assert read_prompt_template(tmp_path, ["<pad>", "a"])["name"] == "article"
    (tmp_path / "training.json").write_text(json.dumps({"prompt_template": dict(GEMMA, prompt_with_context=None)}))
    assert read_prompt_template(tmp_path, [])["prompt_with_context"] == GEMMA["prompt_with_context"]


def test_the_vocabulary_is_read_from_sentencepiece_and_answers_as_keras_hubs_own(tiny_model):
    """serve.py drops keras-hub's list and dict of the pieces (37 MiB for Gemma 3) for views of its
    SentencePiece processor (issue #35): every id, piece and lookup keras-hub and the server make the same."""
    import keras_hub
    tokenizer = keras_hub.models.GemmaTokenizer(proto=str(tiny_model / "tokenizer.model"))
    own, ids = tokenizer.get_vocabulary(), dict(tokenizer._token_to_id_map)
    pieces = pieces_of(tokenizer)
    assert isinstance(tokenizer._vocabulary, SentencePieces) and pieces_of(tokenizer) is pieces
    assert len(pieces) == len(own) > 256 and list(pieces) == own == tokenizer.get_vocabulary()
    assert pieces[-1] == own[-1] and pieces[3:9] == own[3:9]
    with pytest.raises(IndexError):
        pieces[len(own)]
    for piece in own + ["not a piece", "<start_of_turn>", ""]:
        assert (piece in pieces) == (piece in ids)
        assert tokenizer.token_to_id(piece) == ids.get(piece, tokenizer.token_to_id("<unk>"))
    assert all(tokenizer.id_to_token(i) == own[i] for i in range(len(own)))
    assert tokenizer.end_token_id == ids["<eos>"] and read_prompt_template(tiny_model / "none", pieces)


def test_end_marker_becomes_a_stop_string_only_when_it_is_not_one_token():
    def fake(tokens_per_marker):
        return types.SimpleNamespace(encode=lambda text: [7] * tokens_per_marker)
    assert template_stop(fake(1), GEMMA) == ()  # the engine's stop ids catch it
    assert template_stop(fake(5), GEMMA) == ("<end_of_turn>",)
    assert template_stop(fake(5), ARTICLE) == ()


def test_openapi_document_describes_every_route():
    documented = {(path, method.upper()) for path, methods in OPENAPI["paths"].items() for method in methods}
    served = {(path, method) for path, methods in ROUTES.items() for method in methods}
    assert documented == served


# ----------------------------------------------------------------------------- over HTTP

def test_openai_chat_plain_and_streaming_with_logprobs(server):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    compiled = server.metric("serve_compilations_total")
    messages = [{"role": "user", "content": "Name a fruit."}]
    plain = client.chat.completions.create(model="model", messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    choice = plain.choices[0]
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == plain.usage.completion_tokens
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    for token in choice.logprobs.content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert bytes(token.bytes).decode(errors="replace") == token.token
        # Greedy takes the most likely token, so its log-probability is the top alternative's.
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in token.top_logprobs) <= 1 + 1e-5
    chunks = list(client.chat.completions.create(model="model", messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [choice.finish_reason]
    streamed = [t.logprob for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in choice.logprobs.content])
    assert server.metric("serve_compilations_total") == compiled


def test_stream_order_role_first_usage_last_then_done(server):
    request = urllib.request.Request(server.url + "/v1/chat/completions", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 4
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_single_message_chat_equals_instruction_mode(server):
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a fruit."}],
                                                 "max_tokens": 12, "temperature": 0})[1]
    instruction = post(server, "/", {"instruction": "Name a fruit.", "max_tokens": 12, "temperature": 0})[1]
    assert chat["choices"][0]["message"]["content"] == instruction["completion"]
    assert chat["usage"]["prompt_tokens"] == instruction["prompt_tokens"]


def test_tokenize_shows_the_rendered_conversation_and_round_trips(server):
    status, by_messages, _ = post(server, "/tokenize", {"messages": CONVERSATION})
    assert status == 200
    assert by_messages["tokens"] == post(server, "/tokenize", {"prompt": render(CONVERSATION, ARTICLE)})[1]["tokens"]
    assert by_messages["count"] == len(by_messages["tokens"]) and by_messages["max_model_len"] == 320
    text = "Round trip: café, 42 ✓"
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
    assert [2] + bare == post(server, "/tokenize", {"prompt": text})[1]["tokens"]
    assert post(server, "/detokenize", {"tokens": bare})[1] == {"prompt": text}


def test_completions_legacy_logprobs(server):
    body = post(server, "/v1/completions", {"prompt": "Instruction:\nSay hi.\n\nResponse:\n", "max_tokens": 6,
                                            "temperature": 0, "logprobs": 2})[1]
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == body["usage"]["completion_tokens"]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"messages": []}, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "'role'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "'content'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}, "'n' must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "'tools' must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, "'response_format'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs 'logprobs'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "'top_logprobs'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "'logprobs'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "'max_completion_tokens' must be a positive integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": []}, "'stream_options'"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "'logprobs'"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "'echo'"),
    ("/tokenize", {}, "send 'prompt'"),
    ("/detokenize", {"tokens": [1, -1]}, "'tokens'"),
    ("/detokenize", {"tokens": [10 ** 9]}, "'tokens'"),
    ("/", {"prompt": "\ud800"}, "lone surrogate"),
])
def test_new_validation_errors_are_4xx_json(server, path, body, message):
    status, answer, _ = post(server, path, body)
    assert status == 400 and message in answer["error"]["message"]


def test_schemathesis_finds_no_server_error_and_no_response_outside_the_document(server, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json", "--checks",
         "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
         "--max-examples", "15", "--phases", "examples,coverage,fuzzing", "--generation-database", "none",
         "--seed", "1", "--workers", "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # Every operation was tested; schemathesis 4.32 counts one fewer than the document lists (it did
    # so from the start, at 9 of 10).
    operations = sum(len(methods) for methods in OPENAPI["paths"].values()) - 1
    assert f"Selected: {operations}/{operations}" in result.stdout and f"Tested: {operations}" in result.stdout


# ----------------------------------------------------------------------------- gemma-chat end to end

def test_gemma_chat_training_then_chat_stops_at_end_of_turn(yes_model, yes_server):
    assert json.loads((yes_model / "training.json").read_text())["prompt_template"]["name"] == "gemma-chat"
    status, answer, _ = post(yes_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Question 12: is it raining?"}], "temperature": 0})
    assert status == 200
    choice = answer["choices"][0]
    # The model writes "Yes." <end_of_turn> <eos>: generation stops at the marker, which is not in the text.
    assert choice["message"]["content"] == "Yes." and choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == len(post(yes_server, "/tokenize", {
        "prompt": "Yes.", "add_special_tokens": False})[1]["tokens"])
