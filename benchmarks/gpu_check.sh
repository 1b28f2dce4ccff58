#!/usr/bin/env bash
# GPU checks for flashckpt, in one call, about 7-9 minutes on an H200. From the repo root:
#
#     OUT=/path/to/results bash benchmarks/gpu_check.sh
#
# Writes to $OUT (default ./out/gpu): gpu_check.log (everything), summary.txt (one rc line per
# part), pytest_gpu.log, save_bench.{json,log}, loop_bench.{json,log}, memory_accuracy.{json,log}, restore_bench.{json,log}.
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
# The device reaches no package index: wheels travel with the tree in .gpu_wheels (make gpu-wheels).
"$PY" -c "import xxhash, zstandard, pytest_timeout" 2>/dev/null \
  || timeout 90 "$PY" -m pip install -q --no-index --find-links .gpu_wheels xxhash zstandard pytest pytest-timeout
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import flashckpt; print('flashckpt', flashckpt.__version__)" || { echo "flashckpt does not import"; exit 1; }

PARTS="${PARTS:-pytest_gpu save_bench loop_bench memory_accuracy restore_bench}"  # a subset reruns only those
part() {  # part NAME SECONDS CMD...
  local name=$1 secs=$2
  shift 2
  case " $PARTS " in *" $name "*) ;; *) echo "== $name skipped (PARTS)"; return 0 ;; esac
  echo "== $name (timeout ${secs}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc (${secs}s limit, took $((SECONDS - t0))s)" | tee -a "$OUT/summary.txt"
  tail -n 45 "$OUT/$name.log"
}

# test_gpu_device.py: the GPU-path defects of issue 29 (per-device ordering, no device clones of
# a LoRA base, bounded fingerprints, pinned memory within the budget over 20 saves, .data
# writes, non_blocking copies into pinned state, restore on the user's stream, no context from
# the warm-up); the two-GPU layouts (state on cuda:1 with current device 0, a state across
# devices) skip with that reason on one GPU. -rs lists every skip in the log.
part pytest_gpu 120 "$PY" -m pytest -o addopts="" -m gpu -q -rs -p no:cacheprovider \
  tests/engine/save/test_gpu.py tests/engine/save/test_gpu_device.py tests/state/test_rng.py \
  tests/memory/test_prealloc_monitor.py
part save_bench 90 "$PY" benchmarks/save_bench.py --gpu --size-gb 1.2 --repeats 2 \
  --parts save,rss,gil --dir "$BENCH_DIR" --out "$OUT/save_bench.json"
part loop_bench 120 "$PY" benchmarks/loop_bench.py --gpu --dir "$BENCH_DIR" --out "$OUT/loop_bench.json"
part memory_accuracy 90 "$PY" benchmarks/memory_accuracy.py --time-limit-s 75 \
  --out "$OUT/memory_accuracy.json"
# restore throughput against this machine's memcpy and raw disk read (issue 17), 16 cores
mkdir -p "$BENCH_DIR/restore"
part restore_bench 100 "$PY" benchmarks/restore_bench.py --size 1GiB --repeats 2 \
  --dir "$BENCH_DIR/restore" --json "$OUT/restore_bench.json"
rm -rf "$BENCH_DIR"
echo "== done $(date -Is)"
cat "$OUT/summary.txt"
