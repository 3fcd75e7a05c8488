"""Loading a model: a Keras preset, a transformers-layout dir (keras-hub's converter, over safetensors
mapped rather than read), or a hub handle; what keeps unused imports (TensorFlow, IPython) out; the layout map
for sharding over a mesh; and load errors told in one line."""
import json
import sys
import threading
from pathlib import Path

import numpy as np

from gemma_lora.adapters import lora_kernel_shapes
from gemma_lora.memory import one_collection_after, release_freed_memory
from gemma_lora.tokens import pieces_of


def keep_unused_imports_out(model=None):
    """keras-hub imports TensorFlow whenever it is installed, and this script never runs it: the model loads
    without its task's preprocessor and text goes through SentencePiece. Kept out, it costs no memory (about
    800 MiB of RSS, see BENCHMARKS.md) and cannot take the GPU's memory from JAX. keras imports IPython (and
    with it jedi and prompt_toolkit: 450 modules, 20 MiB) only to tell whether it runs in a notebook, which
    a script started from the command line never does. kagglehub (with kagglesdk: 280 modules, 14 MiB) only
    downloads presets, which a `model` in a local directory or on hf:// never needs. A None in sys.modules
    makes such an import fail, which keras and keras-hub take as "not installed"; a module already
    imported (a notebook's IPython) stays."""
    names = ["tensorflow", "IPython"]
    if model is not None and (str(model).startswith("hf://") or Path(model).expanduser().is_dir()):
        names.append("kagglehub")
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None


def start_backend():
    """Starts JAX's backend on a thread of its own: on a TPU its runtime takes seconds to come up, which
    then overlap keras-hub's import. Whoever needs the backend next waits for it."""
    import jax

    def start():
        try:
            jax.devices()
        except Exception:  # no usable backend: the loader's own first use of it says why
            pass
    threading.Thread(target=start, daemon=True, name="backend").start()


def explain_load_error(preset, error):
    text = f"{type(error).__name__}: {error}"
    low = text.lower()
    if preset.startswith("hf://") and any(s in low for s in ("401", "403", "gated", "unauthorized", "access")):
        return (f"could not load {preset}: Hugging Face refused access ({text.splitlines()[0][:200]}).\n"
                "Gemma is gated: accept the license on its model page while logged in, create a read token "
                "at https://huggingface.co/settings/tokens, then `export HF_TOKEN=hf_...`.")
    if preset.startswith("kaggle://") or "kaggle" in low:
        if any(s in low for s in ("401", "403", "credential", "unauthorized", "consent", "license")):
            return (f"could not load {preset}: Kaggle refused access ({text.splitlines()[0][:200]}).\n"
                    "Accept the Gemma license on kaggle.com/models/google/gemma, then set KAGGLE_USERNAME and "
                    "KAGGLE_KEY (or put kaggle.json in ~/.kaggle).")
    if any(s in low for s in ("connection", "resolve", "network", "timed out", "offline", "max retries",
                              "name or service not known", "localentrynotfound")):
        return (f"could not load {preset}: the network is unreachable ({text.splitlines()[0][:200]}).\n"
                "Offline, pass a local model dir: --model path/to/model (a Keras preset or a transformers-"
                "layout dir with config.json, model.safetensors and tokenizer.model).")
    if preset.startswith("hf://") and "no config.json" in low:  # keras-hub's word for "the download failed"
        return (f"could not load {preset}: Hugging Face gave no config.json (no network, a typo, or a gated "
                "model without HF_TOKEN).\nOffline, pass a local model dir: --model path/to/model.")
    if not preset.startswith(("hf://", "kaggle://")) and ("/" in preset or preset.startswith(".")) \
            and not Path(preset).exists():
        return f"--model {preset}: no such directory"
    return f"could not load {preset}: {text.splitlines()[0][:500]}"


