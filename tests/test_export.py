"""train_local.py --export: a PEFT adapter and a transformers model that carry what was trained."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import train_local
from gemma_lora.adapters import LORA_MODULES
from gemma_lora.model import MappedSafetensors, load_causal_lm, mapped_safetensors

TOKENS = {"token_ids": np.array([[2, 5, 17, 99, 300, 7, 8, 9, 40, 41]]), "padding_mask": np.ones((1, 10), bool)}


def logits(model_dir):
    import keras_hub
    return np.asarray(keras_hub.models.CausalLM.from_preset(str(model_dir))(TOKENS))


def assert_same_logits(got, want):
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def merged_by_peft_math(peft_dir, base_dir, out):
    """PEFT's own definition, W + (lora_alpha / r) * B @ A, applied in numpy to the base's transformers-
    layout weights and saved beside its config and tokenizer, for keras-hub's transformers converter
    (the path hf:// models take)."""
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    lora = load_file(str(peft_dir / "adapter_model.safetensors"))
    weights = load_file(str(base_dir / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." in key:
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            assert a.shape[0] == b.shape[1] == config["r"]
            target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[target] = weights[target] + config["lora_alpha"] / config["r"] * b @ a
    out.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(base_dir / name, out)
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.mark.device
def test_peft_export_under_peft_math_gives_the_merged_model(no_model, tiny_model, tmp_path):
    config = json.loads((no_model / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == str(tiny_model)
    # rank 4 over 4 query heads: the exact form of Keras's head-shared B is rank 16; value is zero-padded to it.
    assert config["r"] == 16 and config["lora_alpha"] == 16
    lora = load_file(str(no_model / "peft" / "adapter_model.safetensors"))
    assert {k for k in lora} == {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
                                 for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"}
    ours = logits(no_model)
    assert_same_logits(logits(merged_by_peft_math(no_model / "peft", tiny_model, tmp_path / "merged")), ours)
    assert np.abs(logits(tiny_model) - ours).max() > 0.1  # and the adapter is really in there


@pytest.mark.device
def test_peft_export_of_all_linear_lora_with_alpha_under_peft_math(chat_model, tiny_model, tmp_path):
    """Every projection, alpha = 2 x rank, trained over an int8 base: PEFT's math on the float base gives
    the merged preset, and the config keeps the trained scale (lora_alpha / r = 2)."""
    config = json.loads((chat_model / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(LORA_MODULES)
    assert config["r"] == 16 and config["lora_alpha"] / config["r"] == 2.0
    lora = load_file(str(chat_model / "peft" / "adapter_model.safetensors"))
    where = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    assert set(lora) == {f"base_model.model.model.layers.{i}.{where[m]}.{m}.lora_{ab}.weight"
                         for i in range(2) for m in where for ab in "AB"}
    ours = logits(chat_model)
    assert_same_logits(logits(merged_by_peft_math(chat_model / "peft", tiny_model, tmp_path / "merged")), ours)
    assert np.abs(logits(tiny_model) - ours).max() > 0.1


@pytest.mark.parametrize("fixture", ["no_model", "chat_model"])
def test_transformers_export_reloads_with_the_merged_logits(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    config = json.loads((model_dir / "transformers" / "config.json").read_text())
    assert config["architectures"] == ["GemmaForCausalLM"] and config["model_type"] == "gemma"
    assert (model_dir / "transformers" / "tokenizer.model").is_file()
    assert_same_logits(logits(model_dir / "transformers"), logits(model_dir))


def test_transformers_export_never_drops_an_unmerged_lora(no_model, tiny_model, tmp_path):
    """keras-hub's exporter reads raw kernels: a LoRA-enabled model exports as if it had no adapter."""
    import keras_hub
    model = keras_hub.models.CausalLM.from_preset(str(tiny_model))
    model.backbone.enable_lora(rank=4)
    model.backbone.load_lora_weights(str(no_model / "adapter.lora.h5"))
    model.export_to_transformers(str(tmp_path / "raw"))
    config = json.loads((tmp_path / "raw" / "config.json").read_text())
    (tmp_path / "raw" / "config.json").write_text(json.dumps(config | {"architectures": ["GemmaForCausalLM"]}))
    assert_same_logits(logits(tmp_path / "raw"), logits(tiny_model))  # the trap: the adapter is gone
    with pytest.raises(train_local.UserError, match="merged"):
        train_local.export_transformers(tmp_path, model)


def test_export_only_needs_a_trained_output(run_train, tmp_path):
    result = run_train("--output", tmp_path / "nothing", "--export", "peft", "--export-only")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--export-only" in result.stderr and "train first" in result.stderr
    result = run_train("--output", tmp_path, "--export-only")
    assert result.returncode == 2 and "--export-only needs --export" in result.stderr


def test_mapped_safetensors_reads_what_safetensors_reads(tmp_path):
    """The loader's own reader (a view of the mapped file, no copy off a CPU) gives safetensors' tensors, dtype
    for dtype, and keras-hub's module is handed back afterwards."""
    import ml_dtypes
    from keras_hub.src.utils.transformers import safetensor_utils
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.normal(size=(3, 5)).astype(np.float32), "f16": rng.normal(size=(7,)).astype(np.float16),
               "bf16": rng.normal(size=(2, 3, 4)).astype(ml_dtypes.bfloat16), "i8": np.arange(-4, 5, dtype=np.int8),
               "i64": np.arange(6, dtype=np.int64).reshape(2, 3), "bool": np.array([True, False, True]),
               "scalar": np.array(2.5, dtype=np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    for copy in (False, True):
        with MappedSafetensors(tmp_path / "model.safetensors", copy) as f:
            assert sorted(f.keys()) == sorted(tensors)
            for name, expected in tensors.items():
                got = f.get_tensor(name)
                assert got.dtype == expected.dtype and got.shape == expected.shape, name
                np.testing.assert_array_equal(got, expected, err_msg=name)
                assert got.flags.writeable == copy  # a view of the read-only map, or a copy of its own
            kept = f.get_tensor("f32")
        np.testing.assert_array_equal(kept, tensors["f32"])  # a view outlives the file's context
    original = safetensor_utils.safetensors
    with mapped_safetensors():
        assert safetensor_utils.safetensors is not original
    assert safetensor_utils.safetensors is original


def test_train_local_trains_and_exports_without_tensorflow(tiny_model, compile_cache, tmp_path):
    """TensorFlow is installed here, and keras-hub imports it whenever it can: train_local.py keeps it out
    (about 800 MiB of RSS), and IPython, which keras imports only to spot a notebook, through loading,
    training, saving and both exports. What it saves still loads
    in keras-hub with the task's own preprocessor, as the article's scripts expect."""
    import importlib.util
    import subprocess
    import sys

    import keras_hub
    from conftest import REPO, SAMPLE_DATA, script_env
    assert importlib.util.find_spec("tensorflow") is not None
    out = tmp_path / "model"
    check = ("import sys; sys.path.insert(0, {repo!r}); import train_local; "
             "code = train_local.main({argv!r}); "
             "print('TENSORFLOW', sys.modules.get('tensorflow') is not None, "
             "'tensorflow' in open('/proc/self/maps').read(), 'IPYTHON', sys.modules.get('IPython') is not None); "
             "sys.exit(code)")
    argv = ["--model", str(tiny_model), "--data", str(SAMPLE_DATA), "--limit", "16", "--eval-examples", "4",
            "--max-steps", "2", "--output", str(out), "--export", "peft,transformers", "--compile-cache", compile_cache]
    result = subprocess.run([sys.executable, "-c", check.format(repo=str(REPO), argv=argv)], capture_output=True,
                            text=True, env=script_env(), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TENSORFLOW False False IPYTHON False" in result.stdout  # keras' notebook check kept out too
    assert (out / "peft" / "adapter_config.json").is_file() and (out / "transformers" / "config.json").is_file()
    model = keras_hub.models.CausalLM.from_preset(str(out))
    assert type(model.preprocessor) is type(model).preprocessor_cls
    assert len(np.asarray(model.preprocessor.tokenizer("The river"))) > 0
    assert_same_logits(logits(out / "transformers"), np.asarray(model(TOKENS)))


def test_a_model_loads_from_zeros_and_every_weight_is_read(tiny_model):
    """load_causal_lm starts random-initialized variables as zeros (cheaper): the checkpoint overwrites every
    one, so the model equals keras-hub's own load, and random initializers are random again afterwards."""
    import keras
    import keras_hub
    plain = keras_hub.models.CausalLM.from_preset(str(tiny_model), preprocessor=None)
    loaded = load_causal_lm(str(tiny_model))
    assert [w.path for w in loaded.weights] == [w.path for w in plain.weights]
    for ours, theirs in zip(loaded.weights, plain.weights):
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path)
    dense = keras.layers.Dense(4)
    dense.build((None, 3))
    assert np.all(np.asarray(dense.kernel.value) != 0)
