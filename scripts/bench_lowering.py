"""How fast each way of writing a quantized matrix-vector product runs on this backend (issue #21 point 4).

    python3 scripts/bench_lowering.py [--rows 2] [--runs 10]

Decoding at small batch is a chain of matrix-vector products, so its speed is how many weight bytes a
second each product streams. For Gemma 3 270M's shapes (the layers' 640x2048 and 2048x640 kernels, 40
distinct ones so that they do not fit a cache, and the 262,144 x 640 tied output head) this times, in
one process:
- int8 x int8: keras' int8 layers (each row's activations quantized, an int32-accumulated dot);
- float32 / bfloat16 dot of the int8 kernel converted in the graph (weight-only dequantization);
- multiply-and-reduce of the converted kernel (a loop fusion XLA emits itself);
- int4: keras' packed nibbles unpacked in the graph, then the int8 dot; and XLA's own s4 type;
- float32: the unquantized product, for reference;
next to the read bandwidth bench_memory.py measures (best of 10 jitted sums), and prints GB/s of
weights read (int4: of its int8 size).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import read_bandwidth  # noqa: E402  the limit bench_memory.py divides by


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2, help="activation rows (serve.py decodes one request in two on CPU)")
    p.add_argument("--runs", type=int, default=10)
    return p.parse_args()


def timed(fn, args, runs):
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def lowerings():
    import jax
    import jax.numpy as jnp
    contract = (((1,), (0,)), ((), ()))

    def quantized(x):  # keras' per-row abs-max activation quantizer
        scale = 127.0 / jnp.maximum(jnp.max(jnp.abs(x), -1, keepdims=True), 1e-7)
        return jnp.clip(jnp.round(x * scale), -127, 127).astype(jnp.int8), scale

    def int8_dot(x, w, s):
        q, xs = quantized(x)
        return jax.lax.dot_general(q, w, contract, preferred_element_type=jnp.int32).astype(jnp.float32) / (xs * s)

    def unpacked(p):  # keras' int4 layout: two signed nibbles a byte along the input axis
        low, high = jnp.left_shift(p, 4) >> 4, p >> 4
        return jnp.stack([low, high], 1).reshape(2 * p.shape[0], p.shape[1])

    return {
        "int8 x int8 dot (keras)": ("int8", int8_dot),
        "float32 dot of converted int8": ("int8", lambda x, w, s: (x @ w.astype(jnp.float32)) * s),
        "bfloat16 dot of converted int8": ("int8", lambda x, w, s: jax.lax.dot_general(
            x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), contract, preferred_element_type=jnp.float32) * s),
        # over the kernel's minor axis (stored transposed): reducing over its major axis crashed on the head
        "multiply-and-reduce of converted int8": ("int8 transposed", lambda x, w, s: jnp.sum(
            x[:, None, :] * w.astype(jnp.float32)[None], -1) * s),
        "int4 packed, unpacked in the graph (keras)": ("packed", lambda x, w, s: int8_dot(x, unpacked(w), s)),
        "int4 as XLA s4, converted": ("s4", lambda x, w, s: int8_dot(x, w.astype(jnp.int8), s)),
        "float32 (unquantized)": ("float32", lambda x, w, s: x @ w),
    }


def main():
    args = parse_args()
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    bandwidth = read_bandwidth()
    print(f"read bandwidth (jitted sum over 256 MiB): {bandwidth / 1e9:.1f} GB/s; {args.rows} activation rows\n")
    shapes = {"layers: 20 x (640x2048 + 2048x640)": [(640, 2048), (2048, 640)] * 20,
              "output head: 640 x 262,144": [(640, 262144)]}
    print("| lowering | " + " | ".join(shapes) + " |\n|---|" + "---|" * len(shapes))
    kernels = {name: [rng.integers(-7, 8, shape).astype(np.int8) for shape in s] for name, s in shapes.items()}
    for label, (kind, fn) in lowerings().items():
        cells = []
        for name, ints in kernels.items():
            if kind == "int8":
                ws = [jnp.asarray(w) for w in ints]
            elif kind == "int8 transposed":
                ws = [jnp.asarray(w.T.copy()) for w in ints]
            elif kind == "float32":
                ws = [jnp.asarray(w.astype(np.float32)) for w in ints]
            elif kind == "s4":
                ws = [jnp.asarray(w).astype(jnp.int4) for w in ints]
            else:
                ws = [jnp.asarray(((w[0::2] & 0xF) | ((w[1::2] & 0xF) << 4)).astype(np.uint8).view(np.int8))
                      for w in ints]
            scales = [jnp.asarray(rng.random(w.shape[1]).astype(np.float32) / 100) for w in ints]
            xs = {d: jnp.asarray(rng.standard_normal((args.rows, d)).astype(np.float32))
                  for d in {w.shape[0] for w in ints}}
            program = jax.jit(lambda ws, scales, fn=fn, ints=ints: [
                fn(xs[i.shape[0]], w, s) for i, w, s in zip(ints, ws, scales)])
            try:
                seconds = timed(program, (ws, scales), args.runs)
            except Exception as e:  # a lowering this backend refuses
                cells.append(f"fails: {type(e).__name__}")
                continue
            read = sum(w.nbytes for w in ws) if kind == "float32" else sum(w.nbytes for w in ints)
            cells.append(f"{seconds * 1e3:.1f} ms, {read / seconds / 1e9:.1f} GB/s ({read / seconds / bandwidth:.0%})")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
