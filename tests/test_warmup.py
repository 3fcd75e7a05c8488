"""The warm-up (issue #33): programs compiled on a thread pool; the server answers once the smallest
batch's programs exist and compiles the rest in the background, each part taking effect only when it is
compiled, so nothing ever compiles on a request's behalf; a restart loads its programs from the
program store (or XLA's compilation cache), and a changed flag does not load a stale program."""
import functools
import os
import re
import shutil
import threading
import time
import types

import numpy as np
import pytest

import serve
from conftest import REPO, http
from gemma_lora.engine.compilation import ProgramStore, count_compilation, on_compilation
from gemma_lora.engine.engine import Engine
from gemma_lora.engine.programs import cache_shapes, prompt_cache
from gemma_lora.engine.warmup import WarmUp
from gemma_lora.engine.worker import Worker
from gemma_lora.interface import Generation, SAMPLER_DEFAULTS
from gemma_lora.memory import MemoryLog, locked_bytes
from gemma_lora.metrics import METRICS
from gemma_lora.model import load_model

GREEDY = SAMPLER_DEFAULTS["greedy"]
SEEDED = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}
SYSTEM = list(range(500, 532))  # two full prefix blocks of 16


@pytest.fixture(scope="module")
def model(tiny_model):
    on_compilation(count_compilation)  # METRICS.request_compilations: those of no warm-up thread
    return load_model(serve.parse_args(["--model", str(tiny_model)]))[0]


@pytest.fixture(scope="module")
def warmed(model, tmp_path_factory):
    """One full warm-up (on two threads, its programs stored) and the answers its engine gives, shared by the
    tests that read what a finished warm-up left: each full warm-up of this engine's shapes costs 35-40 s on
    this CPU and about 25 s on a TPU v5e (issue #49: the device selection in one run). What the warm-up compiled, by
    thread, is kept from before any test's requests."""
    compiled = []
    on_compilation(lambda: compiled.append(threading.current_thread().name))
    engine = make_engine(model)
    root = tmp_path_factory.mktemp("program-store")
    warm_up = WarmUp(engine, threads=2, store=ProgramStore(root, engine))
    warm_up.run()
    threads = list(compiled)
    want = generations(engine)
    engine.generate(want, 4)
    return types.SimpleNamespace(engine=engine, warm_up=warm_up, threads=threads, store=root, want=want)


def make_engine(model):
    engine = Engine(model, [1, 2, 4], [64, 128], None, prefix_blocks=32, block_tokens=16, dispatch_ahead=True)
    engine.long_chunk_seconds = 0
    return engine


def generations(engine, offset=0):
    """Six requests of every shape: greedy and seeded, short and long prompts, two after a shared system
    prompt (the second reuses its blocks once the prefix cache is on)."""
    specs = [(GREEDY, 0, SYSTEM + [600, 601], 12), (SEEDED, 5, list(range(640, 660)), 9),
             (GREEDY, 0, SYSTEM + [602, 603, 604], 7), (SEEDED, 8, list(range(700, 706)), 11),
             (GREEDY, 0, list(range(720, 800)), 6), (GREEDY, 0, [810, 811], 10)]
    return [Generation([engine.bos] + [t + offset for t in ids], max_tokens, sampling, seed, [], None,
                       logprobs=2) for sampling, seed, ids, max_tokens in specs]


def answers(gens):
    return [(g.ids, g.finish_reason) for g in gens]


def run_worker(engine, gens, waves=1):
    """Serves `gens` through a Worker, in `waves` submissions as the previous finish; returns the worker."""
    worker = Worker(engine, engine.batch_buckets[-1], 0.0, 100)
    worker.start()
    for wave in np.array_split(np.arange(len(gens)), waves):
        worker.submit([gens[i] for i in wave])
        for i in wave:
            assert gens[i].done.wait(120)
    return worker


