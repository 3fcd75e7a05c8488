"""Where a process's host memory goes before serve.py loads a model (issue #49 item 3).

    python3 scripts/host_memory.py [--top 8]

On a TPU VM the server's memory table reads some 13.7 GB at "imports", before the model loads. This
takes the same steps one at a time in a fresh process and prints, after each, the resident memory from
/proc/self/status split as the kernel counts it: anonymous (malloc, the runtime's own buffers), file-backed
(shared libraries, mapped files), shared memory, locked (mlock) and pinned (held for a device's DMA), so
that a step's growth says whose it is and whether it was touched or only reserved (address space, VmSize,
that was never touched is not resident). Then the largest mappings by resident size (/proc/self/smaps).

The steps: Python alone, numpy, `import jax` (no backend yet), the backend started (jax.devices(): on a TPU
the runtime, which pins TPU_PREMAPPED_BUFFER_SIZE bytes of host memory for transfers, 4 GiB by default
per Google's Cloud TPU performance guide), one small array on the device, then keras, keras_hub (which
imports TensorFlow where it is installed) and serve.py's own module. `scripts/tpu_check.sh memory` runs
it as is and again with TPU_PREMAPPED_BUFFER_SIZE=1 GiB, side by side.
"""
import argparse
import collections
import os
import sys
import time

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "VmSize")


def status():
    """{field: MiB} of /proc/self/status, for FIELDS."""
    out = dict.fromkeys(FIELDS, 0.0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in out:
                    out[name] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def largest_mappings(top):
    """[(MiB resident, what)] of the `top` largest by resident size: each file's mappings together, and
    anonymous ones by their size (a runtime's buffer is one large anonymous mapping)."""
    by_what, what = collections.Counter(), None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split()
                if not first:
                    continue
                if "-" in first[0] and len(first) >= 5 and not first[0].endswith(":"):  # a mapping's header
                    start, end = (int(x, 16) for x in first[0].split("-"))
                    what = os.path.basename(first[5]) if len(first) > 5 else f"[anonymous mapping of {(end - start) / 2**20:,.0f} MiB]"
                elif first[0] == "Rss:":
                    by_what[what] += int(first[1]) / 1024
    except OSError:
        return []
    return sorted(((mib, name) for name, mib in by_what.items()), reverse=True)[:top]


def steps():
    """(name, what it does) in the order the server takes them."""
    def backend():
        import jax
        return f"{jax.devices()[0].device_kind} x{jax.device_count()}, {jax.default_backend()}"

    def one_array():
        import jax
        import numpy as np
        jax.block_until_ready(jax.device_put(np.ones(1024, np.float32)))

    def keras_hub():
        import keras_hub as _  # noqa: F401
        return "TensorFlow imported too" if "tensorflow" in sys.modules else "no TensorFlow"

    def serve_module():
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import serve as _  # noqa: F401

    return [("numpy", lambda: __import__("numpy")), ("import jax", lambda: __import__("jax")),
            ("backend started", backend), ("one array on the device", one_array),
            ("import keras", lambda: __import__("keras")), ("import keras_hub", keras_hub),
            ("import serve", serve_module)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=8, help="the largest mappings to list at the end")
    args = p.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    premapped = os.environ.get("TPU_PREMAPPED_BUFFER_SIZE")
    print(f"host memory, step by step (MiB; TPU_PREMAPPED_BUFFER_SIZE "
          f"{premapped + ' bytes' if premapped else 'unset: the runtime default'})")
    print("| step | seconds | RSS | + RSS | anonymous | file-backed | shared | locked | pinned | address space | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    before = status()
    row = lambda name, took, now, note="": print(  # noqa: E731
        f"| {name} | {took:.1f} | {now['VmRSS']:,.0f} | {now['VmRSS'] - before['VmRSS']:+,.0f} | {now['RssAnon']:,.0f} | "
        f"{now['RssFile']:,.0f} | {now['RssShmem']:,.0f} | {now['VmLck']:,.0f} | {now['VmPin']:,.0f} | "
        f"{now['VmSize']:,.0f} | {note} |", flush=True)
    row("Python", 0.0, before)
    for name, do in steps():
        started = time.perf_counter()
        note = do()
        now = status()
        row(name, time.perf_counter() - started, now, note if isinstance(note, str) else "")
        before = now
    print("largest mappings by resident size (MiB): " + "; ".join(
        f"{name} {mib:,.0f}" for mib, name in largest_mappings(args.top)))


if __name__ == "__main__":
    main()
