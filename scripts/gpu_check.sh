#!/usr/bin/env bash
# One command for a session that draws a GPU machine (device tool `run`): install fastpipe, run the
# CUDA tests, the plain suite and the GPU benchmarks, and leave logs and JSON results under $OUT.
#
#   bash scripts/gpu_check.sh            # all stages (about 20 min: split it over calls, see below)
#   bash scripts/gpu_check.sh tests      # install + `pytest -m cuda` (up to 330 s), then the rest of the
#                                        # suite in the time left (one call for issue 15's acceptance)
#   bash scripts/gpu_check.sh cuda       # install + `pytest -m cuda`
#   bash scripts/gpu_check.sh cuda tests/test_cuda_processor_gpu.py -x   # tests/cuda/plain: more pytest arguments
#   bash scripts/gpu_check.sh plain      # install + `pytest -m "not cuda"` (what CI runs, on this machine)
#   bash scripts/gpu_check.sh bench      # install + the GPU benchmark suites (bench/report.py)
#   bash scripts/gpu_check.sh fused      # install + the fused-kernel crossover (bench/bench_fused_kernels.py):
#                                        # fused.json, and in fused.log the smallest M where fused wins, to set
#                                        # fastpipe.kernels.fused_is_faster from, the % of bf16 peak and the
#                                        # targets per row (not part of `all`)
#   bash scripts/gpu_check.sh tune       # the fused kernels' launch configs per shape (--tune, M 1024 and 8192):
#                                        # tune.json and tuned_configs.json, to commit as
#                                        # fastpipe/kernels/tuned_configs.json where it beat the heuristic
#   bash scripts/gpu_check.sh runtime    # issue 16, table 1: bench/report_runtime.py (decode and prefill, batch
#                                        # 1/8/32: replay vs streams vs region vs the unsplit model) -> runtime.json;
#                                        # batch 1 first; it starts no case that would end past 480 s (by the
#                                        # longest so far): pass e.g. `--batches 32` to go on
#   bash scripts/gpu_check.sh serving --sections 1       # issue 16, table 2: bench/report_serving.py
#   bash scripts/gpu_check.sh serving --sections 2,3,4   # (decode tokens/s vs HF generate; continuous
#                                        # batching; memory per token; buckets' weights) -> serving.json
#   bash scripts/gpu_check.sh memory --sections load,memory   # issue 16, table 4: bench/report_memory.py
#   bash scripts/gpu_check.sh memory --sections pool          # (load vs safetensors onto the GPU, measured
#                                        # vs planned peak, 3 buckets' graph pool) -> memory.json
# A session with a device runs, one call each: tests (or cuda and plain apart, if the cuda tests
# need more than 330 s), fused, tune where the kernels miss their targets, then runtime, serving x2,
# memory x2 (issue 16), in a later session if the 30 device minutes run out.
# Stages from `cuda` on pass further arguments on (to pytest, or to the report script).
#
# Each device call may run 10 minutes at most, so a session runs the stages as separate calls
# (the machine stays warm for 30 s between calls; the install is repeated, it takes seconds).
# The machine has python3 with torch, triton, safetensors, pytest, pytest-benchmark and no
# network (its image also had transformers, hypothesis and pytest-xdist on 2026-11-17; each is
# checked here). Tests needing what is absent are left out and listed in $OUT/summary.txt; with
# pytest-xdist the plain suite runs on 8 workers and the cuda tests on 4 (files kept whole per
# worker); with pytest-timeout no test may run past 180 s. The install uses `python3 -m pip`. At most 8 files
# come back from $OUT; this writes: machine.txt, summary.txt, <stage>.log per stage, cuda.xml,
# plain.xml, bench.json, fused.json, tune.json, tuned_configs.json, runtime.json, serving.json,
# memory.json (one stage a call stays well under 8).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
stage="${1:-all}"
shift $(( $# > 0 ? 1 : 0 ))
extra=("$@")                         # cuda and plain stages: passed on to pytest (files, -k, -x, ...)
summary="$OUT/summary.txt"
case "$stage" in
  all|tests|cuda|plain|bench|fused|tune|runtime|serving|memory) ;;
  *) echo "gpu_check.sh: unknown stage '$stage' (all, tests, cuda, plain, bench, fused, tune, runtime, serving, memory)" | tee -a "$summary"
     exit 2 ;;
esac

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 - <<'EOF'
import platform, torch
try:
    import triton
    tv = triton.__version__
except Exception as e:  # noqa: BLE001
    tv = f"unavailable ({e})"
print(f"python {platform.python_version()} torch {torch.__version__} cuda {torch.version.cuda} triton {tv}")
print(f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
} > "$OUT/machine.txt" 2>&1