@pytest.mark.device
def test_requests_are_served_by_compiled_programs_while_the_rest_compiles(model, warmed):
    want = warmed.want
    engine = make_engine(model)
    warm_up = WarmUp(engine, threads=2)
    warm_up.first()
    assert engine.ready_batches == [1] and engine.prefix is None and not engine.grouping and not engine.chunked
    assert warm_up.pending == ["chunks batch 1", "batch 2", "batch 4", "prefix cache", "grouped prefills"]
    # Only one-token decodes exist yet: the smallest batch's multi-token ones (the slowest to compile) come first
    # in the background.
    assert not any("chunk 4" in name or "long" in name for name, _, _ in warm_up.compiled)
    assert engine.batch_for(4) == 1
    requests_compiled = METRICS.request_compilations

    background = threading.Thread(target=warm_up.rest, name="warm-up-rest")
    background.start()
    early = generations(engine)
    worker = run_worker(engine, early, waves=3)  # served while the rest compiles
    background.join(300)
    assert not background.is_alive() and warm_up.pending == []
    assert engine.ready_batches == [1, 2, 4] and engine.prefix is not None and engine.grouping and engine.chunked
    late = generations(engine)
    worker.submit(late)  # all at once: grouped prefills, a grown batch, the system prompt's blocks reused
    for g in late:
        assert g.done.wait(120)

    assert METRICS.request_compilations == requests_compiled  # nothing compiled on a request's behalf
    assert late[2].cached_tokens == 32
    for got in (early, late):  # the same answers as after a full warm-up, in whatever batch
        assert answers(got) == answers(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose([lp for _, lp, _ in g.token_logprobs], [lp for _, lp, _ in w.token_logprobs],
                                       atol=1e-4)


@pytest.mark.device
def test_a_parallel_warm_up_compiles_what_the_serial_one_runs(model, warmed):
    engine, warm_up, compiled = warmed.engine, warmed.warm_up, warmed.threads
    # The passes that run each of the smallest batch's programs once compile nothing new: every
    # program was compiled ahead, with the very arguments its caller passes.
    names = {name for name, _, _ in warm_up.compiled}
    assert {"decode batch 2 window 64 chunk 4", "decode batch 4 window 128 chunk 1", "next tokens batch 2",
            "resize batch 1 to 2", "resize batch 4 to 2", "prefill 2 prompts block 16",
            "prefill block 16 in window 64", "prefill block 16 in window 128", "empty row window 64"} <= names
    # A lone prompt is prefilled in a window's row, from an empty one or after a cached prefix: one program per
    # (block, window) for both, none of a block's own length (issue #35).
    assert {name for name in names if name.startswith("prefill block ")} == {
        f"prefill block {block} in window {window}" for window in (64, 128) for block in engine.prompt_blocks
        if block <= window - 16 or block == window}
    # Where the smallest batch has long decodes and chunks are not dispatched ahead, the long decode makes its
    # chunks of DECODE_CHUNK tokens too: no program of its own for those.
    assert ("decode batch 1 window 64 chunk 4" in names) != engine.long_makes_chunks(1)
    assert ("decode batch 1 window 64 long" in names) == (engine.programs[1].decode_long is not None)
    # Groups of prompts in the blocks where each size pays: on a CPU a pair in blocks of 16 only.
    assert {name for name in names if " prompts block " in name} == {
        f"prefill {size} prompts block {block}" for block, sizes in engine.group_blocks.items() for size in sizes}
    import jax
    if jax.default_backend() == "cpu":
        assert engine.group_blocks == {16: [2, 4], 32: [4], 64: [4]}
    chunks_by_long = Engine(model, [1, 2], [64], None, dispatch_ahead=False)
    assert chunks_by_long.long_makes_chunks(1) == (chunks_by_long.programs[1].decode_long is not None)
    assert not chunks_by_long.long_makes_chunks(2) and not engine.long_makes_chunks(1)  # engine dispatches ahead
    assert all(name.startswith("warm-up") for name in compiled[:len(warm_up.compiled)])
    assert len([n for n in compiled if not n.startswith("warm-up")]) <= 1  # at most the slot write
    compiled = []
    on_compilation(lambda: compiled.append(threading.current_thread().name))
    engine.generate(generations(engine, offset=3), 4)
    engine.generate(generations(engine, offset=3), 1)
    assert compiled == []


def test_long_decodes_are_built_on_a_cpu_only_and_in_the_smallest_batch(model, monkeypatch):
    import jax
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    cpu = Engine(model, [1, 2], [64], None)
    assert cpu.programs[1].decode_long is not None and cpu.programs[2].decode_long is None
    # Off a CPU, dispatching ahead hides what they save (a TPU v5e: 143 tok/s without, 140 with).
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    accelerator = Engine(model, [1, 2], [64], None)
    assert accelerator.dispatch_ahead and all(p.decode_long is None for p in accelerator.programs.values())
    assert accelerator.programs[1].decode is not None


@pytest.mark.device
def test_a_restart_loads_every_program_from_the_store_and_answers_the_same(model, warmed, tmp_path):
    compiled = []
    on_compilation(lambda: compiled.append(threading.current_thread().name))
    build, want = warmed.warm_up, warmed.want
    assert build.build.store.dir.parent == warmed.store
    stored = sorted(f.name for f in build.build.store.dir.iterdir())
    assert len(stored) == len(build.compiled) > 40 and "decode-batch-4-window-128-chunk-4.xla" in stored
    root = shutil.copytree(warmed.store, tmp_path / "store")  # this test's own copy: it tears a file
    folder = root / build.build.store.dir.name

    # A torn file (a crash mid-write cannot make one: files are renamed into place whole) is removed and its
    # program compiled anew; everything else loads, untraced: the jits' own caches stay empty.
    (folder / "decode-batch-2-window-64-chunk-1.xla").write_bytes(b"not a program")
    engine = make_engine(model)
    before = len(compiled)
    warm_up = WarmUp(engine, threads=2, store=ProgramStore(root, engine))
    warm_up.run()
    assert [name for name, _, _ in warm_up.compiled] == ["decode batch 2 window 64 chunk 1"]
    assert len(warm_up.build.loaded) == len(stored) - 1 and len(compiled) - before == 1
    assert engine.programs[4].decode.jitted._cache_size() == 0 and len(engine.programs[4].decode.loaded) == 4
    got = generations(engine)
    engine.generate(got, 4)
    engine.generate(generations(engine, offset=3), 1)
    assert len(compiled) - before == 1  # nothing more compiled on the requests' behalf
    assert answers(got) == answers(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose([lp for _, lp, _ in g.token_logprobs], [lp for _, lp, _ in w.token_logprobs],
                                   atol=1e-5)

    # Another shape of engine (batch sizes, prefix cache) is another folder: nothing stale is loaded.
    other = Engine(model, [1, 2], [64, 128], None, dispatch_ahead=True)
    assert ProgramStore(root, other).dir != folder


def test_cache_shapes_are_derived_from_one_traced_template(model):
    import jax
    import jax.numpy as jnp
    for batch, length in [(1, 8), (3, 200), (8, 4096)]:
        traced = jax.eval_shape(functools.partial(prompt_cache, model), jax.ShapeDtypeStruct((batch, length),
                                                                                             jnp.int32))
        derived = cache_shapes(model, batch, length)
        assert jax.tree.structure(derived) == jax.tree.structure(traced)
        assert [(d.shape, d.dtype) for d in jax.tree.leaves(derived)] == [
            (t.shape, t.dtype) for t in jax.tree.leaves(traced)]


def test_the_program_store_s_folder_changes_with_any_engine_module_s_text(tmp_path):
    """The stored programs are keyed by the code that traced them: a change to any module of the package (or to
    serve.py) makes another folder, whichever module it is in, so a restart after an upgrade never loads a
    program of the old code. The package's text spread over modules must not hide it (issue #58)."""
    from gemma_lora.engine.compilation import source_hash
    shutil.copytree(REPO / "gemma_lora", tmp_path / "gemma_lora", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "serve.py", tmp_path / "serve.py")
    package = tmp_path / "gemma_lora"
    assert source_hash(package) == source_hash()
    seen = {source_hash(package)}
    for changed in ("engine/programs.py", "engine/batch.py", "interface.py", "model.py"):
        with open(package / changed, "a") as f:
            f.write("\n# changed\n")
        seen.add(source_hash(package))
    (tmp_path / "serve.py").write_text((tmp_path / "serve.py").read_text() + "\n# changed\n")
    seen.add(source_hash(package))
    assert len(seen) == 6
    (package / "notes.txt").write_text("not code")
    assert source_hash(package) in seen


def test_health_lists_what_is_still_compiling_and_restarts_load_from_the_cache(tiny_model, tmp_path, start_server):
    cache = str(tmp_path / "xla")
    flags = ["--max-batch-size", "4", "--length-buckets", "64,128"]
    first = start_server(tiny_model, *flags, cache=cache, wait=False).wait_ready(complete=False)
    status, body, _ = serve_health(first)
    compiling = body.get("compiling", [])
    reply = post(first, {"prompt": "The river", "max_tokens": 6, "temperature": 0})
    first.wait_ready()
    assert first.metric("serve_request_compilations_total") == 0
    assert serve_health(first)[1] == {"status": "ok"} and first.metric("serve_warmup_pending_parts") == 0
    first_compiled = first.metric("serve_compilations_total")
    check_memory_table(first)
    first.stop()
    assert status == 200 and compiling, "the tiny model's background warm-up takes seconds: it was still listed"
    # On a CPU batch 1's long decode, compiled before the server is ready, makes its chunks: nothing of
    # batch 1 is left to compile, and it never decodes a token a step.
    assert set(compiling) <= {"batch 2", "batch 4", "prefix cache", "grouped prefills"}
    assert "a token a step for now" not in first.output()
    assert reply[0] == 200 and reply[1]["usage"]["completion_tokens"] == 6

    again = start_server(tiny_model, *flags, cache=cache)
    # A restart with the same flags loads every warm-up program from the program store, untraced; what
    # compiles at all (loading's own eager steps) comes from XLA's cache.
    assert again.metric("serve_compilations_total") == again.metric("serve_compile_cache_hits_total")
    assert again.metric("serve_compilations_total") < 0.5 * first_compiled
    assert post(again, {"prompt": "The river", "max_tokens": 6, "temperature": 0})[1][
        "choices"][0]["text"] == reply[1]["choices"][0]["text"]
    counts = re.findall(r"warm-up: .*?(\d+) programs (loaded from the program store|compiled)", again.output())
    assert counts and all(how == "loaded from the program store" for _, how in counts)
    assert re.search(r"program store: loading the \d+ programs the last start needed to be ready", again.output())
    assert f"{len(list((tmp_path / 'xla' / 'programs').glob('*/*.xla')))} programs loaded" in again.output()
    again.stop()

    changed = start_server(tiny_model, *flags, "--enable-lora", "--max-adapters", "2", cache=cache)
    # Adapter slots change every program that runs the model (decode, prefills): those are compiled anew
    # (32 of 70 here); the copies and pool moves are the same programs as before, and come from XLA's cache.
    # Nothing comes from the program store: the changed flags make another folder of it.
    hits, compiled = changed.metric("serve_compile_cache_hits_total"), changed.metric("serve_compilations_total")
    assert compiled - hits >= 0.3 * first_compiled and hits > 0
    assert "loaded from the program store" not in changed.output()
    assert len([d for d in (tmp_path / "xla" / "programs").iterdir() if d.is_dir()]) == 2
    # The base through the new programs (no adapter loaded): the same answer.
    assert post(changed, {"prompt": "The river", "max_tokens": 6, "temperature": 0})[1][
        "choices"][0]["text"] == reply[1]["choices"][0]["text"]
    changed.stop()


def serve_health(server):
    return http("GET", server.url + "/health")


def post(server, body):
    return http("POST", server.url + "/v1/completions", body)


def check_memory_table(server):
    """The start-up's memory table (issue #35): its stages add up to the RSS it reports, which is the
    process's, as /metrics' is; the device's holdings are listed by name."""
    import re
    from pathlib import Path
    deadline = time.time() + 30  # logged just after the last part takes effect
    while "memory: held" not in server.output() and time.time() < deadline:
        time.sleep(0.2)
    line = next(l for l in server.output().splitlines() if "memory: RSS" in l)
    total, parts = re.match(r".*memory: RSS ([\d,]+) MiB = (.*)$", line).groups()
    numbers = re.findall(r"(?:^|([+-]) )[a-z ()-]+? ([\d,]+)(?= [+-] |$)", parts)
    added = sum((-1 if sign == "-" else 1) * int(n.replace(",", "")) for sign, n in numbers)
    assert len(numbers) >= 6 and abs(added - int(total.replace(",", ""))) <= len(numbers)  # rounding
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{server.process.pid}/status").read_text()).group(1)) / 1024
    assert abs(int(total.replace(",", "")) - rss) <= 0.1 * rss
    assert abs(server.metric("serve_process_resident_bytes") / 2**20 - rss) <= 0.1 * rss
    held = next(l for l in server.output().splitlines() if "memory: held for the model" in l)
    assert "weights" in held and "KV cache batch 4" in held and "prefix pool" in held


def test_the_memory_table_says_apart_what_is_locked_in_host_memory():
    # A TPU runtime pins a host buffer for its transfers at its start (issue #49 item 3): 4 MiB locked here
    # stands for it.
    import ctypes
    import mmap
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    size, area = 4 << 20, mmap.mmap(-1, 4 << 20)
    address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(area)))
    log, before = MemoryLog(), locked_bytes()
    log.stage("imports")
    assert (before == 0) == (len(log.lines()) == 2)  # the third line only when something is locked
    assert libc.mlock(address, ctypes.c_size_t(size)) == 0, os.strerror(ctypes.get_errno())
    try:
        assert locked_bytes() - before == size
        assert log.lines()[2].startswith(f"memory: of the RSS, {(before + size) / 2**20:,.0f} MiB locked or pinned")
    finally:
        libc.munlock(address, ctypes.c_size_t(size))
    assert locked_bytes() == before


