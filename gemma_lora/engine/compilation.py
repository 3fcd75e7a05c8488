"""XLA compilations: counted (none may happen at request time), XLA's persistent cache watched, and the
program store that keeps the serialized executables a start needs, so that a restart loads rather than
compiles."""
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from gemma_lora.log import log
from gemma_lora.metrics import METRICS


def count_compilation():
    """serve_compilations_total, and apart from it those of no warm-up thread: compiled on a request's behalf."""
    METRICS.add("compilations")
    if not threading.current_thread().name.startswith(("loader", "warm-up")):
        METRICS.add("request_compilations")


def on_compilation(callback):
    """Calls callback() after every XLA compilation in this process (the warm-up's, and any that should not
    happen at request time)."""
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: callback() if event == "/jax/core/compile/backend_compile_duration" else None)


# Whether this thread's last compile was a hit in XLA's persistent cache (see watch_xla_cache).
XLA_CACHE = threading.local()


def watch_xla_cache():
    """Counts XLA's persistent-cache hits (METRICS) and marks them in the compiling thread (XLA_CACHE), where
    JAX reports them."""
    import jax.monitoring

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            METRICS.add("compile_cache_hits")
            XLA_CACHE.hit = True
    jax.monitoring.register_event_listener(on_event)


class ProgramStore:
    """The warm-up's compiled programs on disk (under --compile-cache), each by its name in a folder named
    by a hash of all that shapes them: the code's own text (source_hash), the versions of JAX, jaxlib, Keras and
    keras-hub, the devices and XLA's flags, the model's architecture and its variables' paths, shapes and
    dtypes, the adapter tables, and the engine's sizes (batch sizes, windows, blocks, stop tokens). A
    restart with all of those the same loads every program instead of tracing and compiling it: XLA's own
    cache saves the compiling but not the tracing, which runs one program at a time (on a TPU, 57-85 s of
    a restart's warm-up). A changed model, dtype or flag hashes to a new folder, never a stale program;
    the KEEP most recently used folders stay. A file that does not load is removed and compiled anew.

    On a CPU, a program that XLA's cache handed back is not stored: XLA's CPU backend serializes such an
    executable without its machine code (it then fails at its first run: "Function ... not found"). It is
    stored once it is compiled anew, e.g. after XLA's cache is emptied.

    The folder is only known once the model is loaded. An index (early key -> folder and the order its
    programs were built in) lets a Prefetch start loading them while the weights load; they are used only
    if that folder is this one."""

    KEEP = 4

    def __init__(self, root, engine, prefetch=None):
        import jax
        self.root, self.cpu = Path(root), jax.default_backend() == "cpu"
        key = hashlib.sha256(json.dumps(program_fingerprint(engine), sort_keys=True, default=str).encode())
        self.dir = self.root / key.hexdigest()[:24]
        self.prefetched = prefetch.jobs if prefetch is not None and prefetch.folder == self.dir.name else {}
        self.dir.mkdir(parents=True, exist_ok=True)
        os.utime(self.dir)  # most recently used, for the pruning below
        folders = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime,
                         reverse=True)
        for stale in folders[self.KEEP:]:
            shutil.rmtree(stale, ignore_errors=True)

    def path(self, name):
        return program_file(self.dir, name)

    def has(self, name):
        return self.path(name).is_file()

    def load(self, name, program):
        """Loads the program `name` into `program` (prefetched, or now); False (the file removed) if it
        cannot be."""
        job = self.prefetched.pop(name, None)
        try:
            program.add(*(job.result() if job is not None else read_program(self.path(name))))
            return True
        except Exception as e:
            log(f"warning: the stored program {name} did not load ({type(e).__name__}: {e}); compiling it")
            self.path(name).unlink(missing_ok=True)
            return False

    def save(self, name, compiled, statics, from_xla_cache=False):
        if from_xla_cache and self.cpu:  # serialized without its machine code (see above): compiled anew next time
            return
        import pickle
        from jax.experimental import serialize_executable
        try:
            data = pickle.dumps((*serialize_executable.serialize(compiled), statics))
            partial = self.path(name).with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_bytes(data)
            os.replace(partial, self.path(name))  # whole, or not there: a crash mid-write leaves no torn file
        except Exception as e:  # a full disk, a program that cannot be serialized: the next start compiles it
            log(f"warning: the program {name} was not stored ({type(e).__name__}: {e})")

    def remember(self, early, first):
        """Records that a start with the early key `early` used this folder, and `first`, the names of the
        programs it needs to be ready."""
        index_path = self.root / "index.json"
        try:
            index = json.loads(index_path.read_text()) if index_path.exists() else {}
            index[early] = {"folder": self.dir.name, "first": first}
            partial = index_path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(index))
            os.replace(partial, index_path)
        except (OSError, ValueError) as e:
            log(f"warning: the program store's index was not written ({type(e).__name__}: {e})")


