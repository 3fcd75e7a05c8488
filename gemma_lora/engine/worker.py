"""The model worker: one thread owns the model; requests queue here and take rows of its decode batch as
they free (continuous batching)."""
import collections
import queue
import threading
import time

from gemma_lora.engine.batch import DecodeBatch, ResizeFailed, resized_batch
from gemma_lora.interface import QueueFull, WorkerGone
from gemma_lora.log import log
from gemma_lora.metrics import METRICS, TIMELINE, WORKER_CLOCK


# After a batch failed to grow (the device out of memory for the larger cache, say), how long its waiting requests
# take rows as they free before a larger batch is tried again.
GROWTH_RETRY_SECONDS = 5.0


class Worker:
    """One thread owns the model. Requests queue here and take rows of the decode batch at its next
    dispatch. When more wait than it has free rows, the batch grows in place to the size that holds
    them (resized(): its rows' caches copied by a program compiled at warm-up, nothing drained); when
    few rows are left busy, it shrinks the same way, so a long request alone decodes in a small batch."""

    def __init__(self, engine, max_batch_size, window_seconds, max_queue):
        self.engine, self.max_batch_size, self.window = engine, max_batch_size, window_seconds
        self.queue = queue.Queue()  # from the HTTP threads
        self.waiting = collections.deque()  # the worker's own, in arrival order
        self.max_queue = max_queue
        self.lock = threading.Lock()  # submit's check and put, as one; and the worker's last collect, as one
        self.stopped = False  # set, under the lock, by a worker that is exiting: submit refuses from then on
        self.busy = 0
        self.batch = None  # the DecodeBatch running, if any
        self.grow_after = 0.0  # no growth is tried before this time (set when one failed)
        self.thread = None
        METRICS.queue_depth = self.depth
        METRICS.running = self.running

    def running(self):
        batch = self.batch  # read once: the worker drops it when a batch's run ends
        return 0 if batch is None else batch.active

    def start(self):
        self.thread = threading.Thread(target=self.run, daemon=True, name="model-worker")
        self.thread.start()

    def alive(self):
        return self.thread is not None and self.thread.is_alive() and not self.stopped

    def depth(self):
        return self.queue.qsize() + len(self.waiting)

    def submit(self, generations):
        with self.lock:  # concurrent handlers must not both pass the check and overshoot --max-queue
            if not self.alive():
                raise WorkerGone()
            if self.depth() + len(generations) > self.max_queue:
                raise QueueFull()
            for g in generations:
                self.queue.put(g)

    def idle(self):
        return not self.depth() and not self.busy

    def collect(self):
        """Moves what has queued meanwhile to `waiting`."""
        while True:
            try:
                self.waiting.append(self.queue.get_nowait())
            except queue.Empty:
                return

    def run(self):
        WORKER_CLOCK.start()
        TIMELINE.start()
        try:
            while True:
                self.run_batch()
        except BaseException as e:  # the worker is gone: /health says so, and nothing may wait on it
            log(f"error: the model worker stopped: {type(e).__name__}: {e}")
            with self.lock:  # a submit either lands before this last collect or is refused after it
                self.stopped = True
                self.collect()
            while self.waiting:
                self.waiting.popleft().finish("error")
            raise

    def run_batch(self):
        if not self.waiting:
            with WORKER_CLOCK.part("idle"):
                self.waiting.append(self.queue.get())
                # A short window lets a burst of requests start together in a batch of the right size.
                deadline = time.time() + self.window
                while len(self.waiting) < self.max_batch_size and time.time() < deadline:
                    try:
                        self.waiting.append(self.queue.get(timeout=max(0.0, deadline - time.time())))
                    except queue.Empty:
                        break
        TIMELINE.new_run()
        self.busy = 1
        first = list(self.waiting)[:self.max_batch_size]
        size = self.engine.batch_for(len(first))
        try:
            self.batch = DecodeBatch(self.engine, size)
            self.decode()
        except Exception as e:  # never let one bad batch kill the worker
            log(f"error: batch of {self.batch.size if self.batch else size} failed: {type(e).__name__}: {e}")
            if self.batch is not None:
                self.batch.fail("error")
            else:  # the batch could not even be set up: fail those it was for, not the whole line
                for g in first:
                    self.waiting.remove(g)
                    g.finish("error")
        except BaseException:  # the thread itself is ending (run() says why): its rows end with it
            if self.batch is not None:
                self.batch.fail("error")
            raise
        finally:
            self.batch, self.busy = None, 0

    def target_size(self):
        """The batch size for the rows held (past the pending chunk) and those waiting; None to keep it.
        Shrinking waits until a quarter of the rows or fewer are wanted: a row that frees and refills must
        not resize the batch each time."""
        batch = self.batch
        target = min(self.engine.batch_for(batch.size - batch.free_rows + len(self.waiting)), self.max_batch_size)
        if target > batch.size and time.time() < self.grow_after:  # a growth failed a moment ago
            return None
        if target > batch.size or target * 4 <= batch.size:
            return target
        return None

    def resize(self, target):
        """The batch grown or shrunk to `target` rows. If the copy fails (the device out of memory for a larger
        cache, say), the rows already running go on in the batch they had, and the requests waiting for the rows
        it would have made wait for rows to free, as a full batch's do; it is tried again GROWTH_RETRY_SECONDS
        later, not at every step."""
        self.batch.settle()  # a chunk that cannot be read is the whole batch's failure, as anywhere else
        try:
            self.batch = resized_batch(self.batch, target)
        except ResizeFailed as e:
            self.batch = e.batch
            self.grow_after = time.time() + GROWTH_RETRY_SECONDS
            log(f"error: the batch could not be resized to {target} rows: {type(e.__cause__).__name__}: "
                f"{e.__cause__}; the {self.batch.active} running go on, {len(self.waiting)} waiting take rows as "
                f"they free (a larger batch is tried again in {GROWTH_RETRY_SECONDS:g}s)")

    def decode(self):
        while True:
            self.collect()
            for g in [g for g in self.waiting if g.cancelled]:
                self.waiting.remove(g)
                g.finish("cancelled")
            self.batch.release_cancelled()
            if not self.batch.active and self.batch.size > self.engine.batch_for(len(self.waiting)):
                return  # emptied (its clients left): what waits now gets a batch of its own size
            target = self.target_size()
            if target is not None:
                with WORKER_CLOCK.part("resize"):
                    self.resize(target)
            if self.waiting and self.batch.free_rows:
                with WORKER_CLOCK.part("admit"):
                    self.batch.admit_all([self.waiting.popleft()
                                          for _ in range(min(self.batch.free_rows, len(self.waiting)))])
            if not self.batch.active:
                return
            METRICS.observe_batch(self.batch.active)
            self.collect()
            self.batch.step(quiet=not self.waiting)
