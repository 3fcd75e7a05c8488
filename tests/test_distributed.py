"""Data- and model-parallel training and serving on a simulated 4-device CPU mesh.

XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX starts, so every run here is
a subprocess; the results are compared with a single-device run from the same seed.
"""
import concurrent.futures
import json

import numpy as np
import pytest

import train_local
from conftest import SAMPLE_DATA, burst_until_grouped, http, script_env
from gemma_lora.model import layout_map_for

FOUR_DEVICES = script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, run_train):
    base = tmp_path_factory.mktemp("dist")
    common = ["--model", tiny_model, "--data", SAMPLE_DATA, "--limit", 32, "--eval-examples", 12,
              "--learning-rate", 1e-3, "--seed", 3]
    settings = [("single", [], None), ("data", ["--distribution", "data"], FOUR_DEVICES),
                ("model", ["--distribution", "model", "--mesh", "2,2"], FOUR_DEVICES),
                ("model_1x4", ["--distribution", "model", "--mesh", "1,4"], FOUR_DEVICES)]

    def train(setting):
        name, extra, env = setting
        return name, (base / name, run_train(*common, *extra, "--output", base / name, env=env, check=True).stdout)
    # Two at a time: much of a run (imports, tracing) is one thread's work, and the machine has two cores.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(train, settings))


def record(path):
    return json.loads((path / "training.json").read_text())


@pytest.mark.parametrize("name, mode", [("data", "data"), ("model", "model"), ("model_1x4", "model")])
def test_parallel_runs_end_with_the_single_device_eval_loss(runs, name, mode):
    single, parallel = record(runs["single"][0]), record(runs[name][0])
    assert parallel["distribution"] == mode and parallel["devices"] == 4
    assert single["distribution"] == "off" and single["devices"] == 1
    assert parallel["eval_loss_after"] == pytest.approx(single["eval_loss_after"], abs=1e-3)
    assert parallel["eval_loss_after"] != pytest.approx(parallel["eval_loss_before"], abs=1e-4)  # it trained
    assert f"distribution: {mode} over 4 cpu devices" in runs[name][1]


def test_model_parallel_output_reloads_on_one_device_with_the_same_outputs(runs):
    import keras_hub
    x = {"token_ids": np.array([[2, 100, 200, 300, 400, 500, 600]], np.int32), "padding_mask": np.ones((1, 7), bool)}
    single = keras_hub.models.CausalLM.from_preset(str(runs["single"][0]))
    sharded = keras_hub.models.CausalLM.from_preset(str(runs["model"][0]))
    assert np.allclose(np.asarray(single(x)), np.asarray(sharded(x)), atol=1e-3)


def test_kv_heads_stay_replicated_when_fewer_than_model_shards(tiny_model):
    import keras
    mesh = keras.distribution.DeviceMesh(shape=(2, 2), axis_names=("batch", "model"),
                                         devices=np.array([f"cpu:{i}" for i in range(4)]))
    layout = layout_map_for(str(tiny_model), mesh, 2)
    assert layout["decoder_block_0/attention/key/kernel"].axes[0] is None  # tiny model: one KV head
    assert layout["decoder_block_0/attention/value/kernel"].axes[0] is None
    assert layout["decoder_block_0/attention/query/kernel"].axes[0] == "model"


def test_batch_that_does_not_divide_the_batch_axis_is_a_clear_error(tmp_path, tiny_model, run_train):
    result = run_train("--model", tiny_model, "--data", SAMPLE_DATA, "--limit", 8, "--batch-size", 6,
                       "--output", tmp_path / "m", env=FOUR_DEVICES)
    assert result.returncode == 2 and "does not divide over the 4 devices" in result.stderr
    assert "Traceback" not in result.stderr


PROMPTS = ["Instruction:\nWhat is 2 plus 2?\n\nResponse:\n", "Instruction:\nName a river.\n\nResponse:\n",
           "Hello there", "Instruction:\nSpell 'pear' backwards.\n\nResponse:\n", "Hi", "Good day"]


def completions(server):
    out = []
    for prompt in PROMPTS:
        for body in ({"prompt": prompt, "max_tokens": 12, "temperature": 0},
                     {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "top_k": 20, "seed": 7}):
            status, answer, _ = http("POST", server.url + "/", body)
            assert status == 200
            out.append(answer["completion"])
    return out


