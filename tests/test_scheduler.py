"""The scheduler: requests join the running batch at its next dispatch, the batch grows and shrinks in
place, and every admitted request is finished whatever fails."""
import threading
import time

import numpy as np
import pytest

import serve
from gemma_lora.adapters import read_adapter
from gemma_lora.engine.adapter_slots import AdapterSlots
from gemma_lora.engine.batch import DecodeBatch, ResizeFailed, RowSampling, resized_batch
from gemma_lora.engine.core import auto_batch_size, auto_max_queue, batch_buckets, fitting_batch_size
from gemma_lora.engine.engine import Engine
from gemma_lora.engine import worker as worker_module
from gemma_lora.engine.worker import Worker
from gemma_lora.frontend.api import health
from gemma_lora.frontend.server import RequestError, Server, ready_engine
from gemma_lora.interface import Generation, QueueFull, SAMPLER_DEFAULTS, WorkerGone, release_all
from gemma_lora.model import load_model

SEEDED = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}
GREEDY = SAMPLER_DEFAULTS["greedy"]
SYSTEM = list(range(500, 532))  # two full prefix blocks of 16: prompts that share it reuse its KV


@pytest.fixture(scope="module")
def engine(tiny_model, no_model, yes_model):
    """Batches of 1, 2 and 4 over the tiny model, two LoRA adapters and a prefix cache."""
    import jax
    model, _, shapes = load_model(serve.parse_args(["--model", str(tiny_model)]))
    vocabulary = model.preprocessor.tokenizer.get_vocabulary()
    slots = AdapterSlots(model.backbone, shapes, ["q_proj", "v_proj"], 2, 64, put=jax.device_put)
    for name, path in (("no", no_model), ("yes", yes_model)):
        slots.load(read_adapter(name, path, model.backbone, shapes, vocabulary))
    engine = Engine(model, [1, 2, 4], [64, 128], None, adapters=slots, prefix_blocks=32, block_tokens=16)
    engine.long_chunk_seconds = 0
    return engine


def generations(engine):
    """Five requests: greedy and seeded, with and without log-probabilities, on the base and on each
    adapter, two after a shared system prompt (prefix-cached once it has been seen)."""
    specs = [(GREEDY, 0, None, SYSTEM + [600, 601], 14), (SEEDED, 5, "yes", list(range(640, 660)), 11),
             (GREEDY, 0, "no", SYSTEM + [602, 603, 604], 9), (SEEDED, 8, None, list(range(700, 706)), 13),
             (GREEDY, 0, "yes", list(range(720, 745)), 7)]
    out = []
    for sampling, seed, adapter, ids, max_tokens in specs:
        g = Generation([engine.bos] + ids, max_tokens, sampling, seed, [], None, logprobs=2)
        if adapter is not None:
            g.adapter = engine.adapters.acquire(adapter)
            g.slot = g.adapter.slot
            g.releases.append(lambda a=g.adapter: engine.adapters.release(a))
        out.append(g)
    return out


def assert_same_answers(got, want):
    for g, w in zip(got, want):
        assert g.ids == w.ids and g.finish_reason == w.finish_reason
        assert [t for t, _, _ in g.token_logprobs] == [t for t, _, _ in w.token_logprobs]
        np.testing.assert_allclose([lp for _, lp, _ in g.token_logprobs], [lp for _, lp, _ in w.token_logprobs],
                                   atol=1e-4)


def held_nothing(engine):
    return not any(engine.prefix.holders) and not any(engine.adapters.refs[1:])


@pytest.mark.device
def test_a_batch_grown_and_shrunk_mid_generation_answers_as_one_of_its_final_size(engine):
    reference = generations(engine)
    engine.generate(reference, 4)  # the system prompt's blocks are in the pool from here
    assert held_nothing(engine)

    grown = generations(engine)
    batch = DecodeBatch(engine, 1)
    batch.admit(grown[0])
    batch.step()
    batch = resized_batch(batch, 2)  # one row busy mid-generation, one joins
    assert batch.size == 2 and batch.rows[0] is grown[0]
    batch.admit(grown[1])
    batch.step()
    batch = resized_batch(batch, 4)
    assert batch.size == 4 and batch.rows[:2] == grown[:2]
    batch.admit_all(grown[2:4])
    while batch.free_rows == 0:
        batch.step()
    batch.admit(grown[4])
    while True:  # read each chunk: dispatched ahead (GPU/TPU), a row may end in the one still in flight
        batch.settle()
        if batch.active <= 1:
            break
        batch.step()
    assert batch.active == 1
    last = next(g for g in batch.rows if g is not None)
    batch = resized_batch(batch, 1)  # the last one left finishes alone
    assert batch.size == 1 and batch.rows == [last]
    while batch.active:
        batch.step()
    assert grown[2].cached_tokens == 32 and all(g.done.is_set() for g in grown)
    assert_same_answers(grown, reference)
    assert held_nothing(engine)


