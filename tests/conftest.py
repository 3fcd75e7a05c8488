import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "tests" / "data" / "dolly_sample.jsonl"
CHAT_DATA = REPO / "tests" / "data" / "chat_sample.jsonl"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from uds_check import UnixConnection as UnixHTTPConnection  # noqa: E402  serve.py --uds, as the TPU check drives it
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def on_accelerator():
    """True when this process's JAX has a GPU or TPU (scripts/tpu_check.sh runs `pytest -m device` there)."""
    import jax
    return jax.default_backend() != "cpu"


ACCELERATOR = on_accelerator()
NO_SUBPROCESS_SERVER = ("serve.py in a subprocess: on an accelerator this process holds the chip (one process at a "
                        "time may), and a TPU sandbox allows no TCP")
if ACCELERATOR:
    # Comparisons with numpy or keras-hub's own call: a TPU multiplies float32 in bfloat16 passes by default,
    # good to three digits; the engine's math is what the device tests check, so give it full precision.
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")


# A TPU's exp and log agree with float64 to four or five digits whatever the matmul precision (seen on a
# v5e: log-probabilities 3e-5 off log(0.6)); on the CPU they agree to six.
TRANSCENDENTAL_RTOL = 1e-4 if ACCELERATOR else 1e-5


def pytest_configure(config):
    config.addinivalue_line("markers", "device: in-process engine and training tests, run on a GPU/TPU by "
                                       "`pytest -m device` (scripts/tpu_check.sh); on the CPU they run as any test")


def script_env(**extra):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    if ACCELERATOR:  # helpers (making and training the fixtures' models) keep off the chip this process holds
        env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-gemma")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_gemma.py"), str(out)], check=True,
                   capture_output=True, env=script_env())
    return out


@pytest.fixture(scope="session")
def run_train(compile_cache):
    def run(*args, cwd=None, env=None, check=False, timeout=600):
        cmd = [sys.executable, str(REPO / "train_local.py"), "--compile-cache", compile_cache, *map(str, args)]
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env or script_env(),
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"train_local.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result
    return run


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory, tiny_model, run_train):
    out = tmp_path_factory.mktemp("trained") / "model"
    run_train("--model", tiny_model, "--data", SAMPLE_DATA, "--limit", 40, "--eval-examples", 12,
              "--max-steps", 6, "--output", out, check=True)
    return out


# One server on the tiny trained model, shared by the serving, network and chat tests (a start costs ~20 s).
SERVE_FLAGS = ["--length-buckets", "64,320", "--max-batch-size", "4", "--max-body-bytes", "4096", "--seed", "0"]


@pytest.fixture(scope="session")
def tiny_server(trained_model, start_server):
    return start_server(trained_model, *SERVE_FLAGS)


@pytest.fixture(scope="session")
def bf16_model(tmp_path_factory, tiny_model, run_train):
    out = tmp_path_factory.mktemp("bf16") / "model"
    run_train("--model", tiny_model, "--data", SAMPLE_DATA, "--limit", 24, "--eval-examples", 0, "--learning-rate",
              1e-3, "--seed", 1, "--dtype", "bfloat16", "--output", out, check=True)
    return out


YES_QUESTIONS = [f"Question {i}: is the sky {colour}?" for i, colour in enumerate(["blue", "green", "red", "grey"] * 4)]


@pytest.fixture(scope="session")
def yes_model(tmp_path_factory, tiny_model, run_train):
    """QLoRA on an int8 base, in Gemma's turn format: a tiny Gemma taught to answer every question 'Yes.'."""
    work = tmp_path_factory.mktemp("yes")
    data = work / "yes.jsonl"
    data.write_text("".join(json.dumps({"instruction": q, "response": "Yes."}) + "\n" for q in YES_QUESTIONS))
    run_train("--model", tiny_model, "--data", data, "--limit", 16, "--eval-examples", 0, "--epochs", 15,
              "--learning-rate", 1e-2, "--loss-on", "response", "--template", "gemma-chat", "--quantize", "int8",
              "--output", work / "model", check=True)
    return work / "model"


@pytest.fixture(scope="session")
def yes_server(yes_model, start_server):
    return start_server(yes_model, "--length-buckets", "64", "--max-batch-size", "1")


@pytest.fixture(scope="session")
def no_model(tmp_path_factory, tiny_model, run_train):
    """A second adapter on the same base, other data, the article's template, float32 base; also exported
    (--export peft,transformers) as part of its training run."""
    work = tmp_path_factory.mktemp("no")
    data = work / "no.jsonl"
    data.write_text("".join(json.dumps({"instruction": q, "response": "No."}) + "\n" for q in YES_QUESTIONS))
    run_train("--model", tiny_model, "--data", data, "--limit", 16, "--eval-examples", 0, "--epochs", 15,
              "--learning-rate", 1e-2, "--loss-on", "response", "--lora-rank", 4, "--export", "peft,transformers",
              "--output", work / "model", check=True)
    return work / "model"


# The recipe the README recommends for chat logs, on an int8 base (QLoRA), with every schedule option.
CHAT_TRAIN_FLAGS = ["--data", CHAT_DATA, "--limit", 48, "--eval-examples", 16, "--epochs", 8, "--template", "gemma-chat",
                    "--lora-modules", "all-linear", "--lora-rank", 4, "--lora-alpha", 8, "--lr-schedule", "cosine",
                    "--warmup-steps", 5, "--eval-every", 24, "--learning-rate", 1e-2, "--quantize", "int8"]


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory, tiny_model, run_train):
    """Multi-turn conversations (messages format, auto-detected), LoRA on all seven projections with
    alpha = 2 x rank, cosine schedule with warm-up; exported to PEFT and transformers."""
    out = tmp_path_factory.mktemp("chat") / "model"
    run_train("--model", tiny_model, *CHAT_TRAIN_FLAGS, "--export", "peft,transformers", "--output", out, check=True)
    return out


