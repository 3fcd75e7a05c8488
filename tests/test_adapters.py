"""Many adapters over one base: per-request routing, mixed batches, run-time loading, start-up checks."""
import concurrent.futures
import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, SAMPLE_DATA, YES_QUESTIONS, http, plain_prefill, script_env
from gemma_lora.adapters import AdapterError, read_adapter
from gemma_lora.engine.adapter_slots import AdapterSlots
from gemma_lora.engine.engine import Engine
from gemma_lora.model import load_model

CHAT = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
ARTICLE = "Instruction:\n{}\n\nResponse:\n"
QUESTIONS = [f"Question {i}: is the sky {colour}?" for i, colour in zip(range(20, 25), ["blue", "red", "pink", "grey",
                                                                                      "green"])]
INSTRUCTIONS = [json.loads(line)["instruction"] for line in SAMPLE_DATA.read_text().splitlines()[40:45]]
# Both templates, so each adapter is asked in its own format and in the other one (where it says less).
PROMPTS = [CHAT.format(q) for q in QUESTIONS] + [ARTICLE.format(i) for i in INSTRUCTIONS]


@pytest.fixture(scope="module")
def merged_no_server(no_model, start_server):
    return start_server(no_model, "--length-buckets", "64", "--max-batch-size", "1")


@pytest.fixture(scope="module")
def base_server(tiny_model, start_server):
    return start_server(tiny_model, "--length-buckets", "64", "--max-batch-size", "1")