def run_worker(engine, max_batch_size=4):
    worker = Worker(engine, max_batch_size, 0.0, 100)
    worker.start()
    return worker


def wait_idle(worker, timeout=60):
    deadline = time.time() + timeout
    while not worker.idle() and time.time() < deadline:
        time.sleep(0.01)
    return worker.idle()


@pytest.mark.device
def test_a_request_arriving_during_a_long_one_joins_at_the_next_dispatch(engine):
    worker = run_worker(engine)
    long = Generation([engine.bos] + list(range(800, 810)), 110, GREEDY, 0, [], None)
    short = Generation([engine.bos] + list(range(820, 830)), 6, GREEDY, 0, [], None)
    worker.submit([long])
    while len(long.ids) < 4:
        time.sleep(0.001)
    worker.submit([short])
    short.done.wait(60)
    assert short.finish_reason == "length" and long.finish_reason is None  # no convoy behind the long one
    long.done.wait(60)
    assert len(long.ids) == 110 and wait_idle(worker)


def failing_on_a_handed_on_row(monkeypatch):
    """DecodeBatch.settle raises, once, when reading a chunk one of whose rows was already handed to the
    next request: the chunk is then the only holder of the request that ended there. Returns the
    requests it held that way."""
    settle, orphans = DecodeBatch.settle, []

    def flaky(self, chunk=None):
        if chunk is not None and not orphans:
            orphans.extend(g for row, g in chunk[2] if self.rows[row] is not g)
            if orphans:
                raise RuntimeError("injected: reading the chunk failed")
        return settle(self, chunk)
    monkeypatch.setattr(DecodeBatch, "settle", flaky)
    return orphans


@pytest.mark.device
def test_a_chunk_that_fails_to_read_finishes_every_request_the_batch_took(engine, monkeypatch):
    """Dispatched ahead (forced on the CPU), a row whose request ends in the chunk in flight is refilled
    before that chunk is read: the failure must still finish that request and give back what it held."""
    monkeypatch.setattr(engine, "dispatch_ahead", True)
    orphans = failing_on_a_handed_on_row(monkeypatch)
    worker = run_worker(engine, max_batch_size=2)
    gens = generations(engine)
    for g in gens:
        g.max_tokens = 5  # rows end inside chunks and are handed on early
    worker.submit(gens)
    assert all(g.done.wait(60) for g in gens), [g.finish_reason for g in gens]
    assert orphans and all(g.finish_reason == "error" for g in orphans)
    assert wait_idle(worker) and held_nothing(engine)
    after = Generation([engine.bos, 900, 901], 3, GREEDY, 0, [], None)
    worker.submit([after])
    assert after.done.wait(60) and after.finish_reason == "length" and wait_idle(worker)


@pytest.mark.device
def test_a_failed_pool_store_leaves_a_fresh_pool_and_no_key_to_match(engine, monkeypatch):
    prompt = [engine.bos] + list(range(1000, 1040))

    def broken(pool, *args):
        raise RuntimeError("injected: the pool write failed")
    monkeypatch.setattr(engine.prefix, "store_program", broken)
    g = Generation(prompt, 2, GREEDY, 0, [], None)
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefills.row(g)
    release_all([g])
    monkeypatch.undo()
    assert engine.prefix.match(engine.prefills.keys(g)) == [] and engine.prefix.used() == 0
    import jax
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(engine.prefix.pool))
    first, again = (Generation(prompt, 4, GREEDY, 0, [], None) for _ in range(2))
    engine.generate([first], 1)
    engine.generate([again], 1)
    assert again.cached_tokens == 32 and again.ids == first.ids and held_nothing(engine)


