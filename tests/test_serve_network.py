"""serve.py under real network conditions: bursts, idle and slow clients, clients that leave, big bodies."""
import concurrent.futures
import http.client as httpclient
import json
import re
import socket
import sys
import threading
import time

import pytest

from conftest import http
from gemma_lora.frontend.http import Hangups
from gemma_lora.frontend.server import ClientGone
from gemma_lora.frontend.streams import StreamWriter, stream_events
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.log import log

@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def post_raw(port, body, headers=None, timeout=120):
    """(status, parsed JSON, headers) over http.client, which writes its whole body before reading."""
    connection = httpclient.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/", body=body if isinstance(body, bytes) else json.dumps(body).encode(),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), response.headers
    finally:
        connection.close()


def wait_for_metric(server, name, at_least, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = server.metric(name)
        if value >= at_least:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{name} stayed at {server.metric(name)} (wanted >= {at_least})")


def wait_for_log(server, pattern, timeout=10):
    deadline = time.time() + timeout
    while not re.search(pattern, server.output()):
        assert time.time() < deadline, f"no log line matching {pattern!r}:\n{server.output()[-2000:]}"
        time.sleep(0.05)


def closed_by_server(s, within):
    """True if the server closes `s` within `within` seconds (EOF or reset), draining any answer first."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_burst_of_200_clients_gets_only_200_and_503(server):
    start = threading.Barrier(200)

    def client(i):
        start.wait()
        try:
            return post_raw(server.port, {"prompt": f"Burst {i}", "max_tokens": 4})[0]
        except OSError as e:
            return type(e).__name__

    with concurrent.futures.ThreadPoolExecutor(200) as pool:
        outcomes = list(pool.map(client, range(200)))
    assert set(outcomes) <= {200, 503}, {o for o in outcomes if o not in (200, 503)}
    assert 200 in outcomes


def test_a_client_that_leaves_has_its_generation_cancelled(server):
    cancelled, generated = server.metric("serve_cancelled_total"), server.metric("serve_generated_tokens_total")
    body = json.dumps({"prompt": "Hello", "max_tokens": 300, "temperature": 0}).encode()
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        s.close()
    wait_for_metric(server, "serve_cancelled_total", cancelled + 4)
    # Without cancellation the four would have generated up to 1,200 tokens before the next request ran.
    assert server.metric("serve_generated_tokens_total") - generated < 4 * 300 / 2
    status, answer, _ = post_raw(server.port, {"prompt": "After", "max_tokens": 5, "temperature": 0})
    assert status == 200 and answer["completion_tokens"] <= 5
    wait_for_log(server, r"POST / 499 .* finish=cancelled")


def test_a_streaming_client_that_leaves_is_cancelled(server):
    cancelled = server.metric("serve_cancelled_total")
    body = json.dumps({"prompt": "Hi", "max_tokens": 300, "temperature": 0, "stream": True,
                       "stop": ["never appears"]}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert b"200" in s.recv(100)
    s.close()
    wait_for_metric(server, "serve_cancelled_total", cancelled + 1)


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_the_hangup_watch_outlasts_pipelined_bytes_and_sees_the_client_leave(family):
    """Bytes after a request (a pipelined request, a stray CRLF) must not end the watch: a disconnect
    after them still cancels the generations."""
    if family == "unix":
        ours, theirs = socket.socketpair()
    else:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            theirs = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
    hangups = Hangups()
    g = Generation([2, 3], 5, SAMPLER_DEFAULTS["greedy"], 0, [], None)
    hangups.watch(ours, [g])
    theirs.sendall(b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    assert not g.cancelled
    theirs.close()
    deadline = time.time() + 10
    while not g.cancelled and time.time() < deadline:
        time.sleep(0.01)
    assert g.cancelled
    ours.close()


def test_an_oversized_body_gets_a_readable_413(server):
    status, answer, _ = post_raw(server.port, b"x" * (20 << 20))
    assert status == 413 and "over the 4096-byte limit" in answer["error"]["message"]
    assert post_raw(server.port, {"prompt": "Hi", "max_tokens": 2})[0] == 200


def test_expect_100_continue_is_refused_up_front_when_too_large(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n"
                  b"Expect: 100-continue\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:  # small bodies still continue
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Expect: 100-continue\r\n\r\n" % len(body))
        assert s.recv(65536).startswith(b"HTTP/1.1 100")
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_request_id_round_trip(server):
    _, _, headers = post_raw(server.port, {"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "trace-42"})
    assert headers["X-Request-Id"] == "trace-42"
    wait_for_log(server, r"POST / 200 \d+ms id=trace-42 ")  # logged once the reply is sent, so maybe just after
    _, _, headers = post_raw(server.port, {"prompt": "Hi", "max_tokens": 2})
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
    status, _, headers = http("GET", server.url + "/nowhere", headers={"X-Request-Id": "err-1"})
    assert status == 404 and headers["X-Request-Id"] == "err-1"
    _, _, headers = http("GET", server.url + "/health", headers={"X-Request-Id": "bad id with spaces"})
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])


def test_idle_and_slow_connections_are_closed_after_idle_timeout(trained_model, start_server):
    server = start_server(trained_model, "--length-buckets", "64", "--max-batch-size", "1", "--idle-timeout", "2")
    silent = socket.create_connection(("127.0.0.1", server.port))
    half_header = socket.create_connection(("127.0.0.1", server.port))
    half_header.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
    keep_alive = socket.create_connection(("127.0.0.1", server.port))
    keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert keep_alive.recv(65536).startswith(b"HTTP/1.1 200")
    trickle = socket.create_connection(("127.0.0.1", server.port))  # a byte every 0.5 s: each read is quick
    slow_body = socket.create_connection(("127.0.0.1", server.port))
    slow_body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    started = time.time()
    for byte in b"POST / HTTP/1.1\r\nHost: x\r\n":
        if time.time() - started > 4:
            break
        try:
            trickle.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.5)
    for s in (silent, half_header, keep_alive, trickle):
        assert closed_by_server(s, within=6)
    slow_body.settimeout(6)
    answer = slow_body.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"--idle-timeout" in answer
    assert server.metric("serve_idle_closed_total") >= 4
    assert http("POST", server.url + "/", {"prompt": "Hi", "max_tokens": 2})[0] == 200


def test_max_connections_is_enforced_without_a_thread(trained_model, start_server):
    server = start_server(trained_model, "--length-buckets", "64", "--max-batch-size", "1", "--max-connections", "3")
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    time.sleep(0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as extra:
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := extra.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After" in head
    assert "--max-connections 3" in json.loads(body)["error"]["message"]
    for s in held:
        s.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            if http("GET", server.url + "/health", timeout=5)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        raise AssertionError("no connection accepted after the held ones closed")
    assert server.metric("serve_refused_connections_total") >= 1


def test_the_hangup_watcher_survives_a_connection_closed_under_it(monkeypatch):
    """Its handler closes a connection between the watcher's lookup and its check (fileno() is then -1, and
    poll.register raised ValueError, which ended the thread): the watcher goes on and sees later hang-ups."""
    hangups = Hangups()
    hung_up, injected = hangups.hung_up, []

    def closing_first(connection):
        if not injected:
            injected.append(connection)
            connection.close()  # what the handler does, in the window
        return hung_up(connection)
    monkeypatch.setattr(hangups, "hung_up", closing_first)
    first_ours, first_theirs = socket.socketpair()
    first = Generation([2, 3], 5, SAMPLER_DEFAULTS["greedy"], 0, [], None)
    hangups.watch(first_ours, [first])
    first_theirs.close()
    deadline = time.time() + 10
    while not injected and time.time() < deadline:
        time.sleep(0.01)
    assert injected
    ours, theirs = socket.socketpair()
    later = Generation([2, 3], 5, SAMPLER_DEFAULTS["greedy"], 0, [], None)
    hangups.watch(ours, [later])
    theirs.close()
    while not later.cancelled and time.time() < deadline:
        time.sleep(0.01)
    assert later.cancelled and not first.cancelled
    assert first_ours not in [c for c, _ in hangups.watched.values()]
    ours.close()


def test_log_lines_are_written_whole_from_many_threads(monkeypatch):

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            time.sleep(0)  # let another thread in between two writes, if there are two

        def flush(self):
            pass
    recorder = Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    threads = [threading.Thread(target=lambda i=i: [log(f"thread {i} line {j}") for j in range(200)])
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(recorder.writes) == 16 * 200
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d thread \d+ line \d+\n", w) for w in recorder.writes)


def test_no_two_log_lines_join_under_96_concurrent_clients(server):
    start = threading.Barrier(96)

    def client(i):
        start.wait()
        return post_raw(server.port, {"prompt": f"Log line {i}", "max_tokens": 3})[0]
    with concurrent.futures.ThreadPoolExecutor(96) as pool:
        statuses = list(pool.map(client, range(96)))
    assert set(statuses) <= {200, 503} and 200 in statuses
    lines = server.output().splitlines()
    requests = [line for line in lines if " POST / " in line]
    assert len(requests) >= statuses.count(200)
    # Each request line is one line: a timestamp, one request, and nothing joined after its finish reasons.
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d POST / \d{3} \d+ms id=\S+( prompt=.* finish=[a-z,]+)?", line)
               for line in requests), [line for line in requests if line.count("POST") > 1][:3]


def test_one_thread_writes_every_stream_and_a_client_that_stops_reading_is_dropped_alone():
    """Streams are written by one StreamWriter thread (issue #48), without blocking: a client that reads
    nothing holds back no other stream, and is dropped after its handler's timeout with its generations
    cancelled; pieces put before the handler opened the stream come first, in order; a cancelled piece
    ends the stream as a client that left."""
    import types

    writer = StreamWriter()

    def stream(first=()):
        events = writer.events()
        gens = [types.SimpleNamespace(cancelled=False)]
        gens[0].cancel = lambda g=gens[0]: setattr(g, "cancelled", True)
        return stream_events(gens, events, lambda i, text, reason, e: [{"text": text, "reason": reason}],
                             first=first, last=lambda: {"usage": 1}), gens[0]

    def serve_in_thread(events, connection, timeout):
        outcome = {}

        def run():
            try:
                events.serve(connection, connection.makefile("wb", buffering=0), timeout)
                outcome["error"] = None
            except Exception as e:
                outcome["error"] = e
        thread = threading.Thread(target=run)
        thread.start()
        return thread, outcome
    text = "x" * 2000
    reading, reading_client = socket.socketpair()
    stuck, stuck_client = socket.socketpair()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stuck_client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ok, ok_gen = stream(first=[{"first": True}])
    blocked, blocked_gen = stream()
    ok.put((0, "early", None, []))  # before the handler opened it: it waits for the headers
    threads = [serve_in_thread(ok, reading, 30), serve_in_thread(blocked, stuck, 0.5)]
    for k in range(300):
        for events in (ok, blocked):
            events.put((0, text if k < 299 else "end", "length" if k == 299 else None, []))
    reading_client.settimeout(10)
    received, started = b"", time.monotonic()
    while not received.endswith(b"data: [DONE]\n\n"):
        received += reading_client.recv(1 << 16)
    assert time.monotonic() - started < 5  # not held back by the client that reads nothing
    events = [json.loads(e[len("data: "):]) for e in received.decode().split("\n\n") if e and e != "data: [DONE]"]
    assert events[0] == {"first": True} and events[1]["text"] == "early" and events[-2]["text"] == "end"
    assert events[-1] == {"usage": 1} and len(events) == 2 + 300 + 1
    for thread, _ in threads:
        thread.join(10)
    assert threads[0][1]["error"] is None
    assert isinstance(threads[1][1]["error"], TimeoutError) and blocked_gen.cancelled
    gone, gone_gen = stream()
    ours, theirs = socket.socketpair()
    thread, outcome = serve_in_thread(gone, ours, 30)
    gone.put((0, "a", None, []))
    gone.put((0, "", "cancelled", []))
    thread.join(10)
    assert isinstance(outcome["error"], ClientGone) and gone_gen.cancelled
    for s in (reading, reading_client, stuck, stuck_client, ours, theirs):
        s.close()
