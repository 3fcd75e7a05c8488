"""The HTTP plumbing: the listening socket (TCP, or a unix domain socket), connection limits and idle
timeouts, hang-ups noticed while an answer is computed, and the request handler (auth, routing, errors, logs)."""
import contextlib
import errno
import hmac
import json
import os
import re
import select
import selectors
import socket
import stat
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer

from gemma_lora.frontend.api import PUBLIC_ROUTES, ROUTES
from gemma_lora.frontend.protocol import usage
from gemma_lora.frontend.server import ClientGone, RequestError
from gemma_lora.log import log
from gemma_lora.metrics import METRICS, THREAD_CPU


LINGER_BYTES, LINGER_SECONDS = 64 << 20, 10.0  # what is read and dropped of a refused body before closing
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/=+-]{1,128}")
UDS_PATH_BYTES = 103 if sys.platform == "darwin" else 107  # sockaddr_un's sun_path, less its closing NUL


class BindError(Exception):
    """Why the server cannot listen where it was told to, in one line for the user."""


def where(args):
    return f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"


def claim_socket_path(path):
    """Makes way for a unix socket at `path`: a socket file left by a crashed run is removed, but a
    socket something still answers on, or a file that is not a socket, is never touched."""
    if len(os.fsencode(path)) > UDS_PATH_BYTES:
        raise BindError(f"--uds {path}: the path is {len(os.fsencode(path))} bytes, and a unix socket's may have at "
                        f"most {UDS_PATH_BYTES}; pick a shorter one, such as /tmp/serve.sock")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BindError(f"--uds {path}: a file that is not a socket is there; remove it or pick another path")
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(2)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):  # nobody listens: a crashed run's leftover
            try:
                os.unlink(path)
            except FileNotFoundError:  # another start removed it first
                pass
            except OSError as e:  # someone else's, in a folder that does not let us (a sticky /tmp)
                raise BindError(f"--uds {path}: a stale socket file is there and cannot be removed "
                                f"({e.strerror.lower() if e.strerror else e}); remove it or pick another path") from None
            return
        except OSError:
            pass  # cannot tell (no permission): say it is taken rather than remove someone else's socket
    raise BindError(f"--uds {path}: another server is listening on it; stop it or pick another path")


def bind_error(args, error):
    """One line for an OSError from creating, binding or listening on the server's socket."""
    at = f"--uds {args.uds}" if args.uds else f"{args.host}:{args.port}"
    if isinstance(error, socket.gaierror):
        return f"cannot listen on {at}: --host {args.host} is not an address of this machine ({error.strerror})"
    reasons = {
        errno.EADDRINUSE: "the address is in use by another program: stop it, or pick another "
                          + ("--uds path" if args.uds else "--port"),
        errno.EACCES: "permission denied" + (" (can this user create files in its folder?)" if args.uds else
                                             " (ports below 1024 need root; pick --port 8080 or above)"),
        errno.EAFNOSUPPORT: "this machine does not allow " + ("unix" if args.uds else "TCP") + " sockets"
                            + ("" if args.uds else " (a sandbox?): serve on a unix socket with --uds PATH"),
        errno.EADDRNOTAVAIL: f"--host {args.host} is not an address of this machine",
        errno.ENOENT: "its folder does not exist",
    }
    return f"cannot listen on {at}: {reasons.get(error.errno, error.strerror or str(error))}"


