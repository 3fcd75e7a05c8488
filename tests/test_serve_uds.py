"""serve.py --uds: the same HTTP API on a unix domain socket (TPU sandboxes allow no TCP), and every
way of failing to listen answered in one line with exit code 2."""
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, SERVE_FLAGS, UnixHTTPConnection, http, script_env

ARTICLE_PROMPT = "Instruction:\nName a colour.\n\nResponse:\n"


@pytest.fixture(scope="module")
def socket_dir():
    # Short on purpose: a unix socket's path may have at most 107 bytes, and pytest's tmp paths are long.
    with tempfile.TemporaryDirectory(prefix="uds-") as path:
        yield Path(path)


@pytest.fixture(scope="module")
def server(trained_model, start_server, socket_dir):
    """Started over a stale socket file, as a crashed run leaves one: it must be replaced."""
    path = socket_dir / "serve.sock"
    crashed = socket.socket(socket.AF_UNIX)
    crashed.bind(str(path))
    crashed.close()  # the file stays, with nobody listening
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    return start_server(trained_model, *SERVE_FLAGS, "--idle-timeout", "2", uds=path)


def unix_connection(server, timeout=30):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(server.uds)
    return s


def exchange(server, data):
    """Raw bytes in, (status, body bytes) out, over the socket."""
    with unix_connection(server) as s:
        s.sendall(data)  # no half-close: the hang-up watcher takes it for a client that left
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def post_bytes(path, body):
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))


def test_a_stale_socket_file_is_replaced_and_the_new_one_is_owner_only(server):
    assert stat.S_IMODE(os.stat(server.uds).st_mode) == 0o600
    assert f"listening on unix:{server.uds}" in server.output()
    assert "without --api-key" not in server.output()  # the file's mode guards it, not a key


def test_every_endpoint_answers_over_the_socket(server):
    assert http("GET", server.url + "/health")[0] == 200
    status, answer, _ = http("POST", server.url + "/", {"prompt": ARTICLE_PROMPT, "max_tokens": 6, "temperature": 0})
    assert status == 200 and answer["completion_tokens"] <= 6 and isinstance(answer["generated_text"], str)
    status, completion, _ = http("POST", server.url + "/v1/completions",
                                 {"prompt": ARTICLE_PROMPT, "max_tokens": 6, "temperature": 0})
    # The article's route answers with the prompt in front, as keras-hub's generate() does.
    assert status == 200 and answer["generated_text"] == ARTICLE_PROMPT + completion["choices"][0]["text"]
    status, chat, _ = http("POST", server.url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6})
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    assert http("GET", server.url + "/v1/models")[1]["data"][0]["id"] == "model"
    assert "serve_requests_total" in http("GET", server.url + "/metrics")[1]
    assert http("GET", server.url + "/openapi.json")[1]["openapi"].startswith("3.")


def test_streaming_over_the_socket_matches_the_plain_answer(server):
    body = {"prompt": ARTICLE_PROMPT, "max_tokens": 6, "temperature": 0}
    plain = http("POST", server.url + "/v1/completions", body)[1]["choices"][0]["text"]
    connection = UnixHTTPConnection(server.uds, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(body | {"stream": True}),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
    events = [e for e in response.read().decode().split("\n\n") if e]
    connection.close()
    assert events[-1] == "data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == plain


def test_the_openai_client_works_over_httpx_uds_transport(server):
    import openai
    try:  # openai 3 is built on httpx2, earlier releases on httpx: the same HTTPTransport(uds=...)
        import httpx2 as httpx
    except ImportError:
        import httpx
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused",
                           http_client=httpx.Client(transport=httpx.HTTPTransport(uds=server.uds)))
    answer = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0)
    streamed = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content


def test_an_abandoned_stream_is_cancelled(server):
    cancelled = server.metric("serve_cancelled_total")
    body = json.dumps({"prompt": "Hi", "max_tokens": 300, "temperature": 0, "stream": True,
                       "stop": ["never appears"]}).encode()
    s = unix_connection(server)
    s.sendall(post_bytes("/v1/completions", body))
    assert b"200" in s.recv(100)
    s.close()
    deadline = time.time() + 30
    while server.metric("serve_cancelled_total") < cancelled + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("serve_cancelled_total") == cancelled + 1


def test_an_oversized_body_gets_a_413(server):
    status, body = exchange(server, post_bytes("/", b"x" * 10000))
    assert status == 413 and b"over the 4096-byte limit" in body


def test_an_idle_connection_is_closed(server):
    with unix_connection(server, timeout=10) as s:
        started = time.time()
        assert s.recv(1) == b""  # closed by the server, after --idle-timeout 2
        assert 1.5 < time.time() - started < 8


def serve_fails(*args, inject=None, before=""):
    """Runs serve.py expecting it not to listen: (exit code, stderr). `inject`, an errno name, makes the
    socket's bind raise it, for the failures this machine cannot produce (it runs tests as root); `before`:
    more Python to run first (another injection)."""
    code = (f"import errno, runpy, socket, sys\n"
            f"def bind(self, address): raise OSError(errno.{inject}, 'injected')\n"
            f"socket.socket.bind = bind\n" if inject else "import runpy, sys\n") + before
    code += f"sys.argv = ['serve.py'] + {list(map(str, args))!r}\nrunpy.run_path({str(REPO / 'serve.py')!r}, " \
            "run_name='__main__')\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=script_env(),
                            timeout=120)
    return result.returncode, result.stderr