def test_concurrent_submits_never_overshoot_the_queue_limit():
    class Stalled:  # a worker whose thread never runs: only submit() fills its queue
        pass
    worker = Worker(Stalled(), 4, 0.0, 10)
    worker.alive = lambda: True  # as if its thread were running
    start, refused = threading.Barrier(32), []

    def client():
        start.wait()
        try:
            worker.submit([object()])
        except QueueFull:
            refused.append(1)
    threads = [threading.Thread(target=client) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worker.depth() == 10 and len(refused) == 22


def test_the_default_queue_holds_a_full_batch_and_batch_sizes_go_up_by_fours_to_64():
    # A burst as large as the batch waits for rows instead of being turned away with 503s (issue #48: 128 and 256
    # clients against a 64-long queue retried 90 and 469 times on a TPU v5e, while rows stood empty).
    args = serve.parse_args(["--model", "x"])
    assert args.max_queue is None  # auto: decided with the batch size
    assert serve.parse_args(["--model", "x", "--max-queue", "12"]).max_queue == 12
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "x", "--max-queue", "many"])
    assert auto_max_queue(8) == 64 and auto_max_queue(256) == 512
    worker = Worker(object(), 256, 0.0, auto_max_queue(256))
    worker.alive = lambda: True  # as if its thread were running: only submit() fills its queue
    for _ in range(2):
        worker.submit([object()] * 256)
    with pytest.raises(QueueFull):
        worker.submit([object()])
    # A CPU's batch (8) still doubles; above 16, 1, 4, 16, 64 (a step costs the weights' read there), then
    # doubling (a step's cost grows with the rows); every size a multiple of the data-parallel batch axis.
    assert batch_buckets(8, 1) == [1, 2, 4, 8] and batch_buckets(16, 1) == [1, 2, 4, 8, 16]
    assert batch_buckets(64, 1) == [1, 4, 16, 64]
    assert batch_buckets(256, 1) == [1, 4, 16, 64, 128, 256]
    assert batch_buckets(100, 1) == [1, 4, 16, 64, 100]
    assert batch_buckets(256, 8) == [8, 16, 64, 128, 256]
    assert batch_buckets(64, 1, sizes=[1, 8, 64]) == [1, 8, 64]


# ----------------------------------------------------------------------------- the server

def test_a_sigterm_during_warm_up_exits_cleanly(trained_model, start_server):
    server = start_server(trained_model, "--batch-sizes", "1,2,4,8", wait=False)
    deadline = time.time() + 120
    while "warm-up" not in server.output() and "model:" not in server.output() and time.time() < deadline:
        time.sleep(0.05)
    server.process.terminate()
    assert server.exit_code() == 0
    output = server.output()
    assert "stopped" in output and "ready on" not in output and "Traceback" not in output


def test_health_is_503_once_the_worker_thread_is_gone():
    class Gone:  # the engine's interface, its worker thread gone
        def alive(self):
            return False

        def compiling(self):
            return []
    state = Server(serve.parse_args(["--model", "x"]))
    state.state, state.core = "ready", Gone()
    reply = health(state, None)
    assert reply.status == 503 and reply.payload == {"status": "failed"}
    with pytest.raises(RequestError) as refused:
        ready_engine(state)
    assert refused.value.status == 503


