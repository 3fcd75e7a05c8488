"""What /metrics tells (Prometheus' text format): counters and histograms of requests and tokens, the
model worker's time by part, the device's time by program, and the process's CPU by thread. The engine records,
the front end renders; nothing here imports JAX at import time."""
import bisect
import contextlib
import os
import queue
import threading
import time

from gemma_lora.memory import process_rss


LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A generation's own latencies, in vLLM's buckets (its time_to_first_token_seconds and time_per_output_token_
# seconds), so that a dashboard made for one reads the other.
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)


class Histogram:
    """A Prometheus histogram: counts per upper bound, their sum. Its owner holds the lock."""

    def __init__(self, name, help, buckets):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts, self.sum = [0] * (len(buckets) + 1), 0.0

    def observe(self, seconds):
        self.sum += seconds
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1

    def render(self):
        lines, cumulative = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"], 0
        for bound, count in zip(list(self.buckets) + ["+Inf"], self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        return lines + [f"{self.name}_sum {self.sum}", f"{self.name}_count {cumulative}"]


class Metrics:
    """Prometheus text exposition, kept by hand: a few counters need no client library."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {}          # (path, status) -> count
        self.latency = Histogram("serve_request_latency_seconds", "Latency of generation requests.", LATENCY_BUCKETS)
        # Each generation's (the n answers of a request are n): from its request's arrival to the worker taking
        # it (a row free), to its first token, and then per further token, as the worker hands them out.
        self.generation = [
            Histogram("serve_request_queue_seconds", "A generation's wait for a row of the batch.", FIRST_TOKEN_BUCKETS),
            Histogram("serve_time_to_first_token_seconds", "From a generation's request arriving to its first "
                      "token.", FIRST_TOKEN_BUCKETS),
            Histogram("serve_time_per_output_token_seconds", "A generation's time per token after its first (its "
                      "mean, for those of two tokens or more).", PER_TOKEN_BUCKETS)]
        self.prompt_tokens = self.generated_tokens = self.compilations = self.cancelled = 0
        self.request_compilations = self.compile_cache_hits = 0
        self.warm_up_pending = lambda: 0
        self.cached_prompt_tokens = self.prefix_bytes = self.prefix_blocks = 0
        self.prefill_groups = self.grouped_prompts = self.batch_resizes = 0
        self.grammar_masks, self.grammar_mask_seconds = 0, 0.0  # masks computed, host time computing them
        self.grammar_dropped = 0  # later tokens of a chunk a grammar row did not keep
        self.prefix_used = lambda: 0
        self.refused_connections = self.idle_closed = 0
        self.weight_bytes, self.weights = 0, {}  # weights: labels of serve_model_info
        self.batch_sizes = {}
        self.models = {}  # model (base or adapter) name -> (generation requests, generated tokens)
        self.queue_depth = self.open_connections = self.running = lambda: 0

    def observe_request(self, path, status, seconds):
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1
            if seconds is not None:
                self.latency.observe(seconds)

    def observe_generation(self, latencies):
        """A finished generation's Generation.latencies(), those it had."""
        with self.lock:
            for histogram, seconds in zip(self.generation, latencies):
                if seconds is not None:
                    histogram.observe(max(0.0, seconds))

    def add(self, name, amount=1):
        with self.lock:
            setattr(self, name, getattr(self, name) + amount)

    def observe_model(self, name, generated):
        with self.lock:
            requests, tokens = self.models.get(name, (0, 0))
            self.models[name] = (requests + 1, tokens + generated)

    def observe_masks(self, count, seconds):
        with self.lock:
            self.grammar_masks += count
            self.grammar_mask_seconds += seconds

    def observe_batch(self, size):
        with self.lock:
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def render(self, ready):
        with self.lock:
            lines = ["# HELP serve_requests_total HTTP requests by path and status.",
                     "# TYPE serve_requests_total counter"]
            lines += [f'serve_requests_total{{path="{p}",status="{s}"}} {n}'
                      for (p, s), n in sorted(self.requests.items())]
            lines += self.latency.render()
            for histogram in self.generation:
                lines += histogram.render()
            lines += ["# HELP serve_requests_running Generations decoding in the batch's rows now.",
                      "# TYPE serve_requests_running gauge", f"serve_requests_running {self.running()}",
                      "# HELP serve_prompt_tokens_total Prompt tokens of generation requests.",
                      "# TYPE serve_prompt_tokens_total counter", f"serve_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP serve_cached_prompt_tokens_total Prompt tokens whose KV came from the prefix cache.",
                      "# TYPE serve_cached_prompt_tokens_total counter",
                      f"serve_cached_prompt_tokens_total {self.cached_prompt_tokens}",
                      "# HELP serve_prefill_groups_total Dispatches that prefilled several prompts admitted "
                      "together.", "# TYPE serve_prefill_groups_total counter",
                      f"serve_prefill_groups_total {self.prefill_groups}",
                      "# HELP serve_batch_resizes_total Times the decode batch grew or shrank in place.",
                      "# TYPE serve_batch_resizes_total counter", f"serve_batch_resizes_total {self.batch_resizes}",
                      "# HELP serve_grouped_prompts_total Prompts prefilled in those dispatches.",
                      "# TYPE serve_grouped_prompts_total counter",
                      f"serve_grouped_prompts_total {self.grouped_prompts}",
                      "# HELP serve_grammar_masks_total Token masks computed for structured output (one per "
                      "constrained row and dispatch).",
                      "# TYPE serve_grammar_masks_total counter", f"serve_grammar_masks_total {self.grammar_masks}",
                      "# HELP serve_grammar_dropped_tokens_total Tokens a constrained row drew past a dispatch's "
                      "first without the mask and dropped, to draw again under it.",
                      "# TYPE serve_grammar_dropped_tokens_total counter",
                      f"serve_grammar_dropped_tokens_total {self.grammar_dropped}",
                      "# HELP serve_grammar_mask_seconds_total Host time spent computing them.",
                      "# TYPE serve_grammar_mask_seconds_total counter",
                      f"serve_grammar_mask_seconds_total {self.grammar_mask_seconds}",
                      "# HELP serve_prefix_cache_bytes Device memory of the prefix-cache pool.",
                      "# TYPE serve_prefix_cache_bytes gauge", f"serve_prefix_cache_bytes {self.prefix_bytes}",
                      "# HELP serve_prefix_cache_blocks Prefix-cache blocks, by whether they hold a prefix.",
                      "# TYPE serve_prefix_cache_blocks gauge",
                      f'serve_prefix_cache_blocks{{state="used"}} {self.prefix_used()}',
                      f'serve_prefix_cache_blocks{{state="free"}} {self.prefix_blocks - self.prefix_used()}',
                      "# TYPE serve_generated_tokens_total counter",
                      f"serve_generated_tokens_total {self.generated_tokens}",
                      "# HELP serve_queue_depth Requests waiting for the model worker.",
                      "# TYPE serve_queue_depth gauge", f"serve_queue_depth {self.queue_depth()}",
                      "# HELP serve_batches_total Decode batches by number of requests in them.",
                      "# TYPE serve_batches_total counter"]
            lines += [f'serve_batches_total{{size="{s}"}} {n}' for s, n in sorted(self.batch_sizes.items())]
            lines += ["# HELP serve_model_requests_total Generation requests by model (the base or an adapter).",
                      "# TYPE serve_model_requests_total counter"]
            lines += [f'serve_model_requests_total{{model="{label(m)}"}} {n}' for m, (n, _) in sorted(self.models.items())]
            lines += ["# HELP serve_model_generated_tokens_total Generated tokens by model (the base or an adapter).",
                      "# TYPE serve_model_generated_tokens_total counter"]
            lines += [f'serve_model_generated_tokens_total{{model="{label(m)}"}} {t}'
                      for m, (_, t) in sorted(self.models.items())]
            lines += ["# HELP serve_cancelled_total Generations stopped because their client went away.",
                      "# TYPE serve_cancelled_total counter", f"serve_cancelled_total {self.cancelled}",
                      "# HELP serve_open_connections Client connections open now.",
                      "# TYPE serve_open_connections gauge", f"serve_open_connections {self.open_connections()}",
                      "# HELP serve_refused_connections_total Connections answered 503 at --max-connections.",
                      "# TYPE serve_refused_connections_total counter",
                      f"serve_refused_connections_total {self.refused_connections}",
                      "# HELP serve_idle_closed_total Connections closed for idling or sending slower than "
                      "--idle-timeout.",
                      "# TYPE serve_idle_closed_total counter", f"serve_idle_closed_total {self.idle_closed}",
                      "# HELP serve_compilations_total XLA compilations in this process (flat after warm-up).",
                      "# TYPE serve_compilations_total counter", f"serve_compilations_total {self.compilations}",
                      "# HELP serve_request_compilations_total XLA compilations outside the warm-up (0: none ever "
                      "ran on a request's behalf).", "# TYPE serve_request_compilations_total counter",
                      f"serve_request_compilations_total {self.request_compilations}",
                      "# HELP serve_compile_cache_hits_total Programs loaded from the persistent compilation cache.",
                      "# TYPE serve_compile_cache_hits_total counter",
                      f"serve_compile_cache_hits_total {self.compile_cache_hits}",
                      "# HELP serve_warmup_pending_parts Warm-up parts still compiling in the background (batch "
                      "sizes, the prefix cache, grouped prefills); requests use only what is compiled.",
                      "# TYPE serve_warmup_pending_parts gauge", f"serve_warmup_pending_parts {self.warm_up_pending()}",
                      "# TYPE serve_ready gauge", f"serve_ready {int(ready)}",
                      "# HELP serve_process_resident_bytes This process's resident memory (RSS).",
                      "# TYPE serve_process_resident_bytes gauge", f"serve_process_resident_bytes {process_rss()}",
                      "# HELP serve_weight_bytes Bytes of model weights held on the device(s).",
                      "# TYPE serve_weight_bytes gauge", f"serve_weight_bytes {self.weight_bytes}"]
            if self.weights:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.weights.items()))
                lines += ["# HELP serve_model_info The served model's dtype and quantization.",
                          "# TYPE serve_model_info gauge", f"serve_model_info{{{labels}}} 1"]
        return "\n".join(lines + WORKER_CLOCK.render() + TIMELINE.render() + THREAD_CPU.render()) + "\n"