class Listener(ThreadingHTTPServer):
    """The standard library's threaded server, made fit for real clients: a listen backlog that holds
    a burst (socketserver's is 5, so bursts were reset), a cap on open connections that costs no
    thread to enforce, and a reaper that closes connections idle or still sending their headers past
    --idle-timeout. With --uds it listens on a unix domain socket instead; nothing else changes."""
    daemon_threads = True
    request_queue_size = max(1024, socket.SOMAXCONN)

    def __init__(self, app):
        self.app = app
        self.deadlines = {}  # open connection -> when the reaper closes it; None while a request runs
        self.deadlines_lock = threading.Lock()
        self.uds = app.args.uds
        self.socket_inode = None  # set once our bind made the file: a failed bind must leave any other alone
        if self.uds:
            claim_socket_path(self.uds)
            self.address_family = socket.AF_UNIX
        try:
            super().__init__(self.uds or (app.args.host, app.args.port), Handler)
        except OSError as e:
            raise BindError(bind_error(app.args, e)) from None
        self.hangups = Hangups()
        threading.Thread(target=self.reap, daemon=True, name="reaper").start()

    def server_bind(self):
        if not self.uds:
            return super().server_bind()
        # The file's mode is the socket's access control: it is created owner-only, with no moment in
        # which others could connect, and only then opened up as far as --uds-mode says.
        umask = os.umask(0o177)
        try:
            self.socket.bind(self.uds)
        finally:
            os.umask(umask)
        os.chmod(self.uds, self.app.args.uds_mode)
        self.socket_inode = os.stat(self.uds).st_ino
        self.server_name, self.server_port = "localhost", 0

    def server_close(self):
        super().server_close()
        with contextlib.suppress(OSError):  # only our own file: a later run may have replaced it
            if self.uds and self.socket_inode is not None and os.stat(self.uds).st_ino == self.socket_inode:
                os.unlink(self.uds)

    def get_request(self):
        connection, address = super().get_request()
        return connection, address or ("unix", 0)  # a unix socket's peer has no address; handlers log one

    def process_request(self, request, client_address):
        with self.deadlines_lock:
            full = len(self.deadlines) >= self.app.args.max_connections
            if not full:
                self.deadlines[request] = time.time() + self.app.args.idle_timeout
        if full:
            refuse_connection(request, self.app.args.max_connections)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        with THREAD_CPU.http_thread():
            super().process_request_thread(request, client_address)

    def shutdown_request(self, request):
        with self.deadlines_lock:
            self.deadlines.pop(request, None)
        self.hangups.forget(request)
        super().shutdown_request(request)

    def set_deadline(self, connection, deadline):
        with self.deadlines_lock:
            if connection in self.deadlines:
                self.deadlines[connection] = deadline

    def open_connections(self):
        return len(self.deadlines)

    def reap(self):
        while True:
            time.sleep(0.25)
            now = time.time()
            with self.deadlines_lock:
                late = [c for c, deadline in self.deadlines.items() if deadline is not None and deadline < now]
                for connection in late:
                    self.deadlines[connection] = None
            for connection in late:  # its thread's blocked read then returns, and the thread ends
                METRICS.add("idle_closed")
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Hangups:
    """One thread that learns from the OS the moment a client closes, half-closes or resets a connection
    whose generations are running, and cancels them, so the worker frees their rows at its next chunk
    and the handler threads need not poll their sockets. On Linux it asks epoll for the hang-up alone
    (EPOLLRDHUP): bytes a client pipelines after its request do not end the watch, and a disconnect after
    them is still seen. Elsewhere a readable socket is peeked: the end of the stream is a hang-up, and
    after pipelined bytes the connection is no longer watched (they would make it readable forever)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.epoll = select.epoll() if hasattr(select, "epoll") else None
        self.selector = None if self.epoll else selectors.DefaultSelector()
        self.watched = {}  # fd -> (connection, generations)
        threading.Thread(target=self.run, daemon=True, name="hangups").start()

    def watch(self, connection, generations):
        with self.lock:
            fd = connection.fileno()
            self.watched[fd] = connection, generations
            try:  # an fd seen before: a keep-alive connection's next request, or a closed one's number reused
                if self.epoll:
                    self.epoll.register(fd, select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)
                else:
                    self.selector.register(connection, selectors.EVENT_READ)
            except (KeyError, ValueError, FileExistsError):
                if self.epoll:
                    self.epoll.modify(fd, select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)
                else:
                    self.selector.modify(connection, selectors.EVENT_READ)

    def forget(self, connection):
        with self.lock:  # by identity: a closed connection's fileno() is -1
            fd = next((fd for fd, (c, _) in self.watched.items() if c is connection), None)
            if fd is None:
                return
            del self.watched[fd]
            try:
                if self.epoll:
                    self.epoll.unregister(fd)
                else:
                    self.selector.unregister(connection)
            except (KeyError, ValueError, OSError):
                pass

    def run(self):
        while True:
            try:
                self.check()
            except Exception as e:  # a thread that ends here would leave every later hang-up unseen
                log(f"error: the hang-up watcher: {type(e).__name__}: {e} (it goes on)")
                time.sleep(0.1)

    def check(self):
        """Waits up to half a second for hang-ups and cancels the generations of those seen."""
        if self.epoll:
            fds = [fd for fd, _ in self.epoll.poll(0.5)]
        else:
            fds = [key.fd for key, _ in self.selector.select(timeout=0.5)]
        for fd in fds:
            with self.lock:
                connection, generations = self.watched.get(fd, (None, ()))
            # Asked of the connection itself: the event may be a closed one's whose number is reused.
            gone = None if connection is None else self.hung_up(connection)
            if gone is None:
                continue
            self.forget(connection)  # either way there is nothing more to learn from it
            if gone:
                for g in generations:
                    g.cancel()

    def hung_up(self, connection):
        """True if the client closed, half-closed or reset; None if not (or not yet known); False after
        pipelined bytes where only a peek can tell (then the connection is no longer watched)."""
        if connection.fileno() < 0:  # its handler closed it after the lookup: the request is over, and its
            return False  # generations with it, so there is nothing to cancel (and poll would raise)
        if self.epoll:
            check = select.poll()
            try:
                check.register(connection, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            except (ValueError, OSError):  # closed between the check above and here
                return False
            return True if check.poll(0) else None
        try:
            return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return True


def refuse_connection(connection, limit):
    """503 and close, on the accepting thread: a flood of connections must not cost a thread each."""
    METRICS.add("refused_connections")
    body = json.dumps({"error": {"message": f"too many open connections (--max-connections {limit}); retry later",
                                 "type": "overloaded_error"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        connection.setblocking(False)
        try:
            connection.recv(1 << 16)  # what already came: closing on unread data would reset the answer
        except OSError:
            pass
        connection.send(head + body)
        connection.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        connection.close()


def record_request(method, path, status, started, gens, request_id):
    """A finished request in /metrics and, when it generated or failed, one log line: with its tokens,
    queue wait, speed and finish reasons when it generated."""
    elapsed = time.time() - started
    METRICS.observe_request(path if path in ROUTES else "other", status, elapsed if gens else None)
    if not gens and (status < 400 or path == "/health"):
        return
    line = f"{method} {path} {status} {elapsed * 1000:.0f}ms id={request_id}"
    if gens:
        counts = usage(gens)
        prompt_tokens, completion_tokens = counts["prompt_tokens"], counts["completion_tokens"]
        cached = counts["prompt_tokens_details"]["cached_tokens"]
        METRICS.add("prompt_tokens", prompt_tokens)
        METRICS.add("cached_prompt_tokens", cached)
        METRICS.add("generated_tokens", completion_tokens)
        METRICS.observe_model(gens[0].model, completion_tokens)
        for g in gens:
            METRICS.observe_generation(g.latencies())
        queue_wait = max((g.started or time.time()) - g.enqueued for g in gens)
        reasons = ",".join(sorted({g.finish_reason or "cancelled" for g in gens}))
        line += (f" prompt={prompt_tokens} cached={cached} completion={completion_tokens} "
                 f"queue={queue_wait * 1000:.0f}ms {completion_tokens / max(elapsed, 1e-9):.1f} tok/s "
                 f"finish={reasons}")
    log(line)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests, in turn: read, route, write, log, count."""
    server_version = "gemma-lora-serve"
    protocol_version = "HTTP/1.1"

    def setup(self):
        # A backstop for writes to a client that stopped reading; reads are closed earlier by the reaper.
        self.timeout = self.server.app.args.idle_timeout + 10
        super().setup()

    def log_message(self, *a):  # one structured line per request instead
        pass

    def handle_one_request(self):
        # Idle, or still sending its request line and headers: the reaper closes it at the deadline.
        self.server.set_deadline(self.connection, time.time() + self.server.app.args.idle_timeout)
        self.request_id, self.generations, self.body_read = None, [], False
        super().handle_one_request()

    def end_headers(self):
        self.send_header("X-Request-Id", self.rid())
        super().end_headers()

    def rid(self):
        if self.request_id is None:
            incoming = getattr(self, "headers", None) and self.headers.get("X-Request-Id", "")
            self.request_id = incoming if incoming and REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        return self.request_id

    def send_error(self, code, message=None, explain=None):
        """The standard library's own errors (bad request line, headers too long) as JSON too."""
        self.close_connection = True
        self.send_json(code, {"error": {"message": message or self.responses.get(code, ("error",))[0],
                                        "type": "invalid_request_error"}})

    def handle_expect_100(self):
        """Refuses an oversized body before the client sends it, instead of the automatic 100 Continue."""
        length = self.headers.get("Content-Length", "").strip()
        limit = self.server.app.args.max_body_bytes
        if length.isdigit() and int(length) > limit:
            self.close_connection = True
            self.send_error_reply(RequestError(413, f"body of {length} bytes is over the {limit}-byte limit"))
            METRICS.observe_request("other", 413, None)
            return False
        return super().handle_expect_100()

    def __getattr__(self, name):
        """Every method (do_GET, do_POST, …, even unknown ones) goes through dispatch: the route table
        answers 404/405 itself, where the standard library would answer 501."""
        if name.startswith("do_"):
            return lambda: self.dispatch(name[3:])
        raise AttributeError(name)

    # -------------------------------------------------------------- one request
    def dispatch(self, method):
        app = self.server.app
        self.server.set_deadline(self.connection, None)  # busy: body reads and writes keep their own deadlines
        started, path = time.time(), self.path.split("?", 1)[0]
        status = 500
        with app.lock:
            app.in_flight += 1
        try:
            status = self.send_reply(self.route(app, method, path))
        except RequestError as e:
            status = e.status
            try:
                self.send_error_reply(e)
            except OSError:
                status = 499
        except ClientGone:
            status = 499
        except OSError:  # the client went away while we wrote
            status = 499
            for g in self.generations:
                g.cancel()
        except Exception as e:  # a bug must cost one request, not the server
            log(f"error: {method} {path}: {type(e).__name__}: {e}")
            self.close_connection = True
            try:
                self.send_error_reply(RequestError(500, "internal error", "server_error"))
            except OSError:
                pass
        finally:
            with app.lock:
                app.in_flight -= 1
            self.server.hangups.forget(self.connection)
        if status == 499:
            self.close_connection = True
        elif not self.body_read:
            self.discard_body()
        record_request(method, path, status, started, self.generations, self.rid())

    def route(self, app, method, path):
        methods = ROUTES.get(path)
        if methods is None:
            raise RequestError(404, f"no route {path}", "not_found_error")
        if method not in methods:
            raise RequestError(405, f"{method} not allowed on {path}", "invalid_request_error",
                               {"Allow": ", ".join(methods)})
        if path not in PUBLIC_ROUTES:
            self.check_auth(app.args.api_key)
        return methods[method](app, self)

    def check_auth(self, key):
        # Constant-time, so response timing does not reveal how much of a guessed key was right.
        if key and not hmac.compare_digest(self.headers.get("Authorization", "").encode("latin-1"),
                                           f"Bearer {key}".encode()):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", {"WWW-Authenticate": "Bearer"})

    # -------------------------------------------------------------- reading
    def json(self):
        content_type = self.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise RequestError(415, f"Content-Type must be application/json, got {content_type!r}")
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise RequestError(411, "Content-Length required")
        if not length_header.strip().isdigit():
            raise RequestError(400, f"bad Content-Length {length_header!r}")
        length, limit = int(length_header), self.server.app.args.max_body_bytes
        if length > limit:
            raise RequestError(413, f"body of {length} bytes is over the {limit}-byte limit")
        raw = self.read_body(length)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, "body is not valid UTF-8") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"body must be a JSON object, got {type(body).__name__}")
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise RequestError(400, "body holds a lone surrogate escape (\\ud800-\\udfff), which is not text") from None
        return body

    def read_body(self, length):
        """The body, within --idle-timeout in all (a client trickling bytes gets 408, not a thread forever)."""
        self.body_read = True
        timeout = self.server.app.args.idle_timeout
        deadline, chunks, got = time.time() + timeout, [], 0
        try:
            while got < length:
                remaining = deadline - time.time()
                if remaining <= 0:
                    raise TimeoutError
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(length - got, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        except TimeoutError:
            self.close_connection = True
            raise RequestError(408, f"request body not received within {timeout:g}s (--idle-timeout)",
                               headers={"Connection": "close"}) from None
        finally:
            self.connection.settimeout(self.timeout)
        if got < length:
            self.close_connection = True
            raise RequestError(400, f"body shorter than its Content-Length ({got} < {length})")
        return b"".join(chunks)

    def discard_body(self):
        """Reads and drops a body that was answered without being read (a 413, a 401, …). A client that
        writes its whole body before reading would otherwise see a reset instead of the answer; the
        connection stays usable when the whole body came ("lingering close", as nginx does)."""
        length = self.headers.get("Content-Length", "0").strip()
        if not length.isdigit():
            self.close_connection = True
            return
        left, deadline = int(length), time.time() + LINGER_SECONDS
        if left > LINGER_BYTES:
            self.close_connection = True
        try:
            while left > 0 and time.time() < deadline:
                self.connection.settimeout(max(0.01, deadline - time.time()))
                chunk = self.rfile.read1(min(left, 1 << 16, LINGER_BYTES))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass
        if left > 0:
            self.close_connection = True
        else:
            try:
                self.connection.settimeout(self.timeout)
            except OSError:
                pass

    def watch(self, generations):
        self.generations = generations
        self.server.hangups.watch(self.connection, generations)

    # -------------------------------------------------------------- writing
    def send_json(self, status, payload, headers=None):
        self.send_body(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json", headers)

    def send_body(self, status, body, content_type, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error_reply(self, error):
        payload = {"message": str(error), "type": error.kind} | ({"code": error.code} if error.code else {})
        self.send_json(error.status, {"error": payload}, error.headers)

    def send_reply(self, reply):
        if reply.stream is None:
            if reply.text is not None:
                self.send_body(reply.status, reply.text.encode(), reply.content_type, reply.headers)
            else:
                self.send_json(reply.status, reply.payload, reply.headers)
            return reply.status
        self.send_response(reply.status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        reply.stream.serve(self.connection, self.wfile, self.timeout)
        return reply.status
