"""Sampling parity with OpenAI and vLLM (issue #34): frequency/presence/repetition penalties, logit_bias,
min_tokens, stop_token_ids, ignore_eos and n, inside the compiled step and over the API."""
import collections
import json
import urllib.request

import numpy as np
import pytest

import serve
from conftest import http
from gemma_lora.engine.batch import RowSampling
from gemma_lora.engine.engine import Engine
from gemma_lora.engine.programs import ADJUST_ARRAYS, adjust_logits
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.model import load_model

# ----------------------------------------------------------------------------- the step alone


def reference_adjust(logits, at, history, prompt_length, frequency=0.0, presence=0.0, repetition=1.0, min_position=0,
                     stop_ids=(), bias=None):
    """One row, in plain Python from the published formulas: vLLM's order (logit_bias and min_tokens'
    mask first, then repetition_penalty over prompt and output tokens, then OpenAI's
    mu[j] - c[j] * frequency - (c[j] > 0) * presence over the output tokens)."""
    logits = np.array(logits, np.float64)
    for token, value in (bias or {}).items():
        logits[token] += value
    if at < min_position:
        logits[list(stop_ids)] = -np.inf
    seen = set(history[:at + 1])
    made = collections.Counter(history[prompt_length:at + 1])
    for token in seen:
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token, count in made.items():
        logits[token] -= count * frequency + (count > 0) * presence
    return logits


def row_arrays(rows, window):
    """adjust_logits' arrays for rows given as dicts of reference_adjust's keyword arguments."""
    sampler = RowSampling(len(rows))
    history = np.zeros((len(rows), window), np.int32)
    for i, row in enumerate(rows):
        sampling = dict(SAMPLER_DEFAULTS["greedy"], frequency_penalty=row.get("frequency", 0.0),
                        presence_penalty=row.get("presence", 0.0), repetition_penalty=row.get("repetition", 1.0),
                        logit_bias=row.get("bias"), min_tokens=row.get("min_tokens", 0))
        sampler.set(i, sampling, prompt_length=row["prompt_length"], model_stop_ids=row.get("stop_ids", ()))
        history[i, :len(row["history"])] = row["history"]
    return history, [getattr(sampler, name) for name in ADJUST_ARRAYS]


@pytest.mark.device
def test_penalties_bias_and_min_tokens_match_the_formulas_on_hand_made_logits():
    rng = np.random.default_rng(0)
    vocabulary, window = 40, 16
    logits = rng.normal(0, 3, (4, vocabulary)).astype(np.float32)
    rows = [
        # prompt 0..5, made 6..9 (token 7 three times, 3 once; 3 is also in the prompt), padding past `at`
        dict(history=[2, 3, 4, 5, 2, 9, 7, 7, 3, 7, 30, 31], at=9, prompt_length=6, frequency=0.5, presence=0.3,
             repetition=1.3),
        dict(history=[2, 8, 8, 1, 11], at=4, prompt_length=3, bias={1: -100.0, 5: 7.5, 39: 2.0}, min_tokens=4,
             stop_ids=(0, 6)),
        dict(history=[2, 8, 8, 1, 11, 6, 6], at=6, prompt_length=3, min_tokens=2, stop_ids=(0, 6),  # past min_tokens
             frequency=-1.0, presence=-2.0),
        dict(history=[2, 3, 4], at=2, prompt_length=2),  # nothing asked: untouched
    ]
    history, arrays = row_arrays(rows, window)
    at = np.array([row["at"] for row in rows], np.int32)
    got = np.asarray(adjust_logits(logits, at, history, *arrays))
    for i, row in enumerate(rows):
        min_position = row["prompt_length"] - 1 + row.get("min_tokens", 0) if row.get("min_tokens") else 0
        expected = reference_adjust(logits[i], row["at"], row["history"], row["prompt_length"], row.get("frequency", 0),
                                    row.get("presence", 0), row.get("repetition", 1), min_position,
                                    row.get("stop_ids", ()), row.get("bias"))
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-5, err_msg=f"row {i}")
    assert np.isneginf(got[1, [0, 6]]).all() and np.isfinite(got[2]).all()
    assert (got[3] == logits[3]).all()
    # No row asking for anything: the logits come back as they were (the cond's cheap branch).
    plain_history, plain = row_arrays([dict(history=[2, 3], prompt_length=1)] * 2, window)
    np.testing.assert_array_equal(np.asarray(adjust_logits(logits[:2], at[:2], plain_history, *plain)),
                                  logits[:2])


# ----------------------------------------------------------------------------- in a decode


@pytest.fixture(scope="module")
def engine(trained_model):
    model, _, _ = load_model(serve.parse_args(["--model", str(trained_model)]))
    engine = Engine(model, [1, 2], [64], None)
    engine.long_chunk_seconds = 0
    return engine