METRICS = Metrics()
# Where the model worker's time goes, and the device's (issue #48): the worker's wall time split into parts
# that add up to it, and each dispatch's device time learned from when its outputs are ready. Together they
# say which side is the wall under load: a device idle between a batch's dispatches waits for the host.
WORKER_PARTS = {
    "idle": "waiting for requests, no batch running",
    "admit": "admitting: prefill, pool and insert dispatches, row settings",
    "resize": "growing or shrinking the batch",
    "dispatch": "preparing and dispatching decode chunks",
    "read": "blocked on the device, reading a chunk's tokens",
    "settle": "handing each row its tokens: stops, text, log-probabilities, stream events",
    "grammar": "structured output's token masks",
    "other": "the loop's own bookkeeping: the queue, cancellations, batch sizes",
}
TIMED_PROGRAMS = ("decode", "decode_long", "prefill", "prefill_group")  # whose device time is learned
COUNTED_PROGRAMS = TIMED_PROGRAMS + ("insert", "pool_store", "pool_gather", "resize")


class PartClock:
    """One thread's wall time, part by part: every moment counts in exactly one of WORKER_PARTS (a part
    entered inside another pauses it), so the parts add up to the time since start(). Only the thread that
    started it is timed: the warm-up's and the tests' own calls of the same code are not."""

    def __init__(self):
        self.seconds = dict.fromkeys(WORKER_PARTS, 0.0)  # every key from the start: render() copies it unlocked
        # The thread's CPU time in each part: wall time less CPU time is waiting, on the device or for the GIL
        # (which the HTTP threads hold while they render and write what the worker hands them).
        self.cpu = dict.fromkeys(WORKER_PARTS, 0.0)
        self.current, self.since, self.cpu_since, self.owner = "other", None, None, None
        # A scrape reads a part's seconds, the current part and since when as one: read while the worker
        # switches, a part's seconds could come out lower than the scrape before.
        self.lock = threading.Lock()

    def start(self, part="other"):
        with self.lock:
            self.owner, self.current = threading.get_ident(), part
            self.since, self.cpu_since = time.perf_counter(), time.thread_time()

    def switch(self, part):
        """Enters `part`; returns the part it leaves (for the caller to go back to)."""
        if threading.get_ident() != self.owner:
            return part
        with self.lock:
            now, cpu = time.perf_counter(), time.thread_time()
            self.seconds[self.current] += now - self.since
            self.cpu[self.current] += cpu - self.cpu_since
            previous, self.current, self.since, self.cpu_since = self.current, part, now, cpu
        return previous

    @contextlib.contextmanager
    def part(self, name):
        previous = self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def totals(self):
        with self.lock:
            seconds, current, since = dict(self.seconds), self.current, self.since
            if since is not None:
                seconds[current] += time.perf_counter() - since
        return seconds

    def cpu_totals(self):
        with self.lock:
            return dict(self.cpu)

    def render(self):
        return ["# HELP serve_worker_seconds_total The model worker's wall time by what it did (" + "; ".join(
                f"{part}: {what}" for part, what in WORKER_PARTS.items()) + "); the parts add up to its time since "
                "it started.", "# TYPE serve_worker_seconds_total counter"] + [
            f'serve_worker_seconds_total{{part="{part}"}} {seconds:.6f}' for part, seconds in self.totals().items()] + [
            "# HELP serve_worker_cpu_seconds_total The model worker thread's CPU time by part (as above), up to its "
            "last change of part: the rest of a part's wall time it waited, on the device or for the GIL.",
            "# TYPE serve_worker_cpu_seconds_total counter"] + [
            f'serve_worker_cpu_seconds_total{{part="{part}"}} {seconds:.6f}' for part, seconds in self.cpu_totals().items()]


