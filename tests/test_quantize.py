"""Memory: bf16 and int8/int4 serving, QLoRA training, and clear loading errors."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, YES_QUESTIONS, http, script_env
from gemma_lora.chat import TEMPLATES
from gemma_lora.engine.engine import Engine
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.model import load_causal_lm, load_model

SERVE = ["--length-buckets", "64", "--max-batch-size", "1"]


def info(server):
    _, text, _ = http("GET", server.url + "/metrics")
    line = next(line for line in text.splitlines() if line.startswith("serve_model_info{"))
    return line, server.metric("serve_weight_bytes")


def greedy(server, prompt, max_tokens=8):
    status, answer, _ = http("POST", server.url + "/", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, answer
    return answer["completion"]


def float32_bytes(model_dir):
    import serve
    args = serve.parse_args(["--model", str(model_dir), "--dtype", "float32"])
    model, dtype, _ = load_model(args)
    assert dtype == "float32" and {w.dtype for w in model.weights} == {"float32"}
    return sum(w.value.nbytes for w in model.weights)


def test_a_bf16_preset_is_served_in_bf16_unless_told_otherwise(bf16_model, start_server):
    server = start_server(bf16_model, *SERVE)
    line, bf16_bytes = info(server)
    assert 'dtype="bfloat16"' in line and ": bfloat16," in server.output()
    assert greedy(server, "Hello")
    assert bf16_bytes == pytest.approx(float32_bytes(bf16_model) / 2, rel=0.01)  # --dtype float32 overrides


def test_int8_serving_shrinks_the_weights_and_never_compiles_per_request(trained_model, start_server):
    server = start_server(trained_model, *SERVE, "--quantize", "int8")
    compiled = server.metric("serve_compilations_total")
    line, int8_bytes = info(server)
    assert 'quantize="int8"' in line and "with int8 weights" in server.output()
    # On the CPU a lone request decodes in two rows: XLA's int8 matrix-vector product is the slow path.
    assert "warm-up: batch 2:" in server.output() and "warm-up: batch 1:" not in server.output()
    assert all(greedy(server, f"Instruction:\nQuestion {i}\n\nResponse:\n") for i in range(3))
    http("POST", server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 5, "stream": True})
    assert server.metric("serve_compilations_total") == compiled
    float_bytes = float32_bytes(trained_model)
    assert int8_bytes < 0.3 * float_bytes
    import serve
    int4, _, _ = load_model(serve.parse_args(["--model", str(trained_model), "--quantize", "int4"]))
    assert sum(w.value.nbytes for w in int4.weights) < int8_bytes


def test_on_a_cpu_decode_chunks_run_in_loops_whatever_the_weights(trained_model, monkeypatch):
    """A CPU decodes as fast in loops as unrolled once the loops take the attention kernels laid out and the
    cache by row, float32 and int8, at a third of the instructions (issue #35): nothing is unrolled there.
    Off a CPU, large weights are, from batch 2."""
    import jax
    import serve
    from gemma_lora.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "UNROLL_FROM_BYTES", 0)  # the tiny model, as if large enough to unroll
    unrolled = {}
    for quantize in ("none", "int8"):
        model, _, _ = load_model(serve.parse_args(["--model", str(trained_model), "--quantize", quantize]))
        unrolled[quantize] = Engine(model, [1, 2], [64], None).unrolled
    expected = set() if jax.default_backend() == "cpu" else {2}
    assert unrolled == {"none": expected, "int8": expected}


def test_qlora_trains_serves_and_its_adapter_reproduces_the_saved_model(yes_model, yes_server, tiny_model):
    record = json.loads((yes_model / "training.json").read_text())
    assert record["base_quantization"] == "int8"
    assert record["history"][-1]["loss"] < 0.5 * record["history"][0]["loss"]
    import keras_hub
    import train_local
    template = TEMPLATES["gemma-chat"]
    prompts = [template["prompt"].format(instruction=q) for q in YES_QUESTIONS[::5]]
    served = [greedy(yes_server, p) for p in prompts]  # the saved preset serves as it is
    assert all(answer == "Yes." for answer in served)

    # The adapter, reloaded onto the int8 base it was trained on, gives the saved model's logits (up to
    # int8 rounding, far below what training changed) and its greedy answers.
    saved = keras_hub.models.CausalLM.from_preset(str(yes_model))
    base = keras_hub.models.CausalLM.from_preset(str(tiny_model))
    rebuilt = keras_hub.models.CausalLM.from_preset(str(tiny_model))
    train_local.quantize_base(rebuilt, "int8")
    rebuilt.backbone.enable_lora(rank=16)
    rebuilt.backbone.load_lora_weights(str(yes_model / "adapter.lora.h5"))
    engine = Engine(rebuilt, [1], [64], None)
    ids = np.array([[engine.bos] + engine.encode(prompts[0] + "Yes.")], np.int32)
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    logits = {name: np.asarray(m(x)) for name, m in [("saved", saved), ("base", base), ("rebuilt", rebuilt)]}
    assert np.abs(logits["rebuilt"] - logits["saved"]).max() < 0.1 * np.abs(logits["saved"] - logits["base"]).max()
    for prompt, answer in zip(prompts, served):
        g = Generation([engine.bos] + engine.encode(prompt), 8, SAMPLER_DEFAULTS["greedy"], 0, [], None)
        engine.generate([g], 1)
        assert g.text == answer


def run_serve(*args, cwd=None):
    return subprocess.run([sys.executable, str(REPO / "serve.py"), *map(str, args)], capture_output=True, text=True,
                          env=script_env(), cwd=cwd, timeout=300)


def test_serving_before_training_is_one_clear_line_before_listening(tmp_path):
    result = run_serve("--port", "1", cwd=tmp_path)  # the default ./gemma-2b-dolly-lora does not exist
    assert result.returncode == 2
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "python3 train_local.py" in lines[0] and "--model" in lines[0]
    assert "listening" not in result.stdout


def test_bad_quantization_combinations_are_one_clear_line(tiny_model, tmp_path):
    result = run_serve("--model", tiny_model, "--quantize", "int8", "--distribution", "model")
    assert result.returncode == 2 and "--quantize cannot be combined with --distribution model" in result.stderr
    result = subprocess.run([sys.executable, str(REPO / "train_local.py"), "--model", tiny_model, "--quantize",
                             "gptq"], capture_output=True, text=True, env=script_env(), timeout=300)
    assert result.returncode == 2 and "invalid choice: 'gptq'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.device
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_decode_as_keras_hub_computes_the_sequence(mode):
    """The engine's steps on int8/int4 layers (and an int8 embedding, as serve.py --quantize makes them):
    each decoded token's logits are keras-hub's own full-sequence call on the same quantized model."""
    import keras
    import keras_hub
    from test_prefix_cache import decode_row_by_row_against_the_whole_sequence
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=16,
                                              dtype="float32")
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.quantize(mode)
    modes = {getattr(layer.dtype_policy, "quantization_mode", None) for layer in backbone._flatten_layers()}
    assert mode in modes
    decode_row_by_row_against_the_whole_sequence(model)


def test_quantizing_collects_garbage_once_not_per_kernel(trained_model, tmp_path, monkeypatch):
    # Keras collects after every variable a layer drops; quantizing drops every kernel, and those collections
    # were most of int8's load time (issue #49 item 2: 37 of 44 s for Gemma 3 270M here). Both scripts skip them
    # and collect once after; the kernels still go (with their last reference), and the weights are int8.
    import gc

    import serve
    import train_local
    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or collect(*a))
    model, _, _ = load_model(serve.parse_args(["--model", str(trained_model), "--quantize", "int8"]))
    kernels = [layer for layer in model.backbone._flatten_layers() if getattr(layer, "quantization_mode", None)]
    assert len(kernels) >= 10 and all("int8" in {w.dtype for w in layer.weights} for layer in kernels)
    assert len(calls) <= 3  # loading's and quantizing's release_freed_memory, not one a kernel
    assert gc.collect is not collect and not any(w.dtype == "float32" and w.path.endswith("/kernel")
                                                 for layer in kernels for w in layer.weights)
    calls.clear()
    train_local.quantize_base(load_causal_lm(str(trained_model)), "int8")
    assert len(calls) == 1
