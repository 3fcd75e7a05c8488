"""Host memory: the process's RSS and what of it is locked or pinned, the table serve.py logs stage by stage
(MemoryLog), and handing freed memory back to the OS (glibc keeps it otherwise). Shared by both scripts."""
import contextlib
import os


def process_rss():
    """This process's resident memory in bytes, now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def locked_bytes():
    """This process's host memory that is locked or pinned (VmLck + VmPin: 0 where /proc says neither): part of
    its RSS that no other process can have, e.g. a TPU runtime's buffer for transfers."""
    total = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmLck:", "VmPin:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


class MemoryLog:
    """Where the process's resident memory went: RSS at each stage of start-up (the differences add up to
    the last), next to the sizes of what the device holds (weights, each batch's KV cache, the prefix pool,
    adapter slots). On a CPU those live inside the RSS; on a GPU or TPU they do not. Of the RSS, what is locked
    or pinned is said apart: on a TPU the runtime pins TPU_PREMAPPED_BUFFER_SIZE bytes (4 GiB by default) at
    its start, for transfers (scripts/host_memory.py measures a start's steps one at a time)."""

    def __init__(self):
        self.stages = [("start", process_rss())]
        self.held = []  # (what, bytes) on the device

    def stage(self, name):
        self.stages.append((name, process_rss()))

    def lines(self):
        (first, base), total = self.stages[0], self.stages[-1][1]
        parts = [f"{first} {base / 2**20:,.0f}"]
        for (_, before), (name, now) in zip(self.stages, self.stages[1:]):
            parts.append(f"{'+' if now >= before else '-'} {name} {abs(now - before) / 2**20:,.0f}")
        lines = [f"memory: RSS {total / 2**20:,.0f} MiB = " + " ".join(parts),
                 "memory: held for the model: " + ", ".join(f"{what} {size / 2**20:,.1f} MiB" for what, size in self.held)]
        if locked := locked_bytes():
            lines.append(f"memory: of the RSS, {locked / 2**20:,.0f} MiB locked or pinned (a device runtime's host "
                         f"buffers; on a TPU, TPU_PREMAPPED_BUFFER_SIZE sets its transfer buffer)")
        return lines


def release_freed_memory():
    """Hands memory freed by quantizing back to the OS: glibc keeps it otherwise, and RSS would not shrink."""
    import gc
    gc.collect()
    trim_heap()


@contextlib.contextmanager
def one_collection_after():
    """Keras collects garbage every time a layer drops a variable (Layer.__delattr__), so that the device frees
    its buffer at once; quantizing drops every kernel, and each collection walks the whole heap: 127 of them
    were 37 of quantizing's 40-44 s for Gemma 3 270M on a CPU (the 2B's quantizing took 65 s on a TPU v5e).
    The kernels go with their last reference anyway (the same peak RSS either way: 3,224 and 3,223 MiB), so
    meanwhile collections are skipped; the caller collects once after (release_freed_memory)."""
    import gc
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


def trim_heap():
    """glibc's malloc_trim: the free pages of every arena back to the OS. Without a garbage collection (which
    would hold the GIL from the decode loop), so a request handler may call it."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS): nothing to trim
        pass