def test_max_batch_size_auto_fills_the_device_memory_left_and_keeps_8_on_a_cpu(engine):
    gib, mib = 2**30, 2**20
    # Gemma 2B in bfloat16 on one TPU v5e (15.7 GiB): ~10.5 GiB left after the weights and the pool. A row's
    # KV cache is 18 layers x K and V x 256 dims x 2 bytes a position; the vocabulary 256,000.
    row_256, row_8192 = 18 * 2 * 256 * 2 * 256, 18 * 2 * 256 * 2 * 8192
    assert fitting_batch_size(10.5 * gib, row_256, 256_000) == (256, pytest.approx(
        1.5 * 512 * row_256 + 24 * 512 * 256_000))  # capped
    size, need = fitting_batch_size(10.5 * gib, row_8192, 256_000)
    assert size == 32 and need > 0.85 * 10.5 * gib  # 64 rows of 8,192 positions would not fit
    assert fitting_batch_size(100 * mib, row_8192, 256_000)[0] == 1  # never less than one row
    sizes = [fitting_batch_size(free * gib, row_8192, 256_000)[0] for free in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert sizes == sorted(sizes) and sizes[-1] == 256
    args = serve.parse_args(["--model", "x"])
    assert args.max_batch_size is None  # auto: decided on the device
    assert auto_batch_size(engine.model, args) == 8  # a CPU


@pytest.mark.device
def test_a_failed_growth_leaves_the_newcomers_waiting_for_rows_and_the_running_rows_go_on(engine, monkeypatch):
    """The batch cannot be copied into a larger one (the device out of memory, say): the one already decoding
    ends as it would have alone, and the requests that were waiting for the larger batch's rows wait for rows
    to free, as a full batch's do, and answer then (issue #63: they failed at once); nothing is held. A larger
    batch is tried again a while later, not at every step."""
    # Long enough to be decoding still when the newcomers come (with 40 tokens it could end first, and a
    # newcomer then took its row without a growth: seen when the suite's programs came from a compile cache).
    alone = Generation([engine.bos] + list(range(860, 870)), 100, GREEDY, 0, [], None)
    engine.generate([alone], 1)
    expected = [Generation([engine.bos] + list(range(880 + i, 890 + i)), 5, GREEDY, 0, [], None) for i in range(3)]
    for g in expected:
        engine.generate([g], 1)
    worker = run_worker(engine)
    monkeypatch.setattr(worker_module, "GROWTH_RETRY_SECONDS", 600)  # however slow the machine, no second try
    long = Generation([engine.bos] + list(range(860, 870)), 100, GREEDY, 0, [], None)
    tried = []

    def broken(*args):
        tried.append(time.time())
        raise RuntimeError("injected: no memory for a larger batch")
    monkeypatch.setitem(engine.programs[1].resize, 2, broken)
    worker.submit([long])
    while len(long.ids) < 4:
        time.sleep(0.001)
    newcomers = [Generation([engine.bos] + list(range(880 + i, 890 + i)), 5, GREEDY, 0, [], None)
                 for i in range(3)]
    worker.submit(newcomers)
    assert all(g.done.wait(60) for g in newcomers + [long])
    assert long.finish_reason == "length" and long.ids == alone.ids
    assert [(g.finish_reason, g.ids) for g in newcomers] == [("length", g.ids) for g in expected]
    assert len(tried) == 1  # one try while the long one decoded; the next only GROWTH_RETRY_SECONDS later
    assert wait_idle(worker) and worker.depth() == 0 and held_nothing(engine)
    monkeypatch.undo()  # the batch grows again once it can
    worker.grow_after = 0.0
    later = [Generation([engine.bos] + list(range(900 + i, 910 + i)), 5, GREEDY, 0, [], None) for i in range(3)]
    worker.submit(later)
    assert all(g.done.wait(60) and g.finish_reason == "length" for g in later) and wait_idle(worker)


@pytest.mark.device
def test_a_growth_holds_the_old_cache_and_one_new_one_and_a_failed_copy_leaves_the_batch_whole(engine, monkeypatch):
    """Growing copies the rows' caches into the larger batch's cache and makes no other (issue #63: a fresh
    zeroed cache was made first, then the copy: the old cache and two new ones at the peak). A copy that fails
    after the cache's (taking a row's settings, say) leaves the old batch whole: it decodes on to the end."""
    reference = Generation([engine.bos] + list(range(300, 310)), 12, GREEDY, 0, [], None)
    engine.generate([reference], 1)
    made = []
    for size in (2, 4):
        programs = engine.programs[size]
        monkeypatch.setitem(engine.programs, size, programs._replace(
            new_cache=lambda made_by=programs.new_cache, size=size: made.append(size) or made_by()))
    g = Generation([engine.bos] + list(range(300, 310)), 12, GREEDY, 0, [], None)
    batch = DecodeBatch(engine, 1)
    batch.admit(g)
    batch.step()
    batch = resized_batch(batch, 4)
    assert batch.size == 4 and made == []  # 1 -> 2 -> 4: each step a copy, no new cache besides
    while batch.active:
        batch.step()
    assert g.ids == reference.ids
    monkeypatch.undo()

    def broken_take(self, other, rows):
        raise RuntimeError("injected: the copy fails after the cache's")
    g = Generation([engine.bos] + list(range(300, 310)), 12, GREEDY, 0, [], None)
    batch = DecodeBatch(engine, 1)
    batch.admit(g)
    batch.step()
    monkeypatch.setattr(RowSampling, "take", broken_take)
    with pytest.raises(ResizeFailed) as failed:
        resized_batch(batch, 2)
    assert failed.value.batch is batch and batch.cache is not None
    monkeypatch.undo()
    while batch.active:
        batch.step()
    assert g.finish_reason == "length" and g.ids == reference.ids


def test_a_submit_racing_the_worker_s_exit_is_refused_not_lost():
    """The worker thread dies (a bug, say). A submit that comes while it runs its last collect must either be
    collected and failed there or refused at once: never queued where nothing reads it (its handler would
    wait forever, and shutdown its whole timeout)."""
    class Dying:
        pass
    worker = Worker(Dying(), 4, 0.0, 10)
    queued = Generation([2, 3], 2, GREEDY, 0, [], None)
    raced = Generation([2, 4], 2, GREEDY, 0, [], None)
    outcome, collect = [], worker.collect

    def racing_collect():
        if worker.stopped and not outcome:  # the exit's last collect: another thread submits right now
            def submit():
                try:
                    worker.submit([raced])
                    outcome.append("queued")
                except WorkerGone:
                    outcome.append("refused")
            racer = threading.Thread(target=submit)
            racer.start()
            racer.join(0.3)  # it must wait for the lock, or it has been queued behind this collect's back
            outcome.append("blocked" if racer.is_alive() else "passed")
        return collect()

    def run_batch():
        worker.waiting.append(worker.queue.get())
        raise RuntimeError("injected: the worker's loop broke")
    worker.collect, worker.run_batch = racing_collect, run_batch
    worker.start()
    worker.submit([queued])
    worker.thread.join(10)
    deadline = time.time() + 10
    while len(outcome) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert outcome == ["blocked", "refused"]
    assert queued.done.is_set() and queued.finish_reason == "error"
    assert not worker.alive() and worker.depth() == 0
    with pytest.raises(WorkerGone):
        worker.submit([Generation([2, 5], 2, GREEDY, 0, [], None)])