@pytest.mark.device
def test_the_warm_ups_programs_serve_on_once_its_tracing_is_dropped(model, warmed):
    # Last in this file: it empties JAX's caches for the whole process, as the server does after its warm-up.
    # The shared warm-up's engine serves on for the tests that read it, whichever order they run in: that it
    # does is what this test asserts.
    engine, warm_up, want = warmed.engine, warmed.warm_up, warmed.want
    compiled = []
    on_compilation(lambda: compiled.append(threading.current_thread().name))
    warm_up.build.drop_tracing()
    # Every compiled program is now held by its Program, as one loaded from the program store is.
    assert warm_up.build.lowered == {} and warm_up.build.executables == []
    held = sum(len(p.loaded) for p in [engine._prefill, engine._prefill_group, engine._empty_row,
                                       engine.prefix.store_program, engine.prefix.gather_program]
               + [p for programs in engine.programs.values()
                  for p in (programs.new_cache, programs.insert, programs.decode, programs.decode_long,
                            programs.next_tokens, *programs.resize.values()) if p is not None])
    assert held == len(warm_up.compiled)
    got, alone = generations(engine), generations(engine, offset=3)
    engine.generate(got, 4)
    engine.generate(alone, 1)
    run_worker(engine, generations(engine, offset=5), waves=2)  # batches grown and shrunk
    assert compiled == []  # nothing traced or compiled again
    assert answers(got) == answers(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose([lp for _, lp, _ in g.token_logprobs], [lp for _, lp, _ in w.token_logprobs],
                                   atol=1e-5)
