#!/usr/bin/env bash
# The whole server once on a GPU backend (benchmarks/on_gpu.sh's `server` step): a quantized
# model stays quantized (as on Metal), python -m lmsp_mlx.serve answers over LMSP and /v1,
# and a batched --kv-bits decode step runs with the kernels in auto mode. $1: where to write.
set -uo pipefail
out=${1:-gpu-out}
port=18765
model=models/SmolLM2-135M-Instruct
if [ ! -f "$model/config.json" ]; then  # not carried: a tiny quantized MoE model, built here
    model=/tmp/tiny-moe
    python3 -c "from pathlib import Path; from tests.tiny_model import build_tiny_moe_model; build_tiny_moe_model(Path('$model'), 'qwen3_moe')"
fi
LMSP_KERNELS=auto python3 -m lmsp_mlx.serve --model "$model" --model-id m --kv-bits 4 --kv-group-size 32 --port $port \
    --no-kv-disk --store /tmp/store.sqlite3 --state-key-file /tmp/state.key >/tmp/server.log 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf localhost:$port/healthz >/dev/null && break; sleep 1; done
ask='"input": "Say hello", "max_output_tokens": 16, "temperature": 0'
echo "== listing"; curl -s localhost:$port/lmsp/v1/models/m | python3 -c "import json,sys; d=json.load(sys.stdin); print({k: d.get(k) for k in ('backend', 'quantization', 'kv_cache', 'loaded')})"
echo "== LMSP"; curl -s localhost:$port/lmsp/v1/responses -H 'Content-Type: application/json' -d "{\"model\": \"m\", $ask}" | head -c 400; echo
echo "== /v1/responses"; curl -s localhost:$port/v1/responses -H 'Content-Type: application/json' -d "{\"model\": \"m\", $ask}" | head -c 400; echo
echo "== chat"; curl -s localhost:$port/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}' | head -c 400; echo
echo "== 4 concurrent completions, 200 tokens each"
for i in 1 2 3 4; do
    curl -s localhost:$port/v1/completions -H 'Content-Type: application/json' \
        -d "{\"model\": \"m\", \"prompt\": \"Once upon a time $i\", \"max_tokens\": 200, \"ignore_eos\": true, \"temperature\": 0}" \
        -o /tmp/c$i.json &
done
seen=0
for _ in $(seq 100); do
    n=$(curl -s localhost:$port/metrics | awk '/^lmsp_batch_sequences /{print $2}')
    [ "${n:-0}" -gt "$seen" ] && seen=$n
    sleep 0.05
done
wait $(jobs -p | grep -v "^$pid$") 2>/dev/null
echo "most sequences in one batch: $seen"
for i in 1 2 3 4; do python3 -c "import json; print(json.load(open('/tmp/c$i.json'))['usage'])"; done
kill $pid; wait $pid
echo "== server log (kernels, checks, steps outside the batch)"
grep -E "kernel|outside the batch|Traceback|error" /tmp/server.log | head -40
cp /tmp/server.log "$out/server.log"
