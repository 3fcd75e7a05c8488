"""Where loading a model's time goes: serve.py's own load_model, under cProfile, on whatever backend JAX has.

    python3 scripts/profile_load.py --model .demo/gemma3-270m [--dtype bfloat16] [--quantize int8] [--top 25]
                                    [--compile-cache DIR]

Prints the seconds of the imports, the backend's start (alongside keras-hub's import, as serve.py does),
building the backbone (its variables' first values), reading and assigning the checkpoint's weights, the
tokenizer and quantizing, then the functions that took the most time. gemma_2b on a TPU v5e host, warm:
load_model 7.8 s before the weights were read from the mapped file, 1.8 s after (BENCHMARKS.md).
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

started = time.time()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("KERAS_BACKEND", "jax")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="none")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--compile-cache", default="", help="XLA's compilation cache, as serve.py's (default: none)")
    a = p.parse_args()
    import serve  # noqa: F401  (its imports are what is timed)
    from gemma_lora.model import keep_unused_imports_out, load_model, start_backend
    keep_unused_imports_out()
    import jax
    print(f"imports of serve.py and jax: {time.time() - started:.1f}s")
    t = time.time()
    start_backend()  # as serve.py starts: the backend on a thread while keras-hub imports
    import keras_hub  # noqa: F401
    print(f"import keras_hub while the backend starts: {time.time() - t:.1f}s")
    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(a.compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    t = time.time()
    jax.devices()
    print(f"then waiting for the backend ({jax.default_backend()}, {jax.devices()[0].device_kind}): "
          f"{time.time() - t:.1f}s")

    # The phases of keras-hub's transformers loader, timed where they are entered.
    from keras_hub.src.utils.transformers import preset_loader
    phases = {}

    def timed(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.time() - t
        setattr(owner, name, wrapper)
    timed(preset_loader.TransformersPresetLoader, "load_backbone", "backbone: build and convert weights")
    timed(preset_loader.TransformersPresetLoader, "load_tokenizer", "tokenizer")
    from keras_hub.src.utils.transformers import safetensor_utils
    timed(safetensor_utils.SafetensorLoader, "get_tensor", "read tensors from safetensors")
    import keras
    timed(keras.Variable, "assign", "assign to variables")

    args = argparse.Namespace(model=a.model, dtype=a.dtype, quantize=a.quantize)
    profile = cProfile.Profile()
    t = time.time()
    profile.enable()
    model, dtype, _ = load_model(args, alone=True)
    profile.disable()
    total = time.time() - t
    print(f"load_model: {total:.1f}s, {dtype}, weights "
          f"{sum(v.value.nbytes for v in model.weights) / 2**30:.2f} GiB, {len(model.weights)} variables")
    for label, seconds in phases.items():
        print(f"  {label}: {seconds:.1f}s")
    stats = pstats.Stats(profile).strip_dirs()
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