def saved_dtype(preset):
    """The dtype a preset was saved in: a Keras preset's policy, a transformers config's torch_dtype."""
    from keras_hub.src.utils.preset_utils import get_preset_loader
    config = getattr(get_preset_loader(preset), "config", None) or {}
    config = config.get("config", config)
    dtype = config.get("dtype") or config.get("torch_dtype")
    if isinstance(dtype, dict):  # a serialized DTypePolicy
        dtype = dtype.get("config", {}).get("name")
    return dtype if dtype in ("float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16") else "float32"


def load_model(args, memory=None, alone=False):
    """The preset in the dtype asked for (auto: as saved), quantized if asked; errors explained in one line.
    `memory`: a MemoryLog to note each step's RSS in. `alone`: nothing else in the process has compiled
    programs to keep (the server), so JAX's caches can be emptied of what loading compiled."""
    import jax
    try:
        dtype = saved_dtype(args.model) if args.dtype == "auto" else args.dtype
        model = load_causal_lm(args.model, dtype=dtype)
    except Exception as e:
        raise LoadError(explain_load_error(args.model, e).replace("\n", " ")) from None
    shapes = lora_kernel_shapes(model.backbone) if hasattr(model.backbone, "transformer_layers") else {}
    # Each array operation of loading ran eagerly: a small program, compiled and kept in JAX's caches, that
    # serving never runs again (Gemma 3 270M: 33 MiB of RSS; 76 MiB more after quantizing to int8).
    if alone:
        jax.clear_caches()
    if getattr(model, "preprocessor", None) is not None:
        pieces_of(model.preprocessor.tokenizer)  # the vocabulary held once, before the table says what loading took
    release_freed_memory()  # the converter's and loader's copies of the weights
    if memory is not None:
        memory.stage("model loaded")
    if args.quantize != "none":
        import keras
        # The dense layers and the embedding: all Gemma's big weights. The embedding is also the tied output
        # head, the largest product of a decode step; quantized, its step reads a quarter of the bytes.
        # keras' int8 layers quantize each row's activations and run an int8 x int8 dot. On XLA's CPU
        # backend that dot is YNNPACK's, the fastest lowering measured (scripts/bench_lowering.py): about
        # 10-13 GB/s of weights over two rows. A float32 or bfloat16 dot of the kernel converted in the graph
        # runs at about 1 GB/s, a multiply-and-reduce at 0.4-8. (GPU and TPU compilers can fuse such a convert
        # into the dot; not measured here.)
        try:
            with one_collection_after():
                model.backbone.quantize(args.quantize, filters=lambda layer: isinstance(
                    layer, (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)))
        except Exception as e:
            raise LoadError(f"--quantize {args.quantize}: {type(model.backbone).__name__} cannot be quantized so: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        if alone:
            jax.clear_caches()  # quantizing's eager programs, as loading's above
        release_freed_memory()
        if memory is not None:
            memory.stage("quantized")
    return model, dtype, shapes


def load_causal_lm(preset, **kwargs):
    """keras-hub's CausalLM without the task's own preprocessor: it serves keras-hub's generate() and tf.data,
    and some (Gemma 3's) refuse to exist without TensorFlow. A plain one holds the tokenizer, all this script
    reads. Its variables start as zeros, not random (see zeros_for_random_initializers)."""
    import keras_hub
    with zeros_for_random_initializers(), mapped_safetensors():
        model = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **kwargs)
    # Keras wraps every list and dict a layer keeps to track variables in them; a tokenizer's vocabulary (256k
    # pieces, and a dict of them) holds none, and wrapping it cost 0.55 of its 0.78 s on this CPU.
    from keras.src.utils.tracking import DotNotTrackScope
    with DotNotTrackScope():
        tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    model.preprocessor = keras_hub.models.CausalLMPreprocessor(tokenizer=tokenizer)
    return model


