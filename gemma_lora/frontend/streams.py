"""Streamed replies (server-sent events): the worker puts each generation's pieces on its reply's
EventStream, and one thread (StreamWriter) renders and writes them all, without blocking on a slow reader."""
import collections
import json
import threading
import time

from gemma_lora.frontend.server import ClientGone


def sse(payload):
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_events(gens, events, render, first=(), last=None):
    """A streamed reply of server-sent events: the payloads in `first`, then what render(index, text,
    finish_reason, logprob entries) makes of each piece the generations put in `events` (an EventStream from
    STREAMS.events(), given to them before they started), then last() and `data: [DONE]`."""
    events.gens, events.render, events.first, events.last = gens, render, first, last
    return events


class EventStream:
    """One streamed reply. The worker puts each generation's pieces here as it hands out a chunk; the one
    StreamWriter thread renders and writes them, so that no HTTP thread wakes per chunk. Until the handler
    has written the headers (open), pieces wait. Ended, it cancels what is left of its generations and lets
    the handler go on: with `error` set when the client left or could not be written to."""
    OPEN = object()

    def __init__(self, writer):
        self.writer, self.waiting = writer, []
        self.gens, self.render, self.first, self.last = [], None, (), None
        self.connection, self.out, self.finished, self.closing = None, bytearray(), 0, False
        self.timeout, self.stalled_since, self.error, self.over = None, None, None, False
        self.done = threading.Event()

    def put(self, piece):
        self.writer.put((self, piece))

    def serve(self, connection, wfile, timeout):
        """The handler's part, after the headers: the first payloads at once (the client learns its stream
        has started before the first token is made), then the writer takes the socket until the end."""
        try:
            if self.first:
                wfile.write("".join(sse(payload) for payload in self.first).encode())
            connection.setblocking(False)  # the writer must never wait on one client
            self.connection, self.timeout = connection, timeout
            self.writer.put((self, self.OPEN))
            self.done.wait()
        finally:
            self.over = True
            for g in self.gens:
                g.cancel()
        if self.error is not None:
            raise self.error

    def take(self, piece):
        """The writer's: renders a piece (or, at OPEN, those that waited) into bytes to send."""
        if piece is not self.OPEN and self.waiting is not None:
            self.waiting.append(piece)
            return
        pieces, self.waiting = (self.waiting or []) if piece is self.OPEN else [piece], None
        out = []
        for index, text, reason, entries in pieces:
            if reason == "cancelled":
                return self.end(ClientGone())
            self.finished += reason is not None
            out += [sse(payload) for payload in self.render(index, text, reason, entries)]
        if self.finished == len(self.gens) and not self.closing:
            out += [sse(self.last())] if self.last is not None else []
            out.append("data: [DONE]\n\n")
            self.closing = True
        self.out += "".join(out).encode()

    def flush(self):
        """The writer's: sends what the socket takes now; True while bytes wait for it."""
        if self.over or self.waiting is not None:
            return False
        sent = False
        try:
            while self.out:
                del self.out[:self.connection.send(self.out)]
                sent = True
        except BlockingIOError:
            now = time.monotonic()
            if sent or self.stalled_since is None:
                self.stalled_since = now
            elif now - self.stalled_since > self.timeout:  # as a blocking write's timeout would
                self.end(TimeoutError("the client read nothing of its stream"))
                return False
            return True
        except OSError as e:  # the client went away while we wrote
            self.end(e)
            return False
        self.stalled_since = None
        if self.closing:
            self.end(None)
        return False

    def end(self, error):
        self.error, self.over, self.out = error, True, bytearray()
        self.done.set()


class StreamWriter:
    """The thread that writes every streamed reply (issue #48). With a thread per client woken for each
    chunk's event, the HTTP side cost about 73 us of CPU an event (wake-ups and GIL hand-offs;
    scripts/bench_streams.py, 64 and 256 clients), under load almost as much as the model worker's own;
    one thread that takes every event that has come and sends each client's in one write costs 12-17.
    Sockets are written without blocking: a client that reads slowly keeps its bytes waiting (tried again
    every WRITE_RETRY_SECONDS), and one that reads nothing for its handler's timeout is dropped alone."""

    def __init__(self):
        # The worker appends a chunk's pieces and wakes the writer once: a queue.Queue's lock and notify per
        # piece cost the worker about 2 us each (256 rows: half a millisecond a chunk, on its critical path).
        self.pending, self.wake = collections.deque(), threading.Event()
        self.lock, self.thread = threading.Lock(), None

    def put(self, item):
        self.pending.append(item)
        if not self.wake.is_set():
            self.wake.set()

    def events(self):
        """A new reply's EventStream, for its generations to put their pieces in."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, daemon=True, name="stream-writer")
                self.thread.start()
        return EventStream(self)

    def run(self):
        stalled = set()
        while True:
            self.wake.wait(WRITE_RETRY_SECONDS if stalled else None)
            self.wake.clear()  # before taking: a piece put from here on wakes the next round
            items = []
            while self.pending:
                items.append(self.pending.popleft())
            touched = dict.fromkeys(stream for stream, _ in items)  # in order of arrival
            for stream, piece in items:
                self.guarded(stream, stream.take, piece)
            for stream in list(touched) + [s for s in stalled if s not in touched]:
                (stalled.add if self.guarded(stream, stream.flush) else stalled.discard)(stream)

    @staticmethod
    def guarded(stream, step, *args):
        """A bug in one reply's rendering costs that reply, not every stream."""
        if stream.over:
            return False
        try:
            return step(*args)
        except Exception as e:
            stream.end(e)
            return False


WRITE_RETRY_SECONDS = 0.01
STREAMS = StreamWriter()