class DeviceTimeline:
    """The device's time, dispatch by dispatch, without a profiler: the worker hands each decode and prefill
    dispatch's outputs here, and a thread waits for them in dispatch order. A dispatch ran from when it was
    dispatched or the one before finished, whichever is later, to when its outputs are ready; a gap between
    the one before finishing and the next being dispatched, inside one batch's run, is the device idle while
    the host works. The copies that are not timed (inserts, pool writes, resizes: their outputs are donated
    to the next program) fall into the next timed dispatch. Prefills dispatched while other rows were
    decoding stall them by their whole device time (serve_prefill_stall_seconds_total)."""

    def __init__(self):
        self.queue = queue.Queue()
        self.busy, self.dispatches = dict.fromkeys(TIMED_PROGRAMS, 0.0), dict.fromkeys(COUNTED_PROGRAMS, 0)
        self.idle = self.stall = 0.0
        self.stalling = False  # set by the worker while it admits into a batch whose other rows are decoding
        self.run_id = 0  # bumped by the worker at each batch's start: the gaps between batches are no one's
        self.owner = None
        self.thread = None

    def start(self):
        self.owner = threading.get_ident()
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, daemon=True, name="device-timeline")
            self.thread.start()

    def new_run(self):
        self.run_id += 1

    def dispatched(self, program, outputs=None):
        """Counts a dispatch of the worker's, and times it on the device when `outputs` are given."""
        if threading.get_ident() != self.owner:
            return
        self.dispatches[program] += 1
        if outputs is not None:
            stalls = self.stalling and program.startswith("prefill")
            self.queue.put((program, time.perf_counter(), outputs, stalls, self.run_id))

    def run(self):
        import jax
        last_done, last_run = None, None
        while True:
            program, at, outputs, stalls, run = self.queue.get()
            try:
                jax.block_until_ready(outputs)
            except Exception:  # the worker learns of a failed dispatch when it reads it; here it just ends
                pass
            done = time.perf_counter()
            same_run = last_done is not None and run == last_run
            if same_run and at > last_done:
                self.idle += at - last_done
            began = max(at, last_done) if same_run else at
            self.busy[program] += done - began
            if stalls:
                self.stall += done - began
            last_done, last_run = done, run
            del outputs  # not held while waiting for the next dispatch: its buffers may go now

    def render(self):
        lines = ["# HELP serve_dispatches_total Programs the model worker dispatched to the device, by kind.",
                 "# TYPE serve_dispatches_total counter"]
        lines += [f'serve_dispatches_total{{program="{p}"}} {n}' for p, n in self.dispatches.items()]
        lines += ["# HELP serve_device_busy_seconds_total Device time of the worker's dispatches, by program (the "
                  "untimed copies before one are in it).", "# TYPE serve_device_busy_seconds_total counter"]
        lines += [f'serve_device_busy_seconds_total{{program="{p}"}} {s:.6f}' for p, s in self.busy.items()]
        return lines + [
            "# HELP serve_device_idle_seconds_total Time the device waited for the host between two dispatches of "
            "one batch: the host was the wall.", "# TYPE serve_device_idle_seconds_total counter",
            f"serve_device_idle_seconds_total {self.idle:.6f}",
            "# HELP serve_prefill_stall_seconds_total Device time of prefills dispatched while other rows were "
            "decoding: the decode time they stalled.", "# TYPE serve_prefill_stall_seconds_total counter",
            f"serve_prefill_stall_seconds_total {self.stall:.6f}"]


