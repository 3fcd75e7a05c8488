"""serve.py as a real subprocess over real HTTP, on a tiny trained Gemma."""
import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest


from conftest import REPO, burst_until_grouped, http, raw_request, script_env
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.metrics import ThreadCPU, WORKER_PARTS

ARTICLE_PROMPT = "Instruction:\nExplain the difference between a GPU and a TPU.\n\nResponse:\n"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def post(server, body, path="/", **kw):
    return http("POST", server.url + path, body, **kw)


def good_request_works(server):
    status, body, _ = post(server, {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    return status == 200 and body["completion_tokens"] <= 3


def test_article_curl_verbatim(server):
    result = subprocess.run(
        ["curl", "-s", "-X", "POST", server.url + "/", "-H", "Content-Type: application/json",
         "-d", json.dumps({"prompt": ARTICLE_PROMPT, "max_tokens": 256})], capture_output=True, text=True, check=True)
    body = json.loads(result.stdout)
    assert body["generated_text"].startswith(ARTICLE_PROMPT)
    assert body["generated_text"] == ARTICLE_PROMPT + body["completion"]
    assert 0 <= body["completion_tokens"] <= 256 and body["finish_reason"] in ("stop", "length")
    assert body["prompt_tokens"] > 10


def test_max_tokens_counts_new_tokens(server):
    status, body, _ = post(server, {"prompt": ARTICLE_PROMPT, "max_tokens": 7, "temperature": 0})
    assert status == 200
    assert body["completion_tokens"] <= 7
    assert (body["finish_reason"] == "length") == (body["completion_tokens"] == 7)


def test_instruction_mode_applies_the_recorded_template(server):
    status, body, _ = post(server, {"instruction": "Name a fruit.", "max_tokens": 5, "temperature": 0})
    assert status == 200 and body["generated_text"].startswith("Instruction:\nName a fruit.\n\nResponse:\n")
    status, with_context, _ = post(server, {"instruction": "Summarise.", "context": "A text.", "max_tokens": 5})
    assert status == 200
    assert with_context["generated_text"].startswith("Instruction:\nSummarise.\n\nContext:\nA text.\n\nResponse:\n")
    lone = post(server, {"prompt": "Instruction:\nName a fruit.\n\nResponse:\n", "max_tokens": 5,
                         "temperature": 0})[1]
    assert lone["completion"] == body["completion"]


BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    (json.dumps({"prompt": 5}).encode(), 400, "'prompt' must be a string"),
    (json.dumps({"max_tokens": 5}).encode(), 400, "send 'prompt'"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "positive integer"),
    (json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400, "positive integer"),
    (json.dumps({"prompt": "x", "max_tokens": 2.5}).encode(), 400, "positive integer"),
    (json.dumps({"prompt": "x", "max_tokens": True}).encode(), 400, "positive integer"),
    (json.dumps({"prompt": "x", "max_tokens": "10"}).encode(), 400, "positive integer"),
    (json.dumps({"prompt": "x", "max_tokens": 1_000_000_000}).encode(), 400, "over the limit"),
    (json.dumps({"prompt": "word " * 100, "max_tokens": 300}).encode(), 400, "exceeds the longest sequence"),
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "'temperature'"),
    (json.dumps({"prompt": "x", "stop": 3}).encode(), 400, "'stop'"),
    (json.dumps({"prompt": "x" * 5000}).encode(), 413, "limit"),
]


@pytest.mark.parametrize("raw, status, message", BAD_BODIES)
def test_bad_bodies_are_4xx_json_and_the_server_keeps_serving(server, raw, status, message):
    got, body, _ = post(server, raw)
    assert got == status
    assert body["error"]["type"] == "invalid_request_error" and message in body["error"]["message"]
    assert good_request_works(server)


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n", 411),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nhi", 415),
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"DELETE / HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
])
def test_bad_requests_are_answered_and_the_server_keeps_serving(server, request_bytes, status):
    got, body = raw_request(server.port, request_bytes)
    assert got == status
    assert "message" in json.loads(body)["error"]
    assert good_request_works(server)


