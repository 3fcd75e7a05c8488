"""Building the engine from serve.py's flags (distribution, batch sizes, adapter slots) and EngineCore, the
front end's one handle on it."""
from gemma_lora.adapters import AdapterError, DEFAULT_LORA_MODULES, describe, read_adapter
from gemma_lora.engine.adapter_slots import AdapterSlots
from gemma_lora.engine.programs import cache_bytes
from gemma_lora.engine.worker import Worker
from gemma_lora.interface import WorkerGone
from gemma_lora.log import log
from gemma_lora.memory import trim_heap
from gemma_lora.model import LoadError, layout_map_for
from gemma_lora.tokens import pieces_of


def setup_distribution(args):
    """Returns the keras distribution to load the model under, or None for one device."""
    import keras
    devices = keras.distribution.list_devices()
    mode = args.distribution
    if mode == "auto":
        mode = "data" if len(devices) > 1 else "off"
    if mode == "off":
        return None, 1
    if mode == "data":
        distribution, batch_axis = keras.distribution.DataParallel(devices=devices), len(devices)
    else:
        batch_axis, model_axis = (int(s) for s in args.mesh.split(",")) if args.mesh else (1, len(devices))
        if batch_axis * model_axis != len(devices):
            raise SystemExit(f"error: --mesh {args.mesh}: {batch_axis}x{model_axis} != {len(devices)} devices")
        mesh = keras.distribution.DeviceMesh(shape=(batch_axis, model_axis), axis_names=("batch", "model"),
                                             devices=devices)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map_for(args.model, mesh, model_axis),
                                                        batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    log(f"distribution: {mode} over {len(devices)} devices")
    return distribution, batch_axis