def program_file(folder, name):
    return folder / (name.replace(" ", "-") + ".xla")


def read_program(path):
    """(executable, its static arguments) from a file ProgramStore.save wrote."""
    import pickle
    from jax.experimental import serialize_executable
    serialized, in_tree, out_tree, statics = pickle.loads(Path(path).read_bytes())
    return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree), statics


class Prefetch:
    """Loads the programs the last start with the same early key needed to be ready (WarmUp.first's), on
    threads of their own, while the model loads. The early key is what a start knows before loading:
    the code's text, the libraries' versions, the flags, the model files' names, sizes and times. It only
    predicts the store's folder: ProgramStore takes these programs only when the folder it computes from
    the loaded model is the same. Only the first part's: on a TPU, loading all 59 programs of gemma_2b
    alongside its weights slowed the weights' loading from 9 to 24 s, and the server was ready after 41 s
    instead of 31 s without a prefetch (BENCHMARKS.md)."""

    NOT_PROGRAMS = {"api_key", "host", "port", "uds", "uds_mode", "seed", "sampler", "shutdown_timeout", "idle_timeout",
                    "max_connections", "max_body_bytes", "max_queue", "batch_window_ms", "max_tokens_limit"}

    def __init__(self, root, args, threads=None):
        from concurrent.futures import ThreadPoolExecutor
        from importlib import metadata
        root, self.jobs, self.folder = Path(root), {}, None
        model = Path(args.model)
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime) for f in model.iterdir()) if model.is_dir() else []
        self.early = hashlib.sha256(json.dumps(
            [source_hash(), files,
             sorted((k, v) for k, v in vars(args).items() if k not in Prefetch.NOT_PROGRAMS),
             [metadata.version(p) for p in ("jax", "jaxlib", "keras", "keras-hub")],
             [os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")]], default=str).encode()).hexdigest()
        try:
            entry = json.loads((root / "index.json").read_text()).get(self.early)
        except (OSError, ValueError):
            entry = None
        if not entry or not (root / entry["folder"]).is_dir():
            return
        self.folder = entry["folder"]
        pool = ThreadPoolExecutor(threads or min(os.cpu_count() or 1, 16), thread_name_prefix="prefetch")
        for name in entry["first"]:
            path = program_file(root / self.folder, name)
            if path.is_file():
                self.jobs[name] = pool.submit(read_program, path)
        pool.shutdown(wait=False)


PACKAGE = Path(__file__).resolve().parent.parent  # gemma_lora/


def source_hash(root=PACKAGE):
    """A hash of every Python file of the package and of serve.py beside it: what traces the programs is spread
    over the engine's modules (and the interface's limits, the model's loading), so a change to any of them must
    make a new folder, never load a program of the old code."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")) + [root.parent / "serve.py"]:
        if path.is_file():
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def program_fingerprint(engine):
    """What shapes an engine's programs, beyond their names (see ProgramStore)."""
    import jax
    import jaxlib
    import keras
    import keras_hub
    model, tables = engine.model, engine.lora_tables
    return {"source": source_hash(),
            "versions": [jax.__version__, jaxlib.__version__, keras.__version__, keras_hub.__version__],
            "devices": [(d.platform, d.device_kind, d.id) for d in jax.devices()],
            "flags": [os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")],
            "mesh": None if engine.distribution is None else repr(engine.distribution.device_mesh.backend_mesh),
            "model": [type(model).__name__, model.backbone.get_config()],
            "variables": [(v.path, tuple(v.shape), str(v.dtype)) for v in engine.variables],
            "adapters": [(k, [(t.shape, str(t.dtype)) for t in v]) for k, v in sorted(tables.items())],
            "engine": [engine.batch_buckets, engine.length_buckets, engine.prompt_blocks, engine.group_sizes,
                       sorted(engine.group_blocks.items()), sorted(engine.unrolled), engine.dispatch_ahead,
                       sorted(engine.stop_ids), engine.vocabulary_size, engine.top_logprobs, engine.mask_words,
                       None if engine.prefix is None else (engine.prefix.blocks, engine.prefix.block_tokens)]}


def abstract(shapes, layout):
    """A pytree of shapes as jax.ShapeDtypeStructs, placed as `layout` says (None: one device)."""
    import jax
    return jax.tree.map(lambda s, l: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=l), shapes,
                        layout if layout is not None else jax.tree.map(lambda _: None, shapes))
