"""Writes a random-weight Gemma in Hugging Face transformers layout, for offline tests and benchmarks.

    python3 scripts/make_tiny_gemma.py OUT_DIR [--hidden 64 --layers 2 ...]
    python3 scripts/make_tiny_gemma.py OUT_DIR --config gemma_2b    # gemma-2b's shapes, 2.5B random weights

OUT_DIR gets config.json ("model_type": "gemma"), model.safetensors and tokenizer.model: the same
files hf://google/gemma-2b has, so keras-hub's converter loads it along the very code path the real
model takes. The SentencePiece tokenizer is trained on our own sample data with Gemma's special ids
(<pad>=0, <eos>=1, <bos>=2, <unk>=3), byte fallback, and an identity normalizer so newlines survive.
"""
import argparse
import io
import json
import random
from pathlib import Path

import numpy as np
import sentencepiece as spm
from safetensors.numpy import save_file

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "dolly_sample.jsonl"
# hf://google/gemma-2b's config.json. Its tokenizer has 256,000 pieces; ours, trained on the sample data,
# far fewer: the embedding keeps the real row count (pad_vocab) so that the model costs what gemma-2b does.
CONFIGS = {"gemma_2b": dict(hidden=2048, layers=18, heads=8, kv_heads=1, head_dim=256, intermediate=16384,
                            pad_vocab=256000, dtype="float16")}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1, help="1, like gemma-2b")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-vocab", type=int, default=0, help="embedding rows at least this many (unused ids)")
    p.add_argument("--config", choices=sorted(CONFIGS), default=None,
                   help="take every shape from a real model's config instead (weights stay random)")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                   help="stored weights (float16 halves a large model's file; the converter casts on loading)")
    args = p.parse_args()
    for name, value in CONFIGS.get(args.config, {}).items():
        setattr(args, name, value)
    return args


def corpus_lines():
    for line in SAMPLE_DATA.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for field in ("instruction", "context", "response"):
            text = record[field]
            if text:
                yield text
    yield "Instruction:\n\nContext:\n\nResponse:\n"


def train_tokenizer(out_dir, vocab_size):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(corpus_lines())),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        byte_fallback=True,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_by_whitespace=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n", "<start_of_turn>", "<end_of_turn>"],
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size()


def random_weights(cfg, rng, dtype):
    h, heads, kv, hd, ff = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                            cfg["head_dim"], cfg["intermediate_size"])

    # float16 storage means a large model: drawn in float32, twice as fast. float32 models keep the float64
    # draws the tests' expectations were measured on.
    draw = np.float32 if dtype == np.float16 else np.float64

    def dense(rows, cols):
        return (rng.standard_normal((rows, cols), draw) * (1.0 / np.sqrt(cols))).astype(dtype)

    def norm():
        return (rng.standard_normal(h) * 0.1).astype(dtype)

    weights = {"model.embed_tokens.weight": dense(cfg["vocab_size"], h), "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": dense(heads * hd, h),
            p + "self_attn.k_proj.weight": dense(kv * hd, h),
            p + "self_attn.v_proj.weight": dense(kv * hd, h),
            p + "self_attn.o_proj.weight": dense(h, heads * hd),
            p + "mlp.gate_proj.weight": dense(ff, h),
            p + "mlp.up_proj.weight": dense(ff, h),
            p + "mlp.down_proj.weight": dense(h, ff),
        }
    return weights


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    vocab_size = train_tokenizer(out_dir, args.vocab_size)
    config = {
        "architectures": ["GemmaForCausalLM"],
        "model_type": "gemma",
        "vocab_size": max(vocab_size, args.pad_vocab),
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "gelu",
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "torch_dtype": args.dtype,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_weights(config, np.random.default_rng(args.seed), np.dtype(args.dtype))
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(w.size for w in weights.values())
    print(f"wrote a random Gemma to {out_dir}: vocab {config['vocab_size']} (tokenizer {vocab_size}), "
          f"{n_params / 1e6:.2f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