def assert_one_line(code, stderr, *words):
    assert code == 2, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith("error: cannot listen on") or stderr.startswith("error: --uds"), stderr
    for word in words:
        assert word in stderr, (word, stderr)


def test_a_live_socket_is_refused_and_left_alone(server, trained_model):
    code, stderr = serve_fails("--model", trained_model, "--uds", server.uds)
    assert_one_line(code, stderr, "another server is listening")
    assert http("GET", server.url + "/health")[0] == 200


def test_a_file_that_is_not_a_socket_is_refused(trained_model, socket_dir):
    path = socket_dir / "notes.txt"
    path.write_text("keep me")
    assert_one_line(*serve_fails("--model", trained_model, "--uds", path), "not a socket")
    assert path.read_text() == "keep me"


def test_a_path_too_long_for_a_unix_socket_is_one_line(trained_model, socket_dir):
    path = socket_dir / ("x" * 120)
    assert_one_line(*serve_fails("--model", trained_model, "--uds", path), "at most 107")


def test_a_port_in_use_is_one_line(trained_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line(*serve_fails("--model", trained_model, "--host", "127.0.0.1", "--port", port),
                        f"127.0.0.1:{port}", "in use")


@pytest.mark.parametrize("errno_name, words", [
    ("EAFNOSUPPORT", ["does not allow TCP sockets", "--uds PATH"]),  # what a TPU sandbox answers
    ("EACCES", ["permission denied", "below 1024"]),
])
def test_refused_binds_are_one_line(trained_model, errno_name, words):
    assert_one_line(*serve_fails("--model", trained_model, "--port", "80", inject=errno_name), *words)


def test_shutdown_removes_the_socket_file(server):
    server.process.send_signal(signal.SIGTERM)
    assert server.exit_code() == 0
    assert not os.path.exists(server.uds)


def test_a_socket_taken_between_the_check_and_the_bind_is_one_line(trained_model, socket_dir):
    """Another process binds the path after claim_socket_path found it free: the bind's error, in one line
    (socketserver's clean-up once read an inode never set, and its AttributeError replaced it)."""
    path = socket_dir / "raced.sock"
    race = ("import errno, socket\nreal_bind = socket.socket.bind\n"
            "def bind(self, address):\n"
            "    if isinstance(address, str):  # the other process wins the path first\n"
            "        other = socket.socket(socket.AF_UNIX)\n"
            "        real_bind(other, address)\n"
            "        other.listen()\n"
            "        raise OSError(errno.EADDRINUSE, 'Address already in use')\n"
            "    return real_bind(self, address)\n"
            "socket.socket.bind = bind\n")
    assert_one_line(*serve_fails("--model", trained_model, "--uds", path, before=race), "in use")
    assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the other's socket is left alone


def test_a_stale_socket_that_cannot_be_removed_is_one_line(trained_model, socket_dir):
    """Someone else's leftover socket in a sticky folder: unlinking it is refused, and the user is told."""
    path = socket_dir / "theirs.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    refuse = "import os\ndef unlink(path, *a, **k): raise PermissionError(1, 'Operation not permitted')\n" \
             "os.unlink = unlink\n"
    code, stderr = serve_fails("--model", trained_model, "--uds", path, before=refuse)
    assert_one_line(code, stderr, "cannot be removed", "not permitted")
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_the_real_model_check_tells_rounding_from_a_different_answer():
    # scripts/real_check.py (issue #49 item 4): answers that part where the CPU's token is this side's close
    # runner-up are rounding (bfloat16 on another chip or XLA); a token far behind, or log-probabilities that
    # moved, fail.
    import real_check
    top = [{t: -0.5, "z": -3.0} for t in "abcdefghijkl"]
    want = [{"prompt": "p", "text": "a b c", "tokens": list("abcdefghijkl"), "logprobs": [-0.5] * 12, "top": top}]
    same = [dict(want[0], logprobs=[-0.5] * 11 + [-0.6])]
    near_tie = [dict(want[0], text="a b x", tokens=list("abcXefghijkl"),
                     top=top[:3] + [{"X": -0.5, "d": -0.7}] + top[4:])]
    gap = [dict(near_tie[0], top=top[:3] + [{"X": -0.5, "d": -1.5}] + top[4:])]
    moved = [dict(want[0], logprobs=[-0.5] * 5 + [-1.0] + [-0.5] * 6)]
    lines, good = real_check.compare(same, want)
    assert good and lines[0].startswith("ok 'p': 12 of 12 tokens the same") and "within 0.100" in lines[0]
    lines, good = real_check.compare(near_tie, want)
    assert good and "3 of 12 tokens" in lines[0] and "near-tie ('d' 0.200 behind 'X')" in lines[0]
    assert "the CPU's 'a b c'" in lines[0]
    lines, good = real_check.compare(same + gap, want + want)
    assert not good and lines[0].startswith("ok") and lines[1].startswith("FAILED") and "a gap ('d' 1.000" in lines[1]
    lines, good = real_check.compare(moved, want)
    assert not good and "within 0.500" in lines[0]
