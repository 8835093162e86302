#!/usr/bin/env bash
# The same client and workload as vllm_cpu_bench.sh, against pagedserve: start `pagedserve up` from
# a checkout's .venv (default: this repository's, which `make serve` sets up) on the peer's tiny model, run vLLM's own `vllm bench serve` client
# (from the peer venv) against it, save the figures, stop the stack by its process group.
#
#   bash ours_bench.sh [--checkout DIR] [--port 8021] [--request-rate 4|inf] [--num-prompts 64]
#        [--input-len 128] [--output-len 128] [--model-dir DIR] [--result-dir DIR] [--extra "pagedserve up flags"]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PEER_DIR=${PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/peer-vllm}
VENV=${PEER_VENV:-$PEER_DIR/venv}
CHECKOUT=$(cd "$HERE/../.." && pwd); PORT=8021; RATE=4; NUM=64; IN=128; OUT=128; EXTRA=""; MODEL_DIR=""; RESULT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --checkout) CHECKOUT=$2; shift 2;; --port) PORT=$2; shift 2;; --request-rate) RATE=$2; shift 2;;
    --num-prompts) NUM=$2; shift 2;; --input-len) IN=$2; shift 2;; --output-len) OUT=$2; shift 2;;
    --extra) EXTRA=$2; shift 2;; --model-dir) MODEL_DIR=$2; shift 2;; --result-dir) RESULT_DIR=$2; shift 2;; *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
[ -x "$CHECKOUT/.venv/bin/pagedserve" ] || { echo "no $CHECKOUT/.venv/bin/pagedserve: run make serve (or make test) there first, or give --checkout DIR" >&2; exit 2; }
MODEL_DIR=${MODEL_DIR:-$PEER_DIR/tiny-llama}
[ -f "$MODEL_DIR/config.json" ] || PEER_DIR=$PEER_DIR "$VENV/bin/python" "$HERE/make_tiny_model.py" "$MODEL_DIR"
RESULT_DIR=${RESULT_DIR:-$PEER_DIR/results}; mkdir -p "$RESULT_DIR"
tag=ours-rate$RATE-$(date +%Y%m%d-%H%M%S)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s.%N)
# shellcheck disable=SC2086
setsid "$CHECKOUT/.venv/bin/pagedserve" up --model "$MODEL_DIR" --port "$PORT" $EXTRA > "$RESULT_DIR/$tag-server.log" 2>&1 < /dev/null &
SPID=$!
cleanup() { kill -TERM -- -"$SPID" 2>/dev/null || true; sleep 5; kill -KILL -- -"$SPID" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  kill -0 "$SPID" 2>/dev/null || { echo "server exited; log:"; tail -20 "$RESULT_DIR/$tag-server.log"; exit 1; }
  sleep 1
done
t_ready=$(python3 -c "import time;print(round(time.time()-$t0,1))")
name=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python3 -c "import json,sys;print(json.load(sys.stdin)['data'][0]['id'])")
rss=$(ps -o rss= -g "$SPID" | awk '{s+=$1} END {printf "%.2f", s/1048576}')
echo "[ours_bench] ready after ${t_ready}s, model id $name, RSS ${rss} GiB"
timeout 900 "$VENV/bin/vllm" bench serve --backend vllm --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
  --model "$name" --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len "$IN" --random-output-len "$OUT" \
  --ignore-eos --num-prompts "$NUM" --request-rate "$RATE" --seed 0 --percentile-metrics ttft,tpot,itl,e2el \
  --metric-percentiles 50,90,99 --ready-check-timeout-sec 60 --disable-tqdm --save-result --result-dir "$RESULT_DIR" \
  --result-filename "bench-$tag.json" 2>&1 | tail -40