def batch_buckets(max_batch_size, batch_axis, sizes=None):
    if sizes is None:
        # Past a CPU's sizes, by fours up to BATCH_BY_FOURS_UP_TO rows and by twos above: each size is a set of
        # programs (minutes of warm-up for a 2B model on a TPU: nine sizes up to 256 compiled 192 programs in
        # 431 s, issue #48) and a copy of the cache for a batch that fills through it. Up to 64 rows a step costs
        # about the weights' read whatever the rows (gemma_2b on a TPU v5e: 7.5 ms at 1 row, 14 at 64); above,
        # it grows with them (38 ms at 256), and 128 clients in a batch of 256 made 1,935 tok/s against 2,415
        # in one of 128.
        sizes, size = set(), 1
        while size < max_batch_size:
            sizes.add(size)
            size *= 4 if BATCH_BY_TWOS_UP_TO < max_batch_size and size < BATCH_BY_FOURS_UP_TO else 2
        sizes.add(max_batch_size)
    # Under data parallelism every batch must split evenly over the batch axis.
    return sorted({-(-s // batch_axis) * batch_axis for s in sizes})


AUTO_BATCH_CAP = 256
BATCH_BY_TWOS_UP_TO, BATCH_BY_FOURS_UP_TO = 16, 64  # batch_buckets' default sizes
MIN_QUEUE = 64


def auto_max_queue(max_batch_size):
    """--max-queue auto. A queue shorter than the batch turns a burst away with 503s while rows stand empty: on a
    TPU v5e, 128 and 256 clients against a 64-long queue retried 90 and 469 times, their first tokens 3-4 s late
    and the device idle 45% of the time (issue #48)."""
    return max(MIN_QUEUE, 2 * max_batch_size)


CPU_BATCH_SIZE = 8  # a CPU's matrix units are full long before its memory is


def auto_batch_size(model, args):
    """--max-batch-size auto: CPU_BATCH_SIZE on a CPU; on a GPU or TPU what fitting_batch_size allows in the
    memory the device has left after the weights and adapters (loaded by now), logged with its reasons."""
    import jax
    device = jax.local_devices()[0]
    stats = device.memory_stats() if jax.default_backend() != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        log(f"--max-batch-size auto: {CPU_BATCH_SIZE} ({device.platform}: no device memory to fill)")
        return CPU_BATCH_SIZE
    # A row's KV cache over the longest request, split over the devices (by rows or by heads).
    row = cache_bytes(model, 1, args.length_buckets[-1])
    row /= jax.device_count()
    pool = row / args.length_buckets[-1] * args.prefix_block_tokens * (args.prefix_cache_blocks + 1)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - pool
    size, need = fitting_batch_size(free, row, model.backbone.vocabulary_size / jax.device_count())
    log(f"--max-batch-size auto: {size} on {device.device_kind}: a row's KV cache is {row / 2**20:,.1f} MiB over "
        f"{args.length_buckets[-1]} positions; {free / 2**30:.2f} GiB free after the weights, adapters and the "
        f"prefix pool ({pool / 2**20:,.0f} MiB)" + (f"; batch {size * 2} would need {need / 2**30:.2f} GiB"
                                                     if size < AUTO_BATCH_CAP else f" (capped at {AUTO_BATCH_CAP})"))
    return size


def fitting_batch_size(free_bytes, row_bytes, vocabulary, headroom=0.15, cap=AUTO_BATCH_CAP):
    """(the largest power of two up to `cap` whose decoding fits `free_bytes`, the bytes the next size up
    would need). Decoding batch b holds its cache and, while it grows in place, the next smaller one's
    (1.5 caches), and per row a step's float32 logits with the sampler's copies of them and the penalties'
    counts (6 x vocabulary x 4 bytes); `headroom` of the free memory is left for XLA's other temporaries."""
    def need(batch):
        return 1.5 * batch * row_bytes + 6 * 4 * batch * vocabulary
    size = 1
    while size * 2 <= cap and need(size * 2) <= (1 - headroom) * free_bytes:
        size *= 2
    return size, need(size * 2)


def adapter_slots_for(args, model, shapes, base_names, distribution):
    """The adapter slots, with every --adapter read, checked and loaded (None when none are asked for)."""
    if not args.adapter and not args.enable_lora:
        return None
    import jax
    pieces = pieces_of(model.preprocessor.tokenizer)
    adapters = []
    for name, path in args.adapter.items():
        try:
            if name in base_names:
                raise AdapterError(f"{name} is the base model's name: give the adapter another")
            if not shapes:
                raise AdapterError(f"{type(model.backbone).__name__} is not a Gemma decoder this server can adapt")
            adapters.append(read_adapter(name, path, model.backbone, shapes, pieces))
        except AdapterError as e:
            raise LoadError(f"--adapter {name}={path}: {e}") from None
    modules = args.lora_modules or sorted(set(DEFAULT_LORA_MODULES).union(*(a.modules for a in adapters)))
    replicated = None if distribution is None else jax.sharding.NamedSharding(
        distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec())
    slots = AdapterSlots(model.backbone, shapes, modules, args.max_adapters, args.max_lora_rank,
                         put=lambda tree: jax.device_put(tree, replicated))
    for adapter in adapters:
        try:
            slots.load(adapter)
        except AdapterError as e:
            raise LoadError(f"--adapter {adapter.name}={adapter.path}: {e}") from None
        log(f"adapter {adapter.name}: slot {adapter.slot}, {describe(adapter)}")
    return slots


class EngineCore:
    """What the front end asks of the engine: the one interface between the two halves. Requests go in
    (submit: Generations, see interface.py) and their events come out (each Generation's `events` and `done`);
    besides, it answers what a request is checked and rendered against (the tokenizer's view, the limits) and
    loads or unloads adapters. The front end holds it without importing it, so it can later sit in another
    process behind the same methods."""

    def __init__(self, engine, warm_up, adapters=None, kernel_shapes=None):
        self.engine, self.warm_up, self.adapters, self.kernel_shapes = engine, warm_up, adapters, kernel_shapes or {}
        self.worker = None
        # What requests are checked and rendered against: plain values and the tokenizer's codec.
        self.bos, self.stop_ids, self.pieces = engine.bos, engine.stop_ids, engine.pieces
        self.encode, self.decode = engine.encode, engine.decode
        self.vocabulary_size, self.top_logprobs = engine.vocabulary_size, engine.top_logprobs
        self.max_length, self.length_buckets = engine.max_length, engine.length_buckets

    def start(self, max_queue, window_seconds):
        """Starts the model worker: from here on requests are taken."""
        self.worker = Worker(self.engine, self.engine.batch_buckets[-1], window_seconds, max_queue)
        self.worker.start()

    def submit(self, generations):
        """Queues the generations (QueueFull, WorkerGone: nothing was queued)."""
        if self.worker is None:
            raise WorkerGone()
        self.worker.submit(generations)

    def alive(self):
        return self.worker is not None and self.worker.alive()

    def idle(self):
        return self.worker is None or self.worker.idle()

    def compiling(self):
        """The warm-up's parts still compiling (each serves as soon as it is compiled)."""
        return list(self.warm_up.pending) if self.warm_up is not None else []

    # LoRA adapters: None of these without adapter slots (has_adapters False).
    def has_adapters(self):
        return self.adapters is not None

    def adapter(self, name):
        """The loaded adapter of that name, or None."""
        return None if self.adapters is None else self.adapters.by_name.get(name)

    def loaded_adapters(self):
        return [] if self.adapters is None else self.adapters.loaded()

    def acquire(self, name):
        return self.adapters.acquire(name)

    def release(self, adapter):
        self.adapters.release(adapter)

    def load_adapter(self, name, path):
        """Reads, checks and loads an adapter into a free slot (AdapterError says why not)."""
        adapter = read_adapter(name, path, self.engine.model.backbone, self.kernel_shapes, self.pieces)
        self.adapters.load(adapter)
        trim_heap()  # reading it (h5py, numpy) freed memory in the calling thread's arena, which glibc keeps
        return adapter

    def unload_adapter(self, name):
        self.adapters.unload(name)
        trim_heap()  # its slot's host copies, when its last request has ended (and those of requests before)
