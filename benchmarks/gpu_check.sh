#!/usr/bin/env bash
# GPU checks for flashckpt, in one call, about 4-5 minutes on an H200. From the repo root:
#
#     OUT=/path/to/results bash benchmarks/gpu_check.sh
#
# Writes to $OUT (default ./out/gpu): gpu_check.log (everything), summary.txt (one rc line per
# part), pytest_gpu.log, save_bench.{json,log}, loop_bench.{json,log}, memory_accuracy.{json,log}.
# Each part runs under its own `timeout`, so one failure or hang does not stop the others.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu}"
PY="${PYTHON:-python}"
BENCH_DIR="${BENCH_DIR:-/tmp/flashckpt-gpu-bench}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

echo "== $(date -Is) $(hostname) nproc=$(nproc)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
df -h "$(dirname "$BENCH_DIR")" | tail -1
timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  || { echo "torch does not import; stopping"; exit 1; }
"$PY" -c "import xxhash, zstandard" 2>/dev/null || timeout 90 "$PY" -m pip install -q xxhash zstandard
"$PY" -c "import flashckpt" 2>/dev/null || timeout 90 "$PY" -m pip install -q -e . --no-deps

part() {  # part NAME SECONDS CMD...
  local name=$1 secs=$2
  shift 2
  echo "== $name (timeout ${secs}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc (${secs}s limit, took $((SECONDS - t0))s)" | tee -a "$OUT/summary.txt"
  tail -n 45 "$OUT/$name.log"
}

part pytest_gpu 50 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/
part save_bench 100 "$PY" benchmarks/save_bench.py --gpu --size-gb 1.2 --repeats 2 \
  --parts save,rss,gil --dir "$BENCH_DIR" --out "$OUT/save_bench.json"
part loop_bench 80 "$PY" benchmarks/loop_bench.py --gpu --dir "$BENCH_DIR" --out "$OUT/loop_bench.json"
part memory_accuracy 60 "$PY" benchmarks/memory_accuracy.py --time-limit-s 45 \
  --out "$OUT/memory_accuracy.json"
rm -rf "$BENCH_DIR"
echo "== done $(date -Is)"
cat "$OUT/summary.txt"