def row(engine, prompt, max_tokens, **fields):
    sampling = dict(SAMPLER_DEFAULTS["greedy"], **fields)
    return Generation([engine.bos] + prompt, max_tokens, sampling, 0, [], None)


def reference_greedy(model, prompt, steps, **fields):
    """Greedy decoding on the host: keras-hub's full-sequence logits for the last position, adjusted by
    reference_adjust (numpy, from the formulas), the argmax appended."""
    backbone, ids = model.backbone, list(prompt)
    for _ in range(steps):
        tokens = np.array([ids], np.int32)
        hidden = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
        logits = np.asarray(backbone.token_embedding(hidden, reverse=True))[0, -1]
        ids.append(int(np.argmax(reference_adjust(logits, len(ids) - 1, ids, len(prompt), **fields))))
    return ids[len(prompt):]


PENALTIES = dict(frequency_penalty=0.9, presence_penalty=0.6, repetition_penalty=1.4, logit_bias={77: 3.0, 78: -5.0})


@pytest.mark.device
def test_a_greedy_decode_with_penalties_and_bias_is_the_formulas_applied_to_the_model_s_logits(engine):
    prompt = [engine.bos, 40, 41, 42, 40, 41]
    g = row(engine, prompt[1:], 16, **PENALTIES)
    engine.generate([g], 1)
    expected = reference_greedy(engine.model, prompt, 16, frequency=0.9, presence=0.6, repetition=1.4,
                                bias={77: 3.0, 78: -5.0})
    assert g.ids == expected
    plain = row(engine, prompt[1:], 16)
    engine.generate([plain], 1)
    assert plain.ids != g.ids  # the penalties changed the answer (the tiny model repeats itself)


@pytest.mark.device
def test_min_tokens_stop_token_ids_and_ignore_eos_in_a_decode(engine):
    end, x = min(engine.stop_ids), 300
    for min_tokens, made in ((0, 0), (5, 5)):  # the end token biased up: it ends at once, or after min_tokens
        g = row(engine, [40, 41, 42], 12, logit_bias={end: 100.0}, min_tokens=min_tokens)
        engine.generate([g], 1)
        assert (len(g.ids), g.finish_reason) == (made, "stop")
    g = row(engine, [40, 41, 42], 6, logit_bias={end: 100.0}, ignore_eos=True)  # vLLM's, for benchmarks
    engine.generate([g], 1)
    assert g.ids == [end] * 6 and g.finish_reason == "length"
    g = row(engine, [40, 41, 42], 6, logit_bias={x: 100.0}, stop_token_ids=[x])
    engine.generate([g], 1)
    assert g.ids == [] and g.finish_reason == "stop"
    g = row(engine, [40, 41, 42], 8, logit_bias={x: 100.0}, stop_token_ids=[x], min_tokens=3)
    engine.generate([g], 1)
    assert len(g.ids) == 3 and x not in g.ids and g.finish_reason == "stop"


@pytest.mark.device
def test_a_row_taken_by_a_new_request_counts_only_that_request_s_tokens(engine):
    """One row, two requests in turn: the second's penalties must not see the first's tokens (its row's
    counts start again), so it decodes exactly as it does alone in a fresh batch."""
    first, second = row(engine, [40, 41, 42, 43, 44], 20, **PENALTIES), row(engine, [50, 51], 9, **PENALTIES)
    engine.generate([first, second], 1)
    alone = row(engine, [50, 51], 9, **PENALTIES)
    engine.generate([alone], 1)
    assert second.ids == alone.ids
    # A penalised row beside a plain one: the plain one decodes as it does alone.
    plain, penalised = row(engine, [60, 61], 8), row(engine, [70, 71], 8, **PENALTIES)
    engine.generate([plain, penalised], 2)
    lone = row(engine, [60, 61], 8)
    engine.generate([lone], 1)
    assert plain.ids == lone.ids


# ----------------------------------------------------------------------------- over the API


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def complete(server, **body):
    return http("POST", server.url + "/v1/completions", {"prompt": "The quick brown", "max_tokens": 6, **body})