def test_serving_on_a_mesh_answers_like_one_device(runs, start_server):
    model_dir = runs["model"][0]
    # A batch window long enough that concurrent requests below usually start together.
    flags = ["--length-buckets", "64", "--max-batch-size", "4", "--batch-window-ms", "100"]
    one = start_server(model_dir, *flags)
    expected = completions(one)
    one.stop()
    for extra in (["--distribution", "model", "--mesh", "2,2"], ["--distribution", "data"]):
        server = start_server(model_dir, *flags, *extra, env=FOUR_DEVICES)
        compiled = server.metric("serve_compilations_total")
        assert completions(server) == expected, extra
        # Concurrent requests share a batch, joining and leaving its rows, still without compiling.
        # Different prompts: the same one twice is prefilled once, not as a group; the short ones (no full
        # block in the prefix cache) are grouped when they arrive together.
        greedy = [{"prompt": p, "max_tokens": n, "temperature": 0} for n in (3, 12) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda body: http("POST", server.url + "/", body)[1]["completion"], greedy))
        assert answers[len(PROMPTS):] == expected[0::2], extra
        # Whether the 12 above were admitted together was up to the machine's load (CI once saw none):
        # short new prompts, more than the rows.
        assert burst_until_grouped(server, lambda burst, i: f"burst {burst} {i}"), extra
        assert server.metric("serve_compilations_total") == compiled, extra
        assert "distribution:" in server.output()
        server.stop()


AHEAD_ON_A_MESH = """
import json, sys
import numpy as np
import serve
from gemma_lora.engine.compilation import on_compilation
from gemma_lora.engine.core import batch_buckets, setup_distribution
from gemma_lora.engine.engine import Engine
from gemma_lora.interface import Generation
from gemma_lora.metrics import METRICS
from gemma_lora.model import load_model
args = serve.parse_args(["--model", sys.argv[1], "--distribution", "model", "--mesh", "2,2"])
distribution, batch_axis = setup_distribution(args)
model, _, _ = load_model(args)
engine = Engine(model, batch_buckets(4, batch_axis), [64], distribution, dispatch_ahead=True)
engine.warm_up()
compiled = []
on_compilation(lambda: compiled.append(1))

def run(ahead, groups=engine.group_sizes):
    engine.dispatch_ahead, engine.group_sizes = ahead, groups
    rows = [Generation([engine.bos] + list(range(300 + 40 * i, 304 + 43 * i)), 5 + 2 * i,
                       {"temperature": 1.0, "top_k": 40, "top_p": 1.0}, i, [], None) for i in range(8)]
    engine.generate(rows, 4)
    return [g.ids for g in rows]
ahead = run(True)
grouped = METRICS.grouped_prompts
out = {"ahead": ahead, "compiled": len(compiled), "grouped": grouped, "plain": run(False), "alone": run(False, [])}
# What the host feeds a step must not change with the host's array after the call (on a CPU mesh
# device_put reads a numpy array's memory later).
changed = 0
for size in (4, 8):
    for replicated in (False, True):
        for _ in range(200):
            host = np.zeros(size, np.int32)
            fed = engine.feed(host, replicated)
            host += 7
            changed += int(np.asarray(fed).any())
out["changed"] = changed
print(json.dumps(out))
"""


def test_chunks_dispatched_ahead_on_a_mesh_answer_the_same_and_compile_nothing(runs):
    """On a GPU or TPU mesh the engine dispatches each chunk before reading the one ahead of it; the
    tokens it then starts from must come back split as the host's would, or the next chunk compiles.
    Prompts prefilled in a group must come back in the layout a lone prefill's do, for the same reason."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", AHEAD_ON_A_MESH, str(runs["model"][0])], env=FOUR_DEVICES,
                            cwd=train_local.__file__.rsplit("/", 1)[0], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["compiled"] == 0
    assert out["ahead"] == out["plain"] and all(out["ahead"])
    # Prompts admitted together are prefilled together on a mesh too, and answer as when prefilled alone.
    assert out["grouped"] >= 4 and out["alone"] == out["plain"]
    assert out["changed"] == 0