class zeros_for_random_initializers:
    """While a checkpoint loads, a variable Keras would fill from a random initializer starts as zeros: Keras
    initializes every variable when the model is built, and the weights read next overwrite them all (a
    test checks it). Random ones cost: Gemma 3 270M on a CPU loads in 3.4-3.7 s instead of 10-12 s, and on
    an accelerator each shape's random program is compiled on a first start. Zeros, ones and constants
    stay as they are."""

    def __enter__(self):
        import keras
        from keras.src.backend.common import variables
        from keras.src.initializers.random_initializers import RandomInitializer
        self.initialize = initialize = variables.Variable._initialize_with_initializer

        def zeros_for_random(variable, initializer):
            if not isinstance(initializer, RandomInitializer):
                return initialize(variable, initializer)
            variable._initialize(keras.ops.zeros(variable._shape, variable._dtype))
        variables.Variable._initialize_with_initializer = zeros_for_random

    def __exit__(self, *_):
        from keras.src.backend.common import variables
        variables.Variable._initialize_with_initializer = self.initialize


class mapped_safetensors:
    """While a checkpoint loads, keras-hub reads each tensor of a .safetensors file as a view of the file mapped
    into memory, not as a fresh copy: off a CPU the weights go from the page cache to the accelerator with no
    host copy of their own (a converter's transpose still makes one). That copy was most of a warm load on
    the TPU host: 5.9 of 7.8 s for gemma_2b's 4.7 GiB, faulting in fresh pages. On a CPU each tensor is
    still copied once (safetensors copied twice): there JAX may keep an aligned host array as the weight
    itself, and a file rewritten under a running server (a new training run into the same directory)
    would then crash it."""

    def __enter__(self):
        from keras_hub.src.utils.transformers import safetensor_utils
        self.module, self.original = safetensor_utils, safetensor_utils.safetensors
        if self.original is not None:
            import jax
            copy = jax.default_backend() == "cpu"
            safetensor_utils.safetensors = type("mapped", (), {
                "safe_open": staticmethod(lambda path, framework="np", **_: MappedSafetensors(path, copy))})
        return self

    def __exit__(self, *_):
        self.module.safetensors = self.original


class MappedSafetensors:
    """One .safetensors file as safetensors' safe_open(framework="np") reads it: keys() and get_tensor(name).
    The format: a little-endian u64 header length, a JSON header of name -> dtype, shape and byte offsets
    into the data that follows."""
    DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
              "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
              "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

    def __init__(self, path, copy):
        import mmap
        import ml_dtypes  # noqa: F401  (gives numpy bfloat16 and the float8 types by name)
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(size))
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.header.pop("__metadata__", None)
        self.start, self.copy = 8 + size, copy
        if hasattr(self.map, "madvise"):  # read ahead from disk on a first load; nothing to read when cached
            self.map.madvise(mmap.MADV_WILLNEED)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        # The views handed out keep the map open until the last is gone (an accelerator's transfer may still
        # be reading one); closing it under them would raise.
        self.map = None

    def keys(self):
        return list(self.header)

    def get_tensor(self, name):
        entry = self.header[name]
        dtype = np.dtype(self.DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        tensor = np.frombuffer(self.map, dtype, (end - begin) // dtype.itemsize, self.start + begin)
        tensor = tensor.reshape(entry["shape"])
        return tensor.copy() if self.copy else tensor


class LoadError(Exception):
    """A model that cannot be served as asked: one line for the user, exit code 2."""


def layout_map_for(preset, mesh, model_axis):
    """The family's layout map, K/V replicated when there are fewer KV heads than model shards (keras-hub #1613)."""
    from keras_hub.models import GemmaBackbone
    from keras_hub.src.utils.preset_utils import get_preset_loader
    loader = get_preset_loader(preset)
    cls = loader.check_backbone_class()
    layout_map = getattr(cls, "get_layout_map", GemmaBackbone.get_layout_map)(
        mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch")
    config = getattr(loader, "config", {}) or {}
    config = config.get("config", config)
    kv_heads = config.get("num_key_value_heads") or config.get("num_kv_heads") or 1
    qkv = "decoder_block.*attention.*(query|key|value).kernel"
    if qkv in layout_map and kv_heads % model_axis:
        spec = layout_map[qkv]
        del layout_map[qkv]
        layout_map["decoder_block.*attention.*query.kernel"] = spec
        layout_map["decoder_block.*attention.*(key|value).kernel"] = (None,) + tuple(spec.axes[1:])
    return layout_map
