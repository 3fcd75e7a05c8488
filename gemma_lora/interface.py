"""The one interface between the front end and the engine: a request goes in as a Generation (its prompt
ids, limits, sampling, stop strings) through EngineCore.submit (see engine/core.py), and its events come out
through the Generation itself (its `events` queue and `done`). The limits both halves agree on live here too."""
import threading
import time

from gemma_lora.metrics import METRICS


# Sampling looks at this many most-likely tokens: top_k is capped here and top_p is computed over them.
CANDIDATES = 128
DETOKENIZE_WINDOW = 16  # tokens a streamed row decodes again with its new ones (Generation.detokenize)
TOP_LOGPROBS = 20  # most alternatives a request may ask log-probabilities for (OpenAI's limit)
BIAS_SLOTS = 300  # logit_bias entries a request may send (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 8  # stop_token_ids a request may send; with the model's own, STOP_SLOTS at most
STOP_SLOTS = 16
MAX_N = 16  # answers a request may ask for (n)
SAMPLER_DEFAULTS = {  # keras-hub's samplers' defaults: the article's "top_k" is TopKSampler(k=5)
    "greedy": {"temperature": 0.0, "top_k": CANDIDATES, "top_p": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 5, "top_p": 1.0},
    "top_p": {"temperature": 1.0, "top_k": CANDIDATES, "top_p": 0.1},
}


