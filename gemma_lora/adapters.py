"""LoRA adapters in the form both scripts share. Whatever an adapter comes as (train_local.py's
adapter.lora.h5, or a Hugging Face PEFT dir), it is held in PEFT's form: per (layer, module) a `down` (in, r) and
an `up` (r, out) with the scale folded in, in transformers' flattening of the kernel's input and output axes.
Also the mapping between PEFT's module names and keras-hub's Gemma projections."""
import itertools
import json
import re
from pathlib import Path

import numpy as np

from gemma_lora.chat import read_prompt_template


LORA_MODULES = {  # PEFT's module names -> where keras-hub's Gemma decoder blocks keep that projection
    "q_proj": ("attention", "query_dense"), "k_proj": ("attention", "key_dense"),
    "v_proj": ("attention", "value_dense"), "o_proj": ("attention", "output_dense"),
    "gate_proj": ("gating_ffw",), "up_proj": ("gating_ffw_2",), "down_proj": ("ffw_linear",),
}
KERAS_ADAPTER, PEFT_CONFIG, PEFT_WEIGHTS = "adapter.lora.h5", "adapter_config.json", "adapter_model.safetensors"
PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
DEFAULT_LORA_MODULES = ("q_proj", "v_proj")  # what keras-hub's enable_lora and PEFT's Gemma default train


def parse_lora_modules(spec):
    """--lora-modules: PEFT's projection names, comma-separated, or all-linear for every one; in
    LORA_MODULES' order."""
    names = set(LORA_MODULES) if spec.strip() == "all-linear" else {m.strip() for m in spec.split(",") if m.strip()}
    unknown = sorted(names - set(LORA_MODULES))
    if unknown or not names:
        raise ValueError(f"{','.join(unknown) or 'none given'}: choose from {','.join(LORA_MODULES)}, or all-linear")
    return [m for m in LORA_MODULES if m in names]


def keras_lora_scale(model_dir):
    """alpha / rank of a train_local.py adapter, from its training.json (the .lora.h5 keeps only the rank);
    1.0, keras-hub's own scale, for a run that recorded no alpha."""
    record = Path(model_dir) / "training.json"
    args = json.loads(record.read_text()).get("args", {}) if record.is_file() else {}
    return args["lora_alpha"] / args["lora_rank"] if args.get("lora_alpha") else 1.0


class AdapterError(Exception):
    """An adapter that cannot go on this base (or into this server now), said in one line."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


def lora_layer(backbone, index, module):
    layer = backbone.transformer_layers[index]
    for attribute in LORA_MODULES[module]:
        layer = getattr(layer, attribute)
    return layer


def kernel_axes(equation):
    """(input axes, output axes) of an EinsumDense kernel, as positions in its shape."""
    inputs, output = equation.split("->")
    x, kernel = inputs.split(",")
    ins = [i for i, c in enumerate(kernel) if c in x and c not in output]
    outs = [i for i, c in enumerate(kernel) if c in output and c not in x]
    if len(ins) + len(outs) != len(kernel) or not outs or outs[-1] != len(kernel) - 1:
        raise AdapterError(f"a kernel of equation {equation} cannot take a LoRA adapter")
    return ins, outs


def lora_equations(equation):
    """Two einsums for x -> x·down -> ·up, from the layer's own equation."""
    inputs, output = equation.split("->")
    x, kernel = inputs.split(",")
    ins, outs = kernel_axes(equation)
    r = next(c for c in "rzyxwvuqpo" if c not in equation)
    k_in, k_out = "".join(kernel[i] for i in ins), "".join(kernel[i] for i in outs)
    kept = "".join(c for c in x if c not in k_in)
    return f"{x},{k_in}{r}->{kept}{r}", f"{kept}{r},{r}{k_out}->{output}"


def lora_kernel_shapes(backbone):
    """{(layer, module): (kernel shape, equation)} of every projection an adapter may target; read
    before quantizing, which packs some kernels into other shapes."""
    return {(i, m): (tuple(lora_layer(backbone, i, m).kernel.shape), lora_layer(backbone, i, m).equation)
            for i in range(len(backbone.transformer_layers)) for m in LORA_MODULES}


def keras_factors_to_peft(a, b, shape, equation):
    """Keras's LoRA factors (A: kernel[:-1] + (r,), B: (r, kernel[-1])) as PEFT's (down, up). B is shared
    over the output axes before the last (query's heads), so those multiply the rank: exact, not fitted."""
    ins, outs = kernel_axes(equation)
    extra, r = outs[:-1], b.shape[0]
    e = int(np.prod([shape[i] for i in extra]))
    down = np.transpose(a, ins + extra + [a.ndim - 1]).reshape(int(np.prod([shape[i] for i in ins])), e * r)
    up = np.einsum("ef,kj->ekfj", np.eye(e, dtype=b.dtype), b).reshape(e * r, e * shape[-1])
    return down.astype(np.float32), up.astype(np.float32)