def greedy(server, prompt, model=None, max_tokens=10):
    """The greedy tokens of a completion with their log-probabilities (the legacy `logprobs` object)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2}
    if model is not None:
        body["model"] = model
    status, answer, _ = http("POST", server.url + "/v1/completions", body)
    assert status == 200, answer
    assert model is None or answer["model"] == model
    return answer["choices"][0]["logprobs"]


def assert_same_greedy(got, want):
    """Float rounding only: at least 9 of 10 prompts give the very same tokens (with log-probabilities
    within 1e-3), and where one does not, its first differing token was a near-tie."""
    same = 0
    for g, w in zip(got, want):
        if g["tokens"] == w["tokens"]:
            same += 1
            assert np.allclose(g["token_logprobs"], w["token_logprobs"], atol=1e-3)
            continue
        k = next(i for i, (a, b) in enumerate(zip(g["tokens"], w["tokens"])) if a != b)
        alternatives = w["top_logprobs"][k]
        assert g["tokens"][k] in alternatives, (g, w)
        assert abs(alternatives[g["tokens"][k]] - w["token_logprobs"][k]) < 1e-2, (g, w)
    assert same >= 9, (got, want)


def test_each_adapter_answers_as_its_merged_preset_alone_and_mixed_in_one_batch(
        adapter_server, yes_server, merged_no_server, base_server):
    references = {"yes": [greedy(yes_server, p) for p in PROMPTS],
                  "no": [greedy(merged_no_server, p) for p in PROMPTS],
                  None: [greedy(base_server, p) for p in PROMPTS]}
    # The adapters matter: each changes most answers of the base.
    for name in ("yes", "no"):
        assert sum(a["tokens"] != b["tokens"] for a, b in zip(references[name], references[None])) >= 5
    assert ["".join(r["tokens"]).startswith("Yes.") for r in references["yes"][:5]] == [True] * 5
    alone = {name: [greedy(adapter_server, p, name) for p in PROMPTS] for name in references}
    for name in references:
        assert_same_greedy(alone[name], references[name])

    batches = adapter_server.metric("serve_batches_total", labels='size="4"')
    jobs = [(name, p) for p in PROMPTS for name in references]  # interleaved: every batch holds a mix
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda job: greedy(adapter_server, job[1], job[0]), jobs))
    for name in references:
        assert_same_greedy([m for (n, _), m in zip(jobs, mixed) if n == name], references[name])
    assert adapter_server.metric("serve_batches_total", labels='size="4"') > batches


def test_requests_pick_adapters_by_model_and_use_their_templates(adapter_server, tiny_model, yes_model, no_model):
    url = adapter_server.url
    _, models, _ = http("GET", url + "/v1/models")
    by_id = {m["id"]: m for m in models["data"]}
    assert by_id.keys() == {tiny_model.name, "yes", "no", "chat"}
    assert by_id["yes"]["parent"] == by_id["no"]["parent"] == tiny_model.name
    assert by_id["yes"]["root"] == str(yes_model) and by_id["no"]["root"] == str(no_model)
    question = "Question 7: is the sky red?"
    # Instruction mode and chat render with the adapter's own recorded template (yes: Gemma's turns;
    # no: the article's), so each answers as it was trained.
    for name, word in (("yes", "Yes."), ("no", "No.")):
        status, answer, _ = http("POST", url + "/", {"instruction": question, "model": name, "temperature": 0,
                                                     "max_tokens": 6})
        assert status == 200 and answer["completion"].strip().startswith(word), answer
        status, chat, _ = http("POST", url + "/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 6})
        assert status == 200 and chat["model"] == name and chat["choices"][0]["message"]["content"].startswith(word)
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Hi"}]}), ("/", {"prompt": "Hi"})):
        status, error, _ = http("POST", url + path, body | {"model": "gpt-4o"})
        assert status == 404, error
        assert error["error"]["type"] == "not_found_error" and error["error"]["code"] == "model_not_found"
    _, metrics, _ = http("GET", url + "/metrics")
    assert 'serve_model_requests_total{model="yes"}' in metrics
    assert 'serve_model_generated_tokens_total{model="no"}' in metrics


def test_adapters_load_and_unload_at_run_time_without_compiling(adapter_server, yes_model, tmp_path, run_train):
    url = adapter_server.url
    exported = tmp_path / "yes"
    shutil.copytree(yes_model, exported)
    run_train("--output", exported, "--export", "peft", "--export-only", check=True)
    compilations = adapter_server.metric("serve_compilations_total")
    status, loaded, _ = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "yes-peft",
                                                                      "lora_path": str(exported / "peft")})
    assert status == 200 and loaded["id"] == "yes-peft", loaded
    # The PEFT export of an adapter answers as the adapter does (it carries no template: ask raw).
    assert_same_greedy([greedy(adapter_server, p, "yes-peft") for p in PROMPTS],
                       [greedy(adapter_server, p, "yes") for p in PROMPTS])
    assert any(m["id"] == "yes-peft" and m["parent"] for m in http("GET", url + "/v1/models")[1]["data"])

    for body, status, words in (
            ({"lora_name": "again", "lora_path": str(exported / "peft")}, 409, "slots are in use"),
            ({"lora_name": "yes", "lora_path": str(exported / "peft")}, 409, "is taken"),
            ({"lora_name": "x", "lora_path": str(tmp_path / "nothing")}, 400, "no such directory"),
            ({"lora_name": "x"}, 400, "lora_path")):
        got, error, _ = http("POST", url + "/v1/load_lora_adapter", body)
        assert got == status and words in error["error"]["message"], (body, error)

    # Unloading while its requests run lets them finish; new ones get 404; its slot is free again.
    jobs = [{"prompt": CHAT.format(q), "model": "yes-peft", "max_tokens": 30, "temperature": 0, "stop": "@@"}
            for q in QUESTIONS * 2]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        running = [pool.submit(http, "POST", url + "/v1/completions", job) for job in jobs]
        time.sleep(0.2)
        status, unloaded, _ = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "yes-peft"})
        assert status == 200, unloaded
        answers = [f.result() for f in running]
    assert [a[0] for a in answers].count(200) + [a[0] for a in answers].count(404) == len(jobs)
    assert any(a[0] == 200 for a in answers)
    status, error, _ = http("POST", url + "/v1/completions", {"prompt": "Hi", "model": "yes-peft"})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, error, _ = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "yes-peft"})
    assert status == 404
    status, _, _ = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "yes-again",
                                                                "lora_path": str(exported / "peft")})
    assert status == 200
    assert http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "yes-again"})[0] == 200
    assert adapter_server.metric("serve_compilations_total") == compilations


def test_a_server_without_adapter_slots_says_how_to_get_them(tiny_server):
    status, error, _ = http("POST", tiny_server.url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/"})
    assert status == 400 and "--enable-lora" in error["error"]["message"]


def serve_exit(*args, timeout=300):
    result = subprocess.run([sys.executable, str(REPO / "serve.py"), "--port", "0", "--host", "127.0.0.1", *args],
                            capture_output=True, text=True, timeout=timeout, env=script_env())
    return result.returncode, result.stdout + result.stderr


def test_an_adapter_that_cannot_be_served_is_one_line_and_exit_2(tiny_model, no_model, tmp_path, compile_cache):
    code, out = serve_exit("--model", str(tiny_model), "--adapter", f"x={tmp_path / 'missing'}")
    assert code == 2 and "--adapter x=" in out and "no such directory" in out and "Traceback" not in out
    assert "listening" not in out  # said before binding the port
    # no's query LoRA is rank 4 over 4 heads: 16 in PEFT's form.
    code, out = serve_exit("--model", str(tiny_model), "--adapter", f"no={no_model}", "--max-lora-rank", "8",
                           "--compile-cache", compile_cache)
    assert code == 2 and "Traceback" not in out, out
    [line] = [line for line in out.splitlines() if "--adapter" in line]
    assert "--adapter no=" in line and "rank 16" in line and "--max-lora-rank 8" in line
    code, out = serve_exit("--model", str(tiny_model), "--adapter", f"{tiny_model.name}={no_model}",
                           "--compile-cache", compile_cache)
    assert code == 2 and "the base model's name" in out and "Traceback" not in out, out


@pytest.fixture(scope="module")
def tiny(tiny_model):
    import serve
    model, _, shapes = load_model(serve.parse_args(["--model", str(tiny_model)]))
    return serve, model, shapes


@pytest.mark.device
def test_an_unloaded_adapter_keeps_its_slot_until_its_last_generation_ends(tiny, no_model, yes_model):
    import jax
    serve, model, shapes = tiny
    vocabulary = model.preprocessor.tokenizer.get_vocabulary()
    slots = AdapterSlots(model.backbone, shapes, ["q_proj", "v_proj"], 1, 64, put=jax.device_put)
    no = read_adapter("no", no_model, model.backbone, shapes, vocabulary)
    slots.load(no)
    held = slots.acquire("no")
    assert held is no and no.slot == 1
    slots.unload("no")
    assert slots.acquire("no") is None  # new requests no longer find it
    yes = read_adapter("yes", yes_model, model.backbone, shapes, vocabulary)
    with pytest.raises(AdapterError) as full:
        slots.load(yes)  # the one slot still serves no's running generation
    assert full.value.status == 409
    down = np.asarray(slots.tables["0.q_proj"][0][1])
    assert np.array_equal(down[:, :no.rank], no.factors[0, "q_proj"][0])
    slots.release(held)
    slots.load(yes)
    assert yes.slot == 1 and slots.acquire("yes") is yes


@pytest.mark.device
def test_prompts_prefilled_as_a_group_each_get_their_own_adapter(tiny, no_model, yes_model):
    import jax
    serve, model, shapes = tiny
    vocabulary = model.preprocessor.tokenizer.get_vocabulary()
    slots = AdapterSlots(model.backbone, shapes, ["q_proj", "v_proj"], 2, 64, put=jax.device_put)
    for name, path in (("no", no_model), ("yes", yes_model)):
        slots.load(read_adapter(name, path, model.backbone, shapes, vocabulary))
    engine = Engine(model, [4], [64], None, adapters=slots)
    assert engine.group_sizes == [2, 4]
    prompt = [engine.bos] + engine.encode(CHAT.format(QUESTIONS[0]))
    row_slots = [0, slots.by_name["no"].slot, slots.by_name["yes"].slot, slots.by_name["no"].slot]
    block = engine.block_for(len(prompt))
    group = engine._prefill_group(engine.values, engine.tokens([prompt] * 4, block), engine.lora_tables,
                                  np.array(row_slots, np.int32))
    for slot, row in zip(row_slots, group):
        alone = plain_prefill(engine, prompt, block, slot)
        for a, b in zip(jax.tree.leaves(row), jax.tree.leaves(alone)):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, atol=1e-5)
    # The adapters change the values each row keeps (they train the value projection), and differently.
    values = [np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(row)]) for row in group[:3]]
    assert min(np.abs(values[i] - values[j]).max() for i, j in ((0, 1), (0, 2), (1, 2))) > 1e-3


@pytest.mark.device
def test_peft_adapters_are_checked_against_the_base(tiny, no_model, tmp_path):
    from safetensors.numpy import load_file, save_file
    serve, model, shapes = tiny
    vocabulary = model.preprocessor.tokenizer.get_vocabulary()
    good = no_model / "peft"
    config = json.loads((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    adapter = read_adapter("no", good, model.backbone, shapes, vocabulary)
    assert adapter.kind == "peft" and adapter.modules == ["q_proj", "v_proj"] and adapter.rank == config["r"]

    def variant(name, change_config=None, change_tensors=None):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(config | (change_config or {})))
        save_file(change_tensors(dict(tensors)) if change_tensors else tensors, str(path / "adapter_model.safetensors"))
        with pytest.raises(AdapterError) as error:
            read_adapter(name, path, model.backbone, shapes, vocabulary)
        return str(error.value)

    key = next(k for k in tensors if "q_proj.lora_A" in k)
    assert "another model" in variant("narrow", change_tensors=lambda t: t | {key: t[key][:, :-1]})
    assert "layers.9" in variant("deep", change_tensors=lambda t: t | {key.replace("layers.0.", "layers.9."): t[key]})
    assert "cannot apply" in variant("embed", change_tensors=lambda t: t | {
        "base_model.model.model.embed_tokens.lora_A.weight": t[key]})
    assert "DORA" in variant("dora", {"peft_type": "DORA"}).upper()
    assert "bias" in variant("bias", {"bias": "all"})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps(config))
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot read it"):
        read_adapter("broken", broken, model.backbone, shapes, vocabulary)
    # lora_alpha and use_rslora set the scale, folded into `up`.
    scaled = tmp_path / "scaled"
    shutil.copytree(good, scaled)
    (scaled / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 2 * config["r"]}))
    rs = tmp_path / "rslora"
    shutil.copytree(good, rs)
    (rs / "adapter_config.json").write_text(json.dumps(config | {"use_rslora": True}))
    one = adapter.factors[0, "q_proj"][1]
    assert np.allclose(read_adapter("s", scaled, model.backbone, shapes, vocabulary).factors[0, "q_proj"][1],
                       2 * one)
    assert np.allclose(read_adapter("r", rs, model.backbone, shapes, vocabulary).factors[0, "q_proj"][1],
                       np.sqrt(config["r"]) * one)


def test_adapters_stay_float32_over_an_int8_base(tiny_model, yes_model, start_server):
    server = start_server(tiny_model, "--quantize", "int8", "--adapter", f"yes={yes_model}", "--length-buckets", "64",
                          "--max-batch-size", "2")
    answers = [http("POST", server.url + "/v1/chat/completions", {
        "model": "yes", "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 6})[1]
        for q in YES_QUESTIONS[:4]]
    assert [a["choices"][0]["message"]["content"] for a in answers] == ["Yes."] * 4, answers
    assert 'quantize="int8"' in http("GET", server.url + "/metrics")[1]