def streamed(server, path, body):
    request = urllib.request.Request(server.url + path, data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [e[len("data: "):] for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_n_answers_share_the_prompt_and_answer_i_is_seed_plus_i(server):
    body = {"n": 4, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    status, reply, _ = complete(server, **body)
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in reply["choices"]]
    assert len(set(texts)) > 1  # distinct seeds
    _, one, _ = complete(server, max_tokens=8, temperature=1.0, seed=7)
    assert reply["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once
    for i in range(4):  # answer i is the n=1 answer with seed + i
        _, alone, _ = complete(server, max_tokens=8, temperature=1.0, seed=7 + i)
        assert alone["choices"][0]["text"] == texts[i]
    # Two prompts, n=2: prompt p's answer j at index 2p + j.
    _, two, _ = complete(server, prompt=["The quick brown", "Once upon"], n=2, temperature=1.0, seed=7, max_tokens=8)
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two["choices"][:2]] == texts[:2]
    chunks = streamed(server, "/v1/completions", {"prompt": "The quick brown", **body})
    pieces = collections.defaultdict(str)
    for chunk in chunks:
        for choice in chunk["choices"]:
            pieces[choice["index"]] += choice["text"]
    assert [pieces[i] for i in range(4)] == texts


def test_chat_n_answers_streamed_and_not(server):
    body = {"messages": [{"role": "user", "content": "Say something."}], "n": 3, "temperature": 1.0, "seed": 3,
            "max_tokens": 6}
    status, reply, _ = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    contents = [c["message"]["content"] for c in reply["choices"]]
    chunks = streamed(server, "/v1/chat/completions", body)
    roles, pieces = set(), collections.defaultdict(str)
    for chunk in chunks:
        for choice in chunk["choices"]:
            roles.update([choice["index"]] if choice["delta"].get("role") else [])
            pieces[choice["index"]] += choice["delta"].get("content") or ""
    assert roles == {0, 1, 2} and [pieces[i] for i in range(3)] == contents


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(server):
    end = "1"  # the tiny model's <eos>
    status, reply, _ = complete(server, logit_bias={end: 100}, max_tokens=10)
    assert status == 200 and reply["usage"]["completion_tokens"] == 0, reply
    _, reply, _ = complete(server, logit_bias={end: 100}, max_tokens=10, min_tokens=3)
    assert reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "stop"
    _, free, _ = complete(server, max_tokens=10, temperature=0)
    stop = free["choices"][0]["text"][:1]  # the answer's first character
    _, cut, _ = complete(server, max_tokens=10, stop=[stop], temperature=0)
    assert cut["choices"][0]["text"] == "" and cut["choices"][0]["finish_reason"] == "stop"
    _, held, _ = complete(server, max_tokens=10, stop=[stop], min_tokens=4, temperature=0)
    assert held["usage"]["completion_tokens"] >= 4
    assert held["choices"][0]["text"] and free["choices"][0]["text"].startswith(held["choices"][0]["text"])
    _, ignoring, _ = complete(server, logit_bias={end: 100}, max_tokens=5, ignore_eos=True)
    assert ignoring["usage"]["completion_tokens"] == 5 and ignoring["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", "high"), ("repetition_penalty", 0), ("repetition_penalty", 3),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"5": 101}), ("logit_bias", [1]),
    ("n", 0), ("n", 17), ("n", 1.5), ("best_of", 2), ("min_tokens", -1), ("min_tokens", 99),
    ("stop_token_ids", [-1]), ("stop_token_ids", "1"), ("ignore_eos", "yes")])
def test_bad_sampling_values_are_400_naming_the_field(server, field, value):
    status, reply, _ = complete(server, **{field: value})
    assert status == 400 and field in reply["error"]["message"], reply
    status, reply, _ = http("POST", server.url + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, field: value})
    assert status == 400 and field in reply["error"]["message"], reply


def test_the_openai_client_sends_each_field_unchanged(server):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    forced = client.completions.create(model="model", prompt="The quick brown", max_tokens=4, logit_bias={"300": 100})
    _, ids, _ = http("POST", server.url + "/tokenize", {"prompt": forced.choices[0].text, "add_special_tokens": False})
    assert ids["tokens"] == [300] * 4
    reply = client.completions.create(
        model="model", prompt="The quick brown", max_tokens=6, n=2, seed=5, temperature=1.0, frequency_penalty=0.5,
        presence_penalty=0.5, logit_bias={"1": 100},
        extra_body={"min_tokens": 2, "repetition_penalty": 1.2, "stop_token_ids": [300], "ignore_eos": False})
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "stop" for c in reply.choices) and reply.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, logit_bias={"300": 100}, presence_penalty=-1)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == forced.choices[0].text


def test_a_grammar_holds_under_penalties_and_bias(server):
    """The grammar's mask comes last: whatever the penalties and biases push up, the answer keeps to it."""
    pattern = "[0-9]{3}-[0-9]{4}"
    status, reply, _ = complete(server, max_tokens=12, temperature=0, frequency_penalty=2, presence_penalty=2,
                                repetition_penalty=2, logit_bias={"300": 100, "1": 100},
                                structured_outputs={"regex": pattern})
    assert status == 200, reply
    import re
    assert re.fullmatch(pattern, reply["choices"][0]["text"]), reply["choices"][0]["text"]