if python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/install.log" 2>&1; then
  rm -f "$OUT/install.log"
else   # (an old setuptools without `wheel`, say): run from the source tree rather than lose the call
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "install failed (see install.log): running from the source tree; the console-script tests fail" \
    | tee -a "$summary"
fi

missing=()
python3 -c "import hypothesis" 2>/dev/null || missing+=(--ignore=tests/test_fuzz.py)
python3 -c "import transformers" 2>/dev/null || echo "transformers absent: Hugging Face tests skip themselves" >> "$summary"
[ ${#missing[@]} -gt 0 ] && echo "left out (module absent on this machine): ${missing[*]}" >> "$summary"

run_stage() {  # name, timeout, command...
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s ($(tail -n 1 "$OUT/$name.log"))" | tee -a "$summary"
  return $rc
}

# A hung test (an NCCL collective waiting forever, say) must not eat the whole call: with
# pytest-timeout, a test past 180 s has its stacks dumped into the log and its process ended
# (thread method: it also ends a hang inside C++); under xdist a fresh worker takes the next file.
guard=()
python3 -c "import pytest_timeout" 2>/dev/null && guard=(--timeout 180 --timeout-method thread)
has_xdist=0
python3 -c "import xdist" 2>/dev/null && has_xdist=1

run_cuda() {  # limit: the cuda-marked tests; 4 workers share the GPU (the time goes to compiling, on the CPU)
  local workers=()
  [ $has_xdist = 1 ] && workers=(-n 4 --dist loadfile)
  run_stage cuda "$1" python3 -m pytest -m cuda -v -rs -p no:cacheprovider "${workers[@]}" "${guard[@]}" \
    --junitxml="$OUT/cuda.xml" "${missing[@]}" "${extra[@]}"
}
run_plain() {  # limit: the rest of the suite (the cuda stage runs the cuda-marked tests: together, all of it)
  local workers=()
  [ $has_xdist = 1 ] && workers=(-n 8 --dist loadfile)
  run_stage plain "$1" python3 -m pytest -q -m "not cuda" -p no:cacheprovider "${workers[@]}" "${guard[@]}" \
    --junitxml="$OUT/plain.xml" "${missing[@]}" "${extra[@]}"
}

rc=0
if [ "$stage" = tests ]; then   # both in one call: the cuda tests first, the plain suite in what is left
  run_cuda 330 || rc=1
  left=$(( 575 - SECONDS ))
  [ $left -lt 60 ] && left=60
  run_plain $left || rc=1
fi
if [ "$stage" = cuda ] || [ "$stage" = all ]; then
  run_cuda 540 || rc=1
fi
if [ "$stage" = plain ] || [ "$stage" = all ]; then
  run_plain 560 || rc=1
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  run_stage bench 560 python3 bench/report.py --suites examples,comm,kernels --out "$OUT/bench" || rc=1
  [ -f "$OUT/bench/results.json" ] && mv "$OUT/bench/results.json" "$OUT/bench.json"
  [ -f "$OUT/bench/report.md" ] && cat "$OUT/bench/report.md" >> "$OUT/bench.log"
  rm -rf "$OUT/bench"
fi
if [ "$stage" = fused ]; then
  run_stage fused 540 python3 bench/bench_fused_kernels.py --kernel both --check --budget-s 420 --json "$OUT/fused.json" \
    "${extra[@]}" || rc=1
  python3 bench/bench_fused_kernels.py --threshold "$OUT/fused.json" >> "$OUT/fused.log" 2>&1 || rc=1
fi
if [ "$stage" = tune ]; then
  run_stage tune 540 python3 bench/bench_fused_kernels.py --kernel both --tune --check --ms 1024,8192 --budget-s 420 \
    --json "$OUT/tune.json" "${extra[@]}" || rc=1
  python3 bench/bench_fused_kernels.py --write-tuned "$OUT/tuned_configs.json" "$OUT/tune.json" >> "$OUT/tune.log" 2>&1 || rc=1
fi
if [ "$stage" = runtime ]; then   # each script rewrites its JSON after every case/section: a cut-off run keeps them
  run_stage runtime 560 python3 bench/report_runtime.py --budget-s 480 --json "$OUT/runtime.json" "${extra[@]}" || rc=1
fi
if [ "$stage" = serving ]; then
  run_stage serving 560 python3 bench/report_serving.py --json "$OUT/serving.json" "${extra[@]}" || rc=1
fi
if [ "$stage" = memory ]; then
  run_stage memory 560 python3 bench/report_memory.py --json "$OUT/memory.json" "${extra[@]}" || rc=1
fi
exit $rc