class ThreadCPU:
    """The process's CPU time by kind of thread, to tell whether the GIL is the wall (issue #48): Python's
    threads run Python one at a time, so when the model worker's and the HTTP threads' CPU together come near
    the wall time, the worker waits for the GIL and an HTTP front end in a process of its own would pay; well
    below it, it would not. A live thread's time is read from /proc/self/task (Linux: elsewhere none is
    given); an HTTP thread's is kept as it ends, since each connection has a thread of its own."""
    ROLES = {"worker": "the model worker",
             "http": "the threads that read requests and write answers, and the one that writes every stream",
             "python_other": "every other Python thread (the warm-up's, the device timeline, the reaper)",
             "native": "the rest: threads Python did not start (the XLA runtime's), and Python threads that came "
                       "and went between two readings"}

    def __init__(self):
        self.lock = threading.Lock()
        self.http = set()  # native ids of the HTTP threads running: each adds its whole time as it ends
        # HTTP threads that have ended their connection (and added their time) but not yet exited: not counted
        # again as another live thread, nor, once gone, as one that ended.
        self.retired = set()
        # Other threads' time as last read, and of those that ended, so that their time stays theirs (up to
        # their last reading): a counter that fell whenever the warm-up's threads ended would say nothing.
        self.seen, self.ended = {}, dict.fromkeys(("worker", "http", "python_other"), 0.0)
        # What render() last said per role: the threads' times are read in whole clock ticks and the native
        # rest is the process's time less them, so a reading can come out a tick lower than the one before.
        # Prometheus takes any fall as a counter's reset (a spike in rate()): a counter says no less than before.
        self.reported = dict.fromkeys(self.ROLES, 0.0)
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @contextlib.contextmanager
    def http_thread(self):
        tid = threading.get_native_id()
        with self.lock:
            self.http.add(tid)
        try:
            yield
        finally:
            with self.lock:
                self.http.discard(tid)
                self.retired.add(tid)
                self.ended["http"] += time.thread_time()

    def of_thread(self, tid):
        """A live thread's CPU seconds (0 if it has just ended): utime and stime, in clock ticks."""
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.tick

    def totals(self):
        """{role: CPU seconds}, or None where /proc cannot tell."""
        if not os.path.isdir("/proc/self/task"):
            return None
        seconds = dict.fromkeys(self.ROLES, 0.0)
        with self.lock:  # an HTTP thread that ends meanwhile waits, then counts once, as ended
            process = time.process_time()
            live = {}
            threads = threading.enumerate()
            self.retired &= {thread.native_id for thread in threads}  # gone: an id the OS may give again
            for thread in threads:
                tid = thread.native_id
                if tid in self.http:
                    seconds["http"] += self.of_thread(tid)
                    continue
                if tid in self.retired:
                    continue
                role = {"model-worker": "worker", "stream-writer": "http"}.get(thread.name, "python_other")
                live[thread] = role, self.of_thread(tid)
            for thread, (role, last) in self.seen.items():
                if thread not in live:
                    self.ended[role] += last
            self.seen = live
            for role, last in live.values():
                seconds[role] += last
            for role, ended in self.ended.items():
                seconds[role] += ended
            seconds["native"] = max(0.0, process - sum(seconds.values()))
            for role, value in seconds.items():
                seconds[role] = self.reported[role] = max(value, self.reported[role])
        return seconds

    def render(self):
        seconds = self.totals()
        if seconds is None:
            return []
        return ["# HELP serve_thread_cpu_seconds_total The process's CPU time by thread (" + "; ".join(
                f"{role}: {what}" for role, what in self.ROLES.items()) + "). The Python threads hold one GIL: "
                "worker and http together near the wall time say it is the wall.",
                "# TYPE serve_thread_cpu_seconds_total counter"] + [
            f'serve_thread_cpu_seconds_total{{role="{role}"}} {s:.6f}' for role, s in seconds.items()]


WORKER_CLOCK, TIMELINE, THREAD_CPU = PartClock(), DeviceTimeline(), ThreadCPU()


def label(value):
    """A Prometheus label value, escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