def test_health_usage_models(server):
    assert http("GET", server.url + "/health")[:2] == (200, {"status": "ok"})
    status, usage, _ = http("GET", server.url + "/")
    assert status == 200 and "POST /" in usage["endpoints"]
    status, models, _ = http("GET", server.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "model"


def test_openai_client_plain_and_streaming(server):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    plain = client.completions.create(model="model", prompt=ARTICLE_PROMPT, max_tokens=12, temperature=0)
    assert plain.object == "text_completion" and plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens <= 12 and plain.usage.prompt_tokens > 10
    chunks = list(client.completions.create(model="model", prompt=ARTICLE_PROMPT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    batch = client.completions.create(model="model", prompt=[ARTICLE_PROMPT, "Hello"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == \
        client.completions.create(model="model", prompt=ARTICLE_PROMPT, max_tokens=4, temperature=0).choices[0].text


def test_stream_ends_with_done(server):
    request = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Hi", "max_tokens": 5, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_strings_cut_the_completion(server):
    _, free, _ = post(server, {"prompt": ARTICLE_PROMPT, "max_tokens": 30, "temperature": 0})
    text = free["completion"]
    if len(text) < 4:
        pytest.skip("greedy completion too short to cut")
    stop = text[2:4]
    _, cut, _ = post(server, {"prompt": ARTICLE_PROMPT, "max_tokens": 30, "temperature": 0, "stop": stop})
    assert cut["completion"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"


PROMPTS = [f"Instruction:\nQuestion number {i}: {'why ' * i}?\n\nResponse:\n" for i in range(8)]


def test_concurrent_requests_get_what_a_lone_request_gets(server):
    alone = [post(server, {"prompt": p, "max_tokens": 16, "temperature": 0})[1]["completion"] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: post(server, {"prompt": p, "max_tokens": 16, "temperature": 0}),
                                 PROMPTS))
    assert all(status == 200 for status, _, _ in together)
    assert [body["completion"] for _, body, _ in together] == alone
    _, metrics, _ = http("GET", server.url + "/metrics")
    assert any(line.startswith("serve_batches_total{size=") and not line.startswith('serve_batches_total{size="1"}')
               for line in metrics.splitlines()), "concurrent requests were never batched"


def test_seeded_sampling_is_reproducible_alone_and_batched(server):
    body = {"prompt": ARTICLE_PROMPT, "max_tokens": 12, "temperature": 1.0, "top_k": 50, "seed": 1234}
    first = post(server, body)[1]["completion"]
    assert post(server, body)[1]["completion"] == first
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda b: post(server, b)[1]["completion"],
                                [body, dict(body, seed=1), dict(body, seed=2), body]))
    assert results[0] == results[3] == first


def test_no_compilation_after_warm_up(server):
    before = server.metric("serve_compilations_total")
    assert before > 0
    post(server, {"prompt": "alone", "max_tokens": 40})  # no request waits: long chunks
    requests = [{"prompt": "a", "max_tokens": 1}, {"prompt": ARTICLE_PROMPT * 3, "max_tokens": 100},
                {"prompt": "b", "max_tokens": 9, "temperature": 0.3, "top_p": 0.5, "seed": 5, "stop": ["x"]},
                {"instruction": "c", "context": "d", "max_tokens": 40, "top_k": 3}]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda b: post(server, b), requests * 3))
    post(server, {"prompt": "s", "max_tokens": 6, "stream": True}, path="/v1/completions")
    assert burst_until_grouped(server, lambda burst, i: f"burst {burst} {i} " * (1 + i % 2 * 8))  # 8 for 4 rows
    # A prompt that only fits the largest bucket is prefilled in a block as long as the bucket.
    per_copy = post(server, {"prompt": ARTICLE_PROMPT, "max_tokens": 1})[1]["prompt_tokens"]
    status, answer, _ = post(server, {"prompt": ARTICLE_PROMPT * (290 // per_copy), "max_tokens": 1})
    assert status == 200 and 256 < answer["prompt_tokens"] < 320
    assert server.metric("serve_compilations_total") == before
    _, metrics, _ = http("GET", server.url + "/metrics")
    assert 'serve_requests_total{path="/",status="200"}' in metrics
    assert "serve_request_latency_seconds_bucket" in metrics and "serve_queue_depth 0" in metrics


def test_health_is_503_until_ready(trained_model, start_server):
    server = start_server(trained_model, "--length-buckets", "64", "--max-batch-size", "1", wait=False)
    statuses = []
    deadline = time.time() + 120
    while time.time() < deadline and 200 not in statuses:
        try:
            statuses.append(http("GET", server.url + "/health", timeout=5)[0])
        except OSError:
            pass
        time.sleep(0.1)
    assert statuses[0] == 503 and statuses[-1] == 200
    assert "warm-up: batch 1: decode over windows 64 and prompt blocks 16,32,64 in" in server.output()


def test_api_key_guards_everything_but_health(trained_model, start_server):
    server = start_server(trained_model, "--length-buckets", "64", "--max-batch-size", "1", "--api-key", "s3cret")
    assert http("GET", server.url + "/health")[0] == 200
    for method, path in [("POST", "/"), ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")]:
        status, body, headers = http(method, server.url + path, {"prompt": "x"} if method == "POST" else None)
        assert status == 401 and body["error"]["type"] == "authentication_error", path
    auth = {"Authorization": "Bearer s3cret"}
    assert post(server, {"prompt": "x", "max_tokens": 2}, headers=auth)[0] == 200
    assert post(server, {"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer wrong"})[0] == 401
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret")
    assert client.completions.create(model="model", prompt="x", max_tokens=2).choices[0].finish_reason


def test_warns_when_public_without_key(server, trained_model):
    assert "without --api-key" not in server.output()  # bound to 127.0.0.1
    port_free = socket.socket()
    port_free.bind(("127.0.0.1", 0))
    port = port_free.getsockname()[1]
    port_free.close()
    process = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--model", str(trained_model), "--host",
                                "0.0.0.0", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=script_env())
    first_line = process.stdout.readline()
    process.terminate()
    process.wait(60)
    assert "warning" in first_line and "without --api-key" in first_line


def test_full_queue_answers_503_with_retry_after(trained_model, start_server):
    server = start_server(trained_model, "--length-buckets", "320", "--max-batch-size", "1", "--max-queue", "1")
    body = {"prompt": "Hello", "max_tokens": 300, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: post(server, body), range(8)))
    statuses = [status for status, _, _ in results]
    assert 200 in statuses and 503 in statuses
    rejected = next(r for r in results if r[0] == 503)
    assert rejected[2]["Retry-After"] and rejected[1]["error"]["type"] == "overloaded_error"
    # A request that could never fit the queue, even on an idle server, is told so once: not a 503 to retry.
    for path, body in (("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2})):
        status, answer, headers = post(server, body, path)
        assert status == 400 and "Retry-After" not in headers, answer
        assert "--max-queue 1" in answer["error"]["message"] and "2 generations" in answer["error"]["message"]
    assert server.metric("serve_queue_depth") == 0
    assert good_request_works(server)


def test_sigusr1_logs_every_threads_stack_and_the_server_goes_on(server):
    server.process.send_signal(signal.SIGUSR1)
    deadline = time.time() + 30

    def dump():  # the threads' stacks as written so far: faulthandler writes them one after another
        return server.output().split("most recent call first", 1)[-1] if "most recent call first" in \
            server.output() else ""
    while not ('serve.py", line' in dump() and "in run" in dump()) and time.time() < deadline:
        time.sleep(0.1)
    assert 'serve.py", line' in dump() and "in run" in dump(), dump()  # the model worker's loop, among them
    assert good_request_works(server)


def test_graceful_shutdown_finishes_in_flight_requests(trained_model, start_server):
    server = start_server(trained_model, "--length-buckets", "320", "--max-batch-size", "1")
    request = urllib.request.Request(
        server.url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": "Hi", "max_tokens": 300, "temperature": 0, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        first = response.readline()
        assert first.startswith(b"data: ")
        server.process.send_signal(signal.SIGTERM)
        rest = response.read().decode()
    assert rest.rstrip().endswith("data: [DONE]")
    assert server.exit_code() == 0
    assert "shutting down" in server.output() and "stopped" in server.output()


def test_help_describes_every_flag():
    out = subprocess.run([sys.executable, str(REPO / "serve.py"), "--help"], capture_output=True, text=True,
                         env=script_env()).stdout
    for flag in ["--model", "--host", "--port", "--max-batch-size", "--max-queue", "--max-tokens-limit",
                 "--max-body-bytes", "--api-key", "--sampler", "--seed", "--compile-cache", "--length-buckets",
                 "--batch-window-ms", "--shutdown-timeout", "--distribution", "--mesh", "--idle-timeout",
                 "--max-connections"]:
        assert flag in out, flag
    assert "gemma-2b-dolly-lora" in out and "0.0.0.0" in out and "8080" in out


@pytest.mark.parametrize("where, downloads", [("local", False), ("gemma_2b_en", True)])
def test_kagglehub_is_imported_only_for_a_model_from_kaggle(trained_model, where, downloads):
    """kagglehub only downloads presets: for a local model keras-hub imports without it (14 MiB of RSS), for a
    preset's name (a Kaggle handle, as kaggle:// is) it is there to download."""
    model = str(trained_model) if where == "local" else where
    check = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from gemma_lora.model import keep_unused_imports_out; "
             f"keep_unused_imports_out({model!r}); import keras_hub; from keras_hub.src.utils import preset_utils; "
             "print('KAGGLEHUB', preset_utils.kagglehub is not None)")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=script_env(), timeout=300)
    assert f"KAGGLEHUB {downloads}" in result.stdout, result.stdout + result.stderr


def test_the_server_runs_without_tensorflow(tiny_server, adapter_server):
    """TensorFlow is installed (train_local.py's keras-hub preprocessors use it) and keras-hub imports it
    whenever it can; serve.py keeps it out of its process (issue #35: hundreds of MiB of RSS). Our own
    output (a Keras preset) and a transformers-layout dir both load and answer without it."""
    import importlib.util
    from pathlib import Path
    assert importlib.util.find_spec("tensorflow") is not None
    for server in (tiny_server, adapter_server):
        assert "tensorflow" not in Path(f"/proc/{server.process.pid}/maps").read_text()
        status, body, _ = http("POST", server.url + "/v1/completions", {"prompt": "The river", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_streamed_chunks_carry_what_the_plain_answer_has(server):
    """The worker sends each row's tokens once per chunk and the handler writes all that has come in one go:
    the openai client must rebuild the same text, token log-probabilities and usage, n > 1 included."""
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = dict(model="model", prompt=[ARTICLE_PROMPT, "Hello there"], max_tokens=12, temperature=0, n=2, logprobs=2,
               extra_body={"ignore_eos": True})
    plain = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    for choice in plain.choices:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        streamed = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        assert streamed == choice.logprobs.tokens
        np.testing.assert_allclose([lp for p in parts if p.logprobs for lp in p.logprobs.token_logprobs],
                                   choice.logprobs.token_logprobs, atol=1e-5)
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 4 * 12
    messages = [{"role": "user", "content": "Name a colour."}]
    ask = dict(model="model", messages=messages, max_tokens=10, temperature=0, n=2, logprobs=True, top_logprobs=2,
               extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    for choice in plain.choices:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.delta.content or "" for p in parts) == choice.message.content
        streamed = [t for p in parts if p.logprobs and p.logprobs.content for t in p.logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in choice.logprobs.content]
        np.testing.assert_allclose([t.logprob for t in streamed], [t.logprob for t in choice.logprobs.content],
                                   atol=1e-5)
        assert [[a.token for a in t.top_logprobs] for t in streamed] == \
            [[a.token for a in t.top_logprobs] for t in choice.logprobs.content]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)  # the second may find the prompt cached
    # A chunk's tokens travel together: far fewer events than tokens.
    request = urllib.request.Request(server.url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"prompt": "Hi", "max_tokens": 24, "temperature": 0,
                                                               "ignore_eos": True, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [e for e in response.read().decode().split("\n\n") if e.startswith("data: {")]
    assert len(events) <= 24 // 2, len(events)


def test_the_worker_s_time_adds_up_and_each_dispatch_is_counted_and_timed(server):
    def scrape():
        _, text, _ = http("GET", server.url + "/metrics")
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def parts(values, name):
        return {k[len(name) + 1:-1]: v for k, v in values.items() if k.startswith(name + "{")}
    before, started = scrape(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: post(server, {"prompt": f"Timed {i} " * (1 + 5 * i), "max_tokens": 20}), range(6)))
    time.sleep(0.2)  # some idle time too
    after, wall = scrape(), time.perf_counter() - started
    worker = {k: v - parts(before, "serve_worker_seconds_total").get(k, 0)
              for k, v in parts(after, "serve_worker_seconds_total").items()}
    assert set(worker) == {f'part="{p}"' for p in WORKER_PARTS}
    # Every moment of the worker's counts once: the parts add up to the wall time between the two scrapes.
    assert abs(sum(worker.values()) - wall) < 0.05 * wall + 0.05, (sum(worker.values()), wall, worker)
    assert worker['part="idle"'] > 0.1 and worker['part="read"'] > 0 and worker['part="admit"'] > 0
    # Its thread's CPU time, part by part: never more than the part's wall time (the rest it waited), and some.
    cpu = {k: v - parts(before, "serve_worker_cpu_seconds_total").get(k, 0)
           for k, v in parts(after, "serve_worker_cpu_seconds_total").items()}
    assert set(cpu) == set(worker)
    assert all(0 <= cpu[k] <= worker[k] + 0.01 for k in cpu), (cpu, worker)
    assert cpu['part="admit"'] > 0 and cpu['part="idle"'] < 0.5 * worker['part="idle"']  # idle: blocked on the queue
    dispatched = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("serve_dispatches_total")}
    assert dispatched['serve_dispatches_total{program="insert"}'] >= 6
    assert dispatched['serve_dispatches_total{program="prefill"}'] + \
        dispatched['serve_dispatches_total{program="prefill_group"}'] >= 1
    busy = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("serve_device_busy_seconds_total")}
    assert busy['serve_device_busy_seconds_total{program="decode"}'] + \
        busy['serve_device_busy_seconds_total{program="decode_long"}'] > 0
    idle = after["serve_device_idle_seconds_total"] - before["serve_device_idle_seconds_total"]
    assert 0 <= sum(busy.values()) + idle <= wall * 1.05 + 0.05


def test_the_process_s_cpu_time_is_told_by_thread_so_the_gil_s_load_shows(server):
    # Issue #48: whether the HTTP front end would pay in a process of its own depends on how much of one GIL
    # the model worker and the HTTP threads use together; /metrics says it by kind of thread.
    threads = ThreadCPU()
    if threads.totals() is None:
        pytest.skip("no /proc: thread CPU times are Linux-only")

    def burn(seconds, burnt, done):  # `seconds` of this thread's own CPU, however busy the machine
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        burnt.set()
        done.wait()

    def http_thread(*args):
        with threads.http_thread():
            burn(*args)
    before, burnt, done = threads.totals(), threading.Event(), threading.Event()
    live = threading.Thread(target=http_thread, args=(0.3, burnt, done))
    live.start()
    burnt.wait()
    time.sleep(0.05)  # a clock tick: /proc counts in ticks
    running = threads.totals()  # the live one's time comes from /proc
    assert 0.25 <= running["http"] - before["http"] <= 0.45, (before, running)
    done.set()
    live.join()
    ended = threads.totals()  # its whole time kept as it ended, never less than /proc said
    assert running["http"] <= ended["http"] + 1e-9 and ended["http"] - before["http"] < 0.45
    burnt, done = threading.Event(), threading.Event()
    other = threading.Thread(target=burn, args=(0.3, burnt, done), name="another")
    other.start()
    burnt.wait()
    time.sleep(0.05)
    burning = threads.totals()
    assert burning["python_other"] - ended["python_other"] >= 0.25
    done.set()
    other.join()
    after = threads.totals()
    assert after["http"] - ended["http"] < 0.05  # an ordinary thread that ended is not an HTTP thread
    assert after["python_other"] >= burning["python_other"]  # and keeps its time once it has ended
    assert abs(sum(after.values()) - time.process_time()) < 0.1  # the roles share out the process's time

    def scrape():
        _, text, _ = http("GET", server.url + "/metrics")
        return {line[len("serve_thread_cpu_seconds_total{role=\""):].partition("\"")[0]: float(line.rpartition(" ")[2])
                for line in text.splitlines() if line.startswith("serve_thread_cpu_seconds_total{")}
    first = scrape()
    assert set(first) == set(ThreadCPU.ROLES)
    # A live thread's time moves in clock ticks (10 ms): streamed requests until the worker's has moved a tick.
    for i in range(40):
        status, _, _ = post(server, {"prompt": f"Threads {i} " * 20, "max_tokens": 16, "stream": True},
                            "/v1/completions")
        assert status == 200
        second = scrape()
        assert all(second[r] >= first[r] - 0.02 for r in ("worker", "http", "native")), (first, second)
        if second["worker"] > first["worker"]:
            break
    assert second["http"] > first["http"] and second["worker"] > first["worker"], (first, second)


def test_an_http_thread_that_outlives_its_connection_is_counted_once_and_no_role_goes_back(monkeypatch):
    """A handler thread keeps running a moment after its connection's time was kept as http's: it is not counted
    again as another thread, live or once gone; and a reading whose native rest comes out lower (the threads
    are read in whole clock ticks) reports what the last one did (issue #63: Prometheus takes a fall as a reset)."""
    threads = ThreadCPU()
    if threads.totals() is None:
        pytest.skip("no /proc: thread CPU times are Linux-only")
    burnt, done = threading.Event(), threading.Event()

    def handler():
        with threads.http_thread():
            end = time.thread_time() + 0.3
            while time.thread_time() < end:
                pass
        burnt.set()
        done.wait()  # still alive, its connection over
    before = threads.totals()
    thread = threading.Thread(target=handler)
    thread.start()
    burnt.wait()
    time.sleep(0.05)
    alive = threads.totals()
    done.set()
    thread.join()
    gone = threads.totals()
    for reading in (alive, gone):
        assert 0.25 <= reading["http"] - before["http"] < 0.45, (before, reading)
        assert reading["python_other"] - before["python_other"] < 0.1, (before, reading)
    process = time.process_time()
    monkeypatch.setattr(time, "process_time", lambda: process - 1.0)  # a reading a second short
    assert threads.totals()["native"] >= gone["native"]


def test_the_worker_clock_read_while_it_switches_parts_never_goes_back():
    """A scrape reads the worker's parts while the worker switches between them: each part's seconds never come
    out lower than the scrape before (issue #63: read unlocked, the part being left could)."""
    from gemma_lora.metrics import PartClock
    clock, stop = PartClock(), threading.Event()

    def worker():
        clock.start()
        while not stop.is_set():
            for part in ("admit", "dispatch", "read", "settle"):
                clock.switch(part)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: the race, if any, shows
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        last, fell = clock.totals(), []
        for _ in range(20000):
            now = clock.totals()
            fell += [(part, last[part], now[part]) for part in now if now[part] < last[part]]
            last = now
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert not fell, fell[:5]


def test_every_counter_the_server_exports_never_decreases_under_load(server):
    """Streamed and plain requests run while /metrics is read again and again: every counter (and each
    histogram's buckets, count and sum) is never lower than the reading before (issue #63)."""
    def scrape():
        _, text, _ = http("GET", server.url + "/metrics")
        kinds = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                name = series.partition("{")[0]
                base = next((b for b in (name, name.rpartition("_")[0]) if b in kinds), None)
                if base is not None and kinds[base] in ("counter", "histogram"):
                    values[series] = float(value)
        return values
    stop = threading.Event()

    def load(i):
        while not stop.is_set():
            post(server, {"prompt": f"Load {i} " * 10, "max_tokens": 12, "stream": i % 2 == 0}, "/v1/completions")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i in range(4):
            pool.submit(load, i)
        try:
            last, fell = scrape(), []
            assert any(k.startswith("serve_thread_cpu_seconds_total") for k in last) and len(last) > 50
            for _ in range(150):
                now = scrape()
                fell += [(k, last[k], now[k]) for k in last if k in now and now[k] < last[k]]
                last = now
        finally:
            stop.set()
    assert not fell, fell[:5]


def test_each_generation_s_queue_wait_first_token_and_time_per_token_are_histograms(server):
    # What a vLLM dashboard reads (its time_to_first_token_seconds, time_per_output_token_seconds,
    # num_requests_running), in its buckets: the server's own view of issue #48's time to first token.
    names = ("serve_request_queue_seconds", "serve_time_to_first_token_seconds", "serve_time_per_output_token_seconds")

    def scrape():
        _, text, _ = http("GET", server.url + "/metrics")
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line and not line.startswith("#")}
    before = scrape()
    for name in names:
        buckets = [v for k, v in before.items() if k.startswith(name + "_bucket")]
        assert len(buckets) == 20 and buckets == sorted(buckets) and buckets[-1] == before[name + "_count"]
    started = time.perf_counter()
    status, body, _ = post(server, {"prompt": ["One", "Two"], "max_tokens": 8, "temperature": 0, "n": 2,
                                    "ignore_eos": True}, "/v1/completions")
    assert status == 200 and len(body["choices"]) == 4
    status, body, _ = post(server, {"prompt": "Three", "max_tokens": 1, "ignore_eos": True}, "/v1/completions")
    assert status == 200
    wall = time.perf_counter() - started
    after = scrape()
    counts = [after[n + "_count"] - before[n + "_count"] for n in names]
    sums = [after[n + "_sum"] - before[n + "_sum"] for n in names]
    assert counts == [5, 5, 4], counts  # every generation waited and had a first token; one had no second
    assert 0 <= sums[0] <= sums[1] <= wall * 4  # a first token comes after the row is taken, inside the requests
    assert 0 < sums[2] / 4 < wall
    assert after["serve_requests_running"] == 0
    # While one streams, it holds a row.
    request = urllib.request.Request(server.url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"prompt": "Hi", "max_tokens": 300, "temperature": 0,
                                                               "ignore_eos": True, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.readline().startswith(b"data: ")
        assert scrape()["serve_requests_running"] >= 1
        response.read()
    assert scrape()["serve_requests_running"] == 0


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_text_made_a_chunk_at_a_time_is_the_whole_answer_s_decoding(tiny_model, chunk):
    # Generation.detokenize decodes only the new tokens and the few before them (issue #48): every streamed
    # piece, the text at each step and the final text must be what decoding all the ids gives, across words'
    # leading spaces, multi-byte characters split over byte-fallback pieces, and stop strings.
    import queue
    import random
    import types

    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny_model / "tokenizer.model"))
    engine = types.SimpleNamespace(decode=sp.decode, stop_ids=set())
    rng = random.Random(chunk)
    ids = sp.encode("The river Thames — naïve café, 日本語 😀 and  two  spaces\nthen a new line")
    ids += [rng.randrange(3, sp.get_piece_size()) for _ in range(60)]
    full = sp.decode(ids)
    assert any(sp.id_to_piece(i).startswith("<0x") for i in ids)  # byte-fallback pieces are in it
    events = queue.Queue()
    g = Generation([2], len(ids), dict(SAMPLER_DEFAULTS["greedy"], ignore_eos=True), 0, [], events)
    for start in range(0, len(ids), chunk):
        for token in ids[start:start + chunk]:
            g.accept(token, engine, emit=False)
        if g.finish_reason is None:
            g.emit(final=False, engine=engine)
            assert g.text == sp.decode(g.ids)
    assert g.finish_reason == "length" and g.text == full
    pieces = []
    while not events.empty():
        pieces.append(events.get()[1])
    assert "".join(pieces) == full
    # Stop strings are looked for in the same text, token by token: cut where decoding it all would be.
    stop = full[len(full) // 2:len(full) // 2 + 3]
    g = Generation([2], len(ids), dict(SAMPLER_DEFAULTS["greedy"], ignore_eos=True), 0, [stop], None)
    for token in ids:
        if g.accept(token, engine, emit=False):
            break
    assert g.finish_reason == "stop" and g.text == full[:full.find(stop)]
