"""The state every route shares (Server: configuration, readiness, the engine's interface, compiled
grammars) and what a route returns or raises (Reply, RequestError)."""
import collections
import random
import threading
import time
from pathlib import Path

from gemma_lora.chat import TEMPLATES
from gemma_lora.log import log
from gemma_lora.memory import MemoryLog, release_freed_memory
from gemma_lora.tokens import grammar_tokenizer


class RequestError(Exception):
    def __init__(self, status, message, kind="invalid_request_error", headers=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.headers, self.code = status, kind, headers or {}, code


class ClientGone(Exception):
    """The client closed or reset its connection before its answer was ready."""


class Reply:
    """A JSON payload, a text body, or a stream of server-sent-event chunks (None = nothing yet)."""

    def __init__(self, status=200, payload=None, text=None, content_type="application/json", stream=None,
                 headers=None):
        self.status, self.payload, self.text, self.content_type = status, payload, text, content_type
        self.stream, self.headers = stream, headers or {}


class Server:
    """Everything the routes share: configuration, readiness, the worker."""

    def __init__(self, args):
        self.args = args
        self.state = "loading"
        self.core = None  # the engine's interface (EngineCore) once the model is loaded
        self.template = dict(TEMPLATES["article"], name="article")
        self.model_name = Path(args.model.rstrip("/")).name or args.model
        self.base_names = (self.model_name, args.model)  # what `model` may say to mean the base
        self.in_flight = 0
        self.lock = threading.Lock()
        self.rng = random.Random(args.seed)  # seeds for requests that bring none
        self.vocabulary = None  # (tokenizer, size, stop ids): what structured output's token table is built from,
        # until it is (see grammar_tokens)
        self.grammar_table = None  # llguidance's view of the vocabulary (see grammar_tokens)
        self.grammar_lock = threading.Lock()
        self.grammars = collections.OrderedDict()  # grammar text -> compiled LLMatcher, least recently used first
        self.started = time.time()
        self.memory = MemoryLog()

    def advance(self, state):
        """Moves to `state` unless shutdown has begun: a loader finishing its warm-up after a SIGTERM must
        not announce itself ready."""
        with self.lock:
            if self.state != "shutting_down":
                self.state = state
            return self.state == state

    def grammar_tokens(self):
        """llguidance's view of the vocabulary (None: the tokenizer is not SentencePiece), built by the first
        request that wants structured output: its table of every token, 80 MiB for Gemma's 262,144, is not
        held by a server that never gets one. Its own lock: concurrent first requests build it once while
        others go on. Tried once: `vocabulary` is dropped then, built or not."""
        with self.grammar_lock:
            if self.vocabulary is not None:
                started, size = time.time(), self.vocabulary[1]
                self.grammar_table, self.vocabulary = grammar_tokenizer(*self.vocabulary), None
                release_freed_memory()  # the protobuf of every piece it was read from
                if self.grammar_table is not None:
                    log(f"structured output: llguidance's table of {size:,} tokens built in "
                        f"{time.time() - started:.1f}s, for the first request that wanted it")
            return self.grammar_table

    def status(self):
        """The state, "failed" once the worker thread is gone: /health must not say ok while requests hang."""
        if self.state == "ready" and self.core is not None and not self.core.alive():
            return "failed"
        return self.state


def ready_engine(server):
    state = server.status()
    if state != "ready":
        raise RequestError(503, f"model is {state}", "overloaded_error", {"Retry-After": "5"})
    return server.core