# Requests become Generations, queue at the Worker, and take rows of its decode batch as they free.
class Generation:
    """One prompt being decoded: collects tokens, applies stops, reports events for streaming."""

    def __init__(self, prompt_ids, max_tokens, sampling, seed, stop, events, index=0, logprobs=None):
        self.prompt_ids, self.max_tokens, self.sampling, self.seed = prompt_ids, max_tokens, sampling, seed
        # The LoRA adapter it decodes with (None: the base) and its slot (start_generations() sets them);
        # `releases` hand back what it holds (its adapter slot, its prefix-cache blocks) when it ends.
        self.adapter, self.slot, self.releases = None, 0, []
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.shares_prompt = False  # one of n answers after the first: usage counts its prompt once
        self.stop_ids = set(sampling.get("stop_token_ids", ()))  # the request's, besides the model's (ignore_eos: not those)
        self.ignore_eos = sampling.get("ignore_eos", False)
        self.min_tokens = sampling.get("min_tokens", 0)
        self.stops_from = 0  # where stop strings are looked for: text made before min_tokens does not count
        self.matcher = None  # an llguidance.LLMatcher when the output must follow a grammar
        self.model = None  # the name it was asked for, for per-model metrics
        self.stop, self.events, self.index = stop, events, index
        self.ids, self.text, self.sent, self.finish_reason = [], "", 0, None
        # detokenize()'s window: text[:decoded_text] is the decoding of the ids it had decoded when it last moved
        # on, and those from decoded_from (whose own decoding is window_text) are decoded again before new ones:
        # their text gives the new ones' leading space
        self.decoded_from = self.decoded_text = 0
        self.window_text = ""
        # None, or how many alternatives to keep per token: then token_logprobs[i] is
        # (ids[i], its logprob, [(alternative id, logprob), ...]).
        self.logprobs, self.token_logprobs, self.logprobs_sent = logprobs, [], 0
        self.cancelled = False  # set by the HTTP thread when the client leaves; the worker acts on it
        self.enqueued = time.time()
        self.started = self.first_token_at = self.finished_at = None
        self.done = threading.Event()

    def latencies(self):
        """(its wait for a row, its time to first token, its mean time per token after the first), None for
        those it did not reach."""
        first, tokens = self.first_token_at, len(self.ids)
        return (None if self.started is None else self.started - self.enqueued,
                None if first is None else first - self.enqueued,
                (self.finished_at - first) / (tokens - 1) if first and self.finished_at and tokens > 1 else None)

    def accept(self, token, engine, alternatives=None, emit=True):
        """Takes one generated token (and, when asked for, its log-probabilities: (logprob, top logprobs,
        top ids)); returns True when this generation has finished. `emit`: stream what is new now (settle()
        says False, and emits once per chunk: one event and one socket write for its tokens, not one each)."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        if token in self.stop_ids or (token in engine.stop_ids and not self.ignore_eos):
            return self.finish("stop", engine)
        if self.matcher is not None:
            self.matcher.consume_token(token)
        self.ids.append(token)
        if alternatives is not None:
            logprob, top_logprobs, top_ids = alternatives
            top = list(zip(top_ids[:self.logprobs].tolist(), top_logprobs[:self.logprobs].tolist()))
            self.token_logprobs.append((token, float(logprob), top))
        if self.stop:  # stop strings are looked for token by token; a stream's text is made when it is sent
            self.detokenize(engine)
        if len(self.ids) < self.min_tokens:
            self.stops_from = len(self.text)
        for stop in self.stop if len(self.ids) >= self.min_tokens else ():
            at = self.text.find(stop, max(self.stops_from - len(stop) + 1, 0))  # it may end after min_tokens
            if at >= 0:
                self.text = self.text[:at]
                return self.finish("stop", engine)
        if self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self.finish("stop", engine)
        if len(self.ids) >= self.max_tokens:
            return self.finish("length", engine)
        if emit:
            self.emit(final=False, engine=engine)
        return False

    def detokenize(self, engine):
        """Makes `text` decode(ids) by decoding only the tokens since decoded_from (incremental detokenization,
        as vLLM and TGI do): what decoding ids[decoded_from:] gives past window_text (the text of the tokens
        from decoded_from it had decoded when it last moved on) is what the tokens since add to the first
        decoded_text characters, a word's leading space included. Decoding every id again each chunk cost a SentencePiece
        call of the whole answer a row (issue #48); this is one call of at most DETOKENIZE_WINDOW tokens and a
        chunk's, and a second when the window starts again from the last token. It moves on only past text
        that does not end inside a UTF-8 character, which a later byte may complete."""
        new = engine.decode(self.ids[self.decoded_from:])
        if not new.startswith(self.window_text):  # a tokenizer whose text is not built piece by piece
            self.text = engine.decode(self.ids)
            self.decoded_from = self.decoded_text = 0
            self.window_text = ""
            return
        self.text = self.text[:self.decoded_text] + new[len(self.window_text):]
        if not new.endswith("\ufffd"):
            self.decoded_text, self.window_text = len(self.text), new
            if len(self.ids) - self.decoded_from > DETOKENIZE_WINDOW:
                self.decoded_from = len(self.ids) - 1
                self.window_text = engine.decode(self.ids[self.decoded_from:])

    def emit(self, final, engine=None):
        if self.events is None:
            return
        if engine is not None and not self.stop:
            self.detokenize(engine)
        # Hold back a trailing partial UTF-8 character and anything that may be the start of a stop string.
        upto = len(self.text) if final else len(self.text.rstrip("\ufffd"))
        if not final and self.stop:
            upto = max(self.sent, upto - max(len(s) for s in self.stop) + 1)
        if upto > self.sent or final:
            entries = self.token_logprobs[self.logprobs_sent:]
            self.logprobs_sent = len(self.token_logprobs)
            self.events.put((self.index, self.text[self.sent:upto], self.finish_reason if final else None, entries))
            self.sent = upto

    def cancel(self):
        self.cancelled = True

    def finish(self, reason, engine=None):
        if engine is not None and not self.stop:  # with stop strings, accept() keeps it (and cuts it)
            self.text = engine.decode(self.ids)
        if reason == "cancelled":
            METRICS.add("cancelled")
        self.finish_reason, self.finished_at = reason, time.time()
        release_all([self])
        self.emit(final=True)
        self.done.set()
        return True


class QueueFull(Exception):
    pass


class WorkerGone(Exception):
    """The model worker's thread has stopped: nothing submitted now would ever be read."""


def release_all(gens):
    for g in gens:
        releases, g.releases = g.releases, []
        for release in releases:
            release()