def read_keras_adapter(h5_path, backbone, shapes):
    """train_local.py's adapter.lora.h5 (keyed by index among the backbone's layers that have weights) as
    {(layer, module): (down, up)}."""
    import h5py
    layers = [layer for layer in backbone._flatten_layers(include_self=False) if layer.weights]
    where = {id(lora_layer(backbone, i, m)): (i, m) for i, m in shapes}
    factors = {}
    with h5py.File(h5_path, "r") as f:
        for index, group in f["lora"].items():
            if index == "vars":
                continue
            if not index.isdigit() or int(index) >= len(layers) or id(layers[int(index)]) not in where:
                raise AdapterError(f"its layer {index} is not a projection of this base: trained for another model")
            key = where[id(layers[int(index)])]
            a, b = np.asarray(group["vars"]["lora_kernel_a"]), np.asarray(group["vars"]["lora_kernel_b"])
            shape, equation = shapes[key]
            if a.shape[:-1] != shape[:-1] or b.shape != (a.shape[-1], shape[-1]):
                raise AdapterError(f"layers.{key[0]}.{key[1]} is {a.shape} x {b.shape}, the base's kernel is "
                                   f"{shape}: trained for another model")
            factors[key] = keras_factors_to_peft(a, b, shape, equation)
    return factors


def read_peft_adapter(path, shapes):
    """A Hugging Face PEFT LoRA dir: scale lora_alpha/r (alpha/sqrt(r) with use_rslora), per-module
    rank and alpha patterns honoured."""
    import math
    from safetensors.numpy import load_file
    config = json.loads((path / PEFT_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')} is not LORA")
    for field, fine in (("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(field, fine) != fine:
            raise AdapterError(f"{field}={config[field]} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']} is not supported: only bias='none'")
    tensors = load_file(str(path / PEFT_WEIGHTS))
    pairs = {}
    for name, tensor in tensors.items():
        match = PEFT_KEY.search(name)
        if match is None or match[2] not in LORA_MODULES:
            raise AdapterError(f"it targets {name}, which this server cannot apply (only "
                               f"{', '.join(LORA_MODULES)} of the decoder layers)")
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    factors = {}
    for key, pair in pairs.items():
        if key not in shapes:
            raise AdapterError(f"it has layers.{key[0]}.{key[1]}, the base has {len(shapes) // len(LORA_MODULES)} "
                               "layers: trained for another model")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layers.{key[0]}.{key[1]} lacks lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"].astype("float32"), pair["B"].astype("float32")
        shape, equation = shapes[key]
        ins, outs = kernel_axes(equation)
        n_in, n_out = math.prod(shape[i] for i in ins), math.prod(shape[i] for i in outs)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape != (n_out, a.shape[0]):
            raise AdapterError(f"layers.{key[0]}.{key[1]} is {list(b.shape)} x {list(a.shape)}, the base's "
                               f"projection is [{n_out}, {n_in}]: trained for another model")
        r = a.shape[0]
        alpha = next((v for k, v in (config.get("alpha_pattern") or {}).items() if re.search(rf"(^|\.){k}$",
                     f"layers.{key[0]}.{key[1]}")), config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        factors[key] = (a.T.copy(), (b * scale).T.copy())
    return factors


def adapter_kind(path):
    """"keras" for a train_local.py output dir, "peft" for a PEFT LoRA dir; AdapterError otherwise."""
    if not path.is_dir():
        raise AdapterError(f"{path}: no such directory")
    if (path / KERAS_ADAPTER).is_file():
        return "keras"
    if (path / PEFT_CONFIG).is_file() and (path / PEFT_WEIGHTS).is_file():
        return "peft"
    raise AdapterError(f"{path} has neither {KERAS_ADAPTER} (train_local.py's output) nor "
                       f"{PEFT_CONFIG} + {PEFT_WEIGHTS} (a PEFT LoRA)")


def read_adapter(name, path, backbone, shapes, vocabulary):
    """An Adapter from a train_local.py output dir or a PEFT dir, checked against the base."""
    path = Path(path)
    kind = adapter_kind(path)
    try:
        if kind == "keras":  # PEFT's form keeps the scale folded into `up`; the .h5 has none, its record does
            scale = keras_lora_scale(path)
            factors = {key: (down, up * scale) for key, (down, up) in
                       read_keras_adapter(path / KERAS_ADAPTER, backbone, shapes).items()}
        else:
            factors = read_peft_adapter(path, shapes)
    except AdapterError:
        raise
    except Exception as e:  # a truncated or foreign file: one line, not a failed start-up or a 500
        raise AdapterError(f"cannot read it: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
    if not factors:
        raise AdapterError("it holds no LoRA weights")
    template = read_prompt_template(path, vocabulary) if (path / "training.json").is_file() else None
    return Adapter(name, str(path), kind, factors, template)


ADAPTER_IDS = itertools.count(1)  # 0 is the base, in prefix-cache keys


class Adapter:
    """One loaded adapter: its PEFT-form factors, the template it was trained with (if recorded), its slot."""

    def __init__(self, name, path, kind, factors, template):
        self.name, self.path, self.kind, self.factors, self.template = name, path, kind, factors, template
        self.uid = next(ADAPTER_IDS)  # unique for the life of the process: a reloaded adapter is a new one
        self.rank = max(down.shape[1] for down, _ in factors.values())
        self.modules = sorted({m for _, m in factors})
        self.nbytes = sum(down.nbytes + up.nbytes for down, up in factors.values())
        self.slot = None


def describe(adapter):
    return (f"{adapter.kind} LoRA from {adapter.path}, rank {adapter.rank} on {','.join(adapter.modules)}, "
            f"{adapter.nbytes / 2**20:,.2f} MiB")