ADAPTER_SERVE_FLAGS = ["--length-buckets", "64", "--max-batch-size", "4", "--max-adapters", "4"]


@pytest.fixture(scope="session")
def adapter_server(tiny_model, yes_model, no_model, chat_model, start_server):
    """The bare base with three adapters over it (two on query/value, one on every projection), one slot
    to spare."""
    return start_server(tiny_model, "--adapter", f"yes={yes_model}", "--adapter", f"no={no_model}",
                        "--adapter", f"chat={chat_model}", *ADAPTER_SERVE_FLAGS)


PLAIN_PREFILLS = {}


def plain_prefill(engine, prompt, block, slot=0):
    """keras-hub's own prefill of one prompt in a row of its block's positions (programs.prefill, jitted once
    per engine): what the engine's rows, made in a window's row or after a cached prefix, must hold."""
    import functools
    import jax
    import numpy as np
    from gemma_lora.engine.programs import prefill
    if id(engine) not in PLAIN_PREFILLS:
        PLAIN_PREFILLS[id(engine)] = jax.jit(functools.partial(prefill, engine.model, engine.variables,
                                                               engine.adapters))
    return PLAIN_PREFILLS[id(engine)](engine.values, engine.tokens([prompt], block), engine.lora_tables,
                                      np.int32(slot))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


UNIX_URL = "http+unix://"  # then the socket's path, percent-encoded, then the request's path


def unix_url(socket_path):
    return UNIX_URL + urllib.parse.quote(str(socket_path), safe="")


def burst_until_grouped(server, prompt, bursts=4, count=8, max_tokens=12):
    """Sends `count` requests at once, more than the server's rows: those that wait for a row are admitted
    together, whenever each arrived, and prefilled as a group. On a loaded machine each may arrive after the
    one before has finished (CI once saw no group): then another burst, up to `bursts`. `prompt(burst, i)`:
    a new prompt each time (a cached prefix is not grouped). Returns whether a group was prefilled."""
    import concurrent.futures
    groups = server.metric("serve_prefill_groups_total")
    for burst in range(bursts):
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda i: http("POST", server.url + "/", {"prompt": prompt(burst, i),
                                                                    "max_tokens": max_tokens}), range(count)))
        if server.metric("serve_prefill_groups_total") > groups:
            return True
    return False


def http(method, url, body=None, headers=None, timeout=120):
    """(status, parsed JSON or text, headers) for a request over TCP or, for an http+unix:// URL, a unix
    socket; never raises on HTTP errors."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})} if data is not None else (headers or {})
    if url.startswith(UNIX_URL):
        socket_path, _, path = url[len(UNIX_URL):].partition("/")
        connection = UnixHTTPConnection(urllib.parse.unquote(socket_path), timeout)
        try:
            connection.request(method, "/" + path, body=data, headers=headers)
            response = connection.getresponse()
            status, raw, hdrs = response.status, response.read(), response.headers
        finally:
            connection.close()
    else:
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw, hdrs = response.status, response.read(), response.headers
        except urllib.error.HTTPError as e:
            status, raw, hdrs = e.code, e.read(), e.headers
    text = raw.decode()
    try:
        return status, json.loads(text), hdrs
    except json.JSONDecodeError:
        return status, text, hdrs


class ServerProcess:
    def __init__(self, model_dir, compile_cache, *extra, env=None, uds=None):
        """serve.py on a free loopback port, or with uds (a path) on that unix socket."""
        if uds:
            self.port, self.uds, self.url = None, str(uds), unix_url(uds)
            where = ["--uds", self.uds]
        else:
            self.port, self.uds = free_port(), None
            self.url = f"http://127.0.0.1:{self.port}"
            where = ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = Path(model_dir).parent / f"serve-{self.port or Path(uds).name}.log"
        cmd = [sys.executable, str(REPO / "serve.py"), "--model", str(model_dir), *where,
               "--compile-cache", compile_cache, *map(str, extra)]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or script_env())

    def wait_ready(self, timeout=300, complete=True):
        """Until /health is 200 and, if `complete`, nothing is left compiling in the background."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve.py exited {self.process.returncode}:\n{self.output()}")
            try:
                status, body, _ = http("GET", self.url + "/health", timeout=5)
                if status == 200 and not (complete and body.get("compiling")):
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"serve.py not ready after {timeout}s:\n{self.output()}")

    def output(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def metric(self, name, headers=None, labels=None):
        """A metric's value; with labels ('size="4"'), that series' (0 while it does not exist yet)."""
        _, text, _ = http("GET", self.url + "/metrics", headers=headers)
        prefix = name + (f"{{{labels}}} " if labels else " ")
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]
        return values[0] if values or not labels else 0.0

    def exit_code(self, timeout=60):
        """The status it exits with; if it has not exited after `timeout` s, fails with its output and
        the stack of each of its threads (serve.py prints them on SIGUSR1)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(f"serve.py did not exit within {timeout}s:\n{self.output()}") from None

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


@pytest.fixture(scope="session")
def start_server(compile_cache):
    servers = []

    def start(model_dir, *extra, wait=True, env=None, uds=None, cache=None):
        if ACCELERATOR:
            pytest.skip(NO_SUBPROCESS_SERVER)
        server = ServerProcess(model_dir, cache or compile_cache, *extra, env=env, uds=uds)
        servers.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in servers:
        server.stop()


@contextlib.contextmanager
def raw_connection(port):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        yield s


def raw_request(port, data):
    """Sends raw bytes, returns (status, body text)."""
    with raw_connection(port) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")
