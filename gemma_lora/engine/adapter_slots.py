"""LoRA adapters on the device: --max-adapters slots in fixed-shape tables, so that loading an adapter
writes a slot and never compiles, and every row of a decode batch reads its own slot (any mix of adapters shares
one batch)."""
import contextlib
import functools
import threading

import numpy as np

from gemma_lora.adapters import AdapterError, kernel_axes, lora_equations, lora_layer
from gemma_lora.engine.programs import Program


class AdapterSlots:
    """--max-adapters slots of LoRA factors on the device (slot 0 holds none: the base) and which
    adapter is in which. Each targeted projection's call adds x·down[slot]·up[slot] for the slot of
    the row being traced; rows of the base add exact zeros."""

    def __init__(self, backbone, shapes, modules, max_adapters, max_rank, put):
        import jax
        self.modules, self.max_adapters, self.max_rank = tuple(modules), max_adapters, max_rank
        self.sizes, tables = {}, {}
        for (i, m), (shape, equation) in shapes.items():
            if m not in self.modules:
                continue
            ins, outs = kernel_axes(equation)
            ins, outs = tuple(shape[a] for a in ins), tuple(shape[a] for a in outs)
            n_in, n_out = self.sizes[i, m] = (int(np.prod(ins)), int(np.prod(outs)))
            tables[f"{i}.{m}"] = (np.zeros((max_adapters + 1, n_in, max_rank), np.float32),
                                  np.zeros((max_adapters + 1, max_rank, n_out), np.float32))
            self.attach(lora_layer(backbone, i, m), f"{i}.{m}", equation, ins, outs)
        self.slot_bytes = sum(a.nbytes for a in jax.tree.leaves(tables)) // (max_adapters + 1)
        self.put, self.tables = put, put(tables)
        self.by_name = {}  # name -> Adapter, for every loaded adapter
        self.held = [None] * (max_adapters + 1)  # slot -> its Adapter, until the last row using it ends
        self.refs = [0] * (max_adapters + 1)
        self.lock = threading.Lock()
        self.active = {}  # while one row is traced: "layer.module" -> its (down, up)
        self._write = Program(lambda tables, slot, new: jax.tree.map(
            lambda table, value: jax.lax.dynamic_update_index_in_dim(table, value, slot, 0), tables, new))

    def attach(self, layer, key, equation, ins, outs):
        """Wraps the layer's call, float and quantized, to add the traced row's LoRA delta in float32."""
        import jax.numpy as jnp
        into, out_of = lora_equations(equation)

        def wrap(call):
            @functools.wraps(call)
            def with_lora(inputs, *args, **kwargs):
                outputs = call(inputs, *args, **kwargs)
                if key not in self.active:
                    return outputs
                down, up = self.active[key]
                low = jnp.einsum(into, inputs.astype(jnp.float32), down.reshape(ins + (self.max_rank,)))
                return outputs + jnp.einsum(out_of, low, up.reshape((self.max_rank,) + outs)).astype(outputs.dtype)
            return with_lora
        object.__setattr__(layer, "call", wrap(layer.call))
        object.__setattr__(layer, "quantized_call", wrap(layer.quantized_call))

    @contextlib.contextmanager
    def rows(self, tables, slot):
        """Traces what runs inside with the LoRA of `slot` (a traced index) applied."""
        self.active = {key: (down[slot], up[slot]) for key, (down, up) in tables.items()}
        try:
            yield
        finally:
            self.active = {}

    def check(self, adapter):
        unknown = sorted(set(adapter.modules) - set(self.modules))
        if unknown:
            raise AdapterError(f"it targets {','.join(unknown)}, and this server applies LoRA to "
                               f"{','.join(self.modules)} only: restart it with --lora-modules "
                               f"{','.join(sorted(set(self.modules) | set(unknown)))}")
        if adapter.rank > self.max_rank:
            how = " (train_local.py's rank times the query heads: its query LoRA is shared across heads)" \
                if adapter.kind == "keras" else ""
            raise AdapterError(f"its rank {adapter.rank}{how} is over --max-lora-rank {self.max_rank}")

    def load(self, adapter):
        """Writes the adapter into a free slot (a compiled update: no compile)."""
        self.check(adapter)
        with self.lock:
            if adapter.name in self.by_name:
                raise AdapterError(f"the name {adapter.name} is taken: unload it first", 409)
            slot = next((s for s in range(1, self.max_adapters + 1) if self.held[s] is None), None)
            if slot is None:
                raise AdapterError(f"all {self.max_adapters} adapter slots are in use: unload one, or restart with a "
                                   "larger --max-adapters", 409)
            new = {}
            for (i, m), (n_in, n_out) in self.sizes.items():
                down, up = adapter.factors.get((i, m), (np.zeros((n_in, 0)), np.zeros((0, n_out))))
                padded = (np.zeros((n_in, self.max_rank), np.float32), np.zeros((self.max_rank, n_out), np.float32))
                padded[0][:, :down.shape[1]], padded[1][:up.shape[0]] = down, up
                new[f"{i}.{m}"] = padded
            self.tables = self._write(self.tables, np.int32(slot), self.put(new))
            adapter.slot, self.held[slot], self.by_name[adapter.name] = slot, adapter, adapter

    def unload(self, name):
        """Forgets the name now; its slot frees when the last generation using it ends."""
        with self.lock:
            adapter = self.by_name.pop(name, None)
            if adapter is None:
                raise AdapterError(f"no adapter named {name} is loaded", 404)
            if not self.refs[adapter.slot]:
                self.held[adapter.slot] = None

    def loaded(self):
        with self.lock:
            return list(self.by_name.values())

    def acquire(self, name):
        """The adapter a request named (None: the base), held until release(); None if not loaded."""
        with self.lock:
            adapter = self.by_name.get(name)
            if adapter is not None:
                self.refs[adapter.slot] += 1
            return adapter

    def release(self, adapter):
        with self.lock:
            self.refs[adapter.slot] -= 1
            if not self.refs[adapter.slot] and self.by_name.get(adapter.name) is not adapter:
                self.held[adapter.slot] = None
