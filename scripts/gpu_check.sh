#!/usr/bin/env bash
# Run fastpipe's GPU checks on a machine with a CUDA GPU: install fastpipe from this checkout, run the
# named stages one after another, and leave their logs and JSON results under $OUT (default: gpu_out in
# the checkout): machine.txt (GPU, driver, python, torch, CUDA, triton, cores), summary.txt (a line per
# stage: its exit status, its time and its last line of output; the test counts), <stage>.log, and each
# stage's files:
#
#   bash scripts/gpu_check.sh [tests]     # the whole suite, once (`pytest`; its cuda-marked part is `pytest
#                                         # -m cuda`), files with cuda tests first; results.jsonl holds a line
#                                         # per test as it ends, and summary.txt the counts for both, every
#                                         # failure with its message, the slowest tests and a rerun line
#   bash scripts/gpu_check.sh tests tests/test_fusion_gpu.py 'tests/x.py::t'   # (tests/cuda/plain: more
#                                         # pytest arguments; the rerun line of a summary is such a call)
#   bash scripts/gpu_check.sh cuda        # `pytest -m cuda` only;  plain: `pytest -m "not cuda"` only
#   bash scripts/gpu_check.sh fused       # fused kernels: bench/bench_fused_kernels.py -> fused.json; in
#                                         # fused.log the smallest M where fused wins and whether the shipped
#                                         # rule agrees, % of bf16 peak, targets; fusion_measured.json: the
#                                         # rule's table from this run, this GPU's points only (docs/kernel-tuning.md
#                                         # says how to merge it with bench/measured's runs and ship it).
#                                         # Cases go dim by dim (the grid at dim 0, row blocks, then at dim 1,
#                                         # column blocks; `--dim 0` for one), then shape by shape, both kernels
#                                         # and every M per shape, so a run cut short has whole crossovers:
#                                         # pass --nk 8192 (or --dim 1) to go on. Then
#                                         # fused_profile.log: M 16 and 1024 at N = K 4096 again, each
#                                         # variant's kernels profiled (--profile: time busy and covered, top
#                                         # kernels), where the stage's call has 40 s left
#   bash scripts/gpu_check.sh tune        # launch configs per shape (--tune, M 1024 and 8192): tune.json and
#                                         # tuned_configs.json (commit as fastpipe/kernels/tuned_configs.json
#                                         # where it beat the heuristic); `tune --ms 16,128`: decode sizes,
#                                         # with the split-K candidates (docs/kernels.md); `tune --dim 1`:
#                                         # the column-block launches (dim 0 unless given)
#   bash scripts/gpu_check.sh shapes      # `fastpipe tune` at a real model's shapes (bench/tune_model_shapes.py:
#                                         # Llama-3-8B's MLP, tp 2, M 16 to 8192) -> shapes.json: per shape the
#                                         # fused and unfused times, and whether the shipped grid's rule guessed
#                                         # right; its tuned table's entries too (`--d 8192 --h 28672 --n 4`: 70B)
#   bash scripts/gpu_check.sh runtime     # decode step: bench/report_runtime.py -> runtime.json
#                                         # (batch 1 first; `--batches 8` or `--batches 32` goes on)
#   bash scripts/gpu_check.sh serving --sections 1       # greedy decode: bench/report_serving.py
#   bash scripts/gpu_check.sh serving --sections 2,3,4   # -> serving.json
#   bash scripts/gpu_check.sh memory --sections load,memory   # load and memory: bench/report_memory.py
#   bash scripts/gpu_check.sh memory --sections pool          # -> memory.json (written after each row)
#   bash scripts/gpu_check.sh bench       # the pytest-benchmark report (bench/report.py) -> bench.json
#   bash scripts/gpu_check.sh real --geometry llama-3.1-8b --tp 2,1 --batches 1,8,32 --prompt-lens 512,2048
#                                         # real size: bench/report_real_size.py -> real.json (the checkpoint
#                                         # written under GPU_CHECK_REAL_DIR, default /tmp/fastpipe_real, once)
#   bash scripts/gpu_check.sh scale --checkpoint /tmp/fastpipe_real/llama-3.1-8b --sections load --device cuda:0
#                                         # build and load at scale: bench/report_scale.py -> scale.json
# Every stage passes further arguments on (to pytest, or to the report script).
#
# Several stages in one call, one after another, their arguments split at each lone '+' (a first word
# 'a+b+c' is stages a, b and c, the arguments after it c's):
#   GPU_CHECK_CALL_S=540 bash scripts/gpu_check.sh tests+fused+runtime
#   GPU_CHECK_CALL_S=540 bash scripts/gpu_check.sh tune+shapes
#   bash scripts/gpu_check.sh fused --nk 8192 + runtime --batches 1
# A stage runs at most once a call (an unknown or repeated stage: exit status 2, nothing run). A stage
# that fails does not stop the next: each stage's line in summary.txt says how it ended, and the exit
# status is 1 if any failed (or CUDA is unavailable).
#
# Time. GPU_CHECK_CALL_S (default 360) is a wall-clock limit, in seconds, for the whole call, counted
# from the script's start, install included. The stages share it: each gets what the ones before it
# left, less a margin for what follows it; each stops starting work in time (the bench scripts'
# --budget-s) and at its limit gets SIGINT (SIGKILL 20 s later), and keeps what it measured: pytest and
# the bench scripts write their results as they go. A stage after the first starts only with
# GPU_CHECK_STAGE_MIN_S (default 60) seconds left ("not started" in the summary, and the call is red).
# Whatever runs this script may give it a limit a little above GPU_CHECK_CALL_S as a backstop.
#
# Files: machine.txt, summary.txt, <stage>.log, results.jsonl (tests stages), and the stages' JSON
# (bench.json, fused.json + fusion_measured.json, tune.json + tuned_configs.json, shapes.json, runtime.json,
# serving.json, memory.json, real.json, scale.json). Where the stages leave more than 8 files, the logs are
# packed into logs.tar.gz (then, where there are still more than 8, all but summary.txt into all.tar.gz).
# scripts/ingest_gpu_check.py brings such a folder into the repository.
#
# Needs python3 with torch, triton, safetensors, pytest and pytest-benchmark; no network. Optional, each
# checked here: transformers (without it the Hugging Face tests skip themselves), hypothesis (without it
# tests/test_fuzz.py is left out, and summary.txt lists it), pytest-xdist (the tests run on (cores - 2)
# workers, at most 14, spread test by test: --dist worksteal; loadfile, each file whole on one worker,
# with pytest-xdist < 3.2), pytest-timeout (a test running past 300 s fails, its stacks in results.jsonl,
# and the rest go on). Where the install fails (install.log), the stages run from the source tree.
# GPU_CHECK_NO_INSTALL=1 skips the install (the CPU tests of this script use it); GPU_CHECK_PLAN=1 prints
# each stage the call would run, with its arguments, and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
CALL_S="${GPU_CHECK_CALL_S:-360}"
STAGE_MIN_S="${GPU_CHECK_STAGE_MIN_S:-60}"
summary="$OUT/summary.txt"
STAGES="tests, cuda, plain, bench, fused, tune, shapes, runtime, serving, memory, real, scale"
# the call's stages: the arguments split at each lone '+' (and a first word 'a+b+c' into a, b, c, the
# arguments after it going to c: `tests+serving --sections 1`); each stage's own arguments stored
# quoted, to be eval'ed
[ $# -eq 0 ] && set -- tests
if [[ "$1" == *+* ]]; then
  IFS='+' read -r -a words <<< "$1"
  [[ "$1" == *+ ]] && words+=("")                          # 'tests+': an empty last stage, refused below
  shift
  rest=("$@")
  set -- "${words[0]}"
  for w in "${words[@]:1}"; do set -- "$@" + "$w"; done
  set -- "$@" "${rest[@]}"
fi
names=() args=() cur=""
for w in "$@"; do
  if [ "$w" = "+" ]; then
    names+=("${cur%% *}"); args+=("${cur#* }"); cur=""
  elif [ -z "$cur" ]; then
    cur="$w "
  else
    cur+="$(printf '%q ' "$w")"
  fi
done
names+=("${cur%% *}"); args+=("${cur#* }")
seen=" "
for name in "${names[@]}"; do
  case "$name" in
    tests|cuda|plain|bench|fused|tune|shapes|runtime|serving|memory|real|scale) ;;
    *) echo "gpu_check.sh: unknown stage '$name' ($STAGES)" | tee -a "$summary"
       exit 2 ;;
  esac
  if [[ "$seen" == *" $name "* ]]; then   # a second one would overwrite the first's files
    echo "gpu_check.sh: stage '$name' twice in one call: one call runs a stage once (give it all its arguments)" \
      | tee -a "$summary"
    exit 2
  fi
  seen+="$name "
done
if [ "${GPU_CHECK_PLAN:-0}" = 1 ]; then      # what the call would run, a line per stage, and nothing else
  for i in "${!names[@]}"; do a="${args[$i]% }"; echo "${names[$i]}${a:+: $a}"; done
  exit 0
fi

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
  echo "cores $(nproc)"
} > "$OUT/machine.txt" 2>&1

if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
  :
elif python3 -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/install.log" 2>&1; then
  rm -f "$OUT/install.log"
else   # (an old setuptools without `wheel`, say): run from the source tree rather than lose the call
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "install failed (see install.log): running from the source tree; the console-script tests fail" \
    | tee -a "$summary"
fi
cuda_ok=1
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || {
  cuda_ok=0
  echo "CUDA unavailable on this machine: the cuda tests skip, and the stage fails" | tee -a "$summary"; }

left() {  # seconds left of the call's time limit, less a margin for what follows the stage
  echo $(( CALL_S - SECONDS - $1 ))
}

run_stage() {  # name, limit (s), command...: SIGINT at the limit (pytest and the bench scripts still
  local name="$1" limit="$2"     # write their results), SIGKILL 20 s later
  shift 2
  [ "$limit" -lt 30 ] && limit=30
  local t0=$SECONDS
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s of $limit ($(tail -n 1 "$OUT/$name.log"))" | tee -a "$summary"
  return $rc
}

run_pytest() {  # name, marker expression or "": one pytest over the suite (or the extra arguments)
  local name="$1" marker="$2"
  # --results-jsonl=PATH in one word: as two, pytest takes PATH for a file argument when it decides whether
  # to use testpaths (the option comes from a -p plugin), and then collects bench/ too
  local args=(--cuda-first --results-jsonl="$OUT/results.jsonl" -q -rfE -p no:cacheprovider)
  [ -n "$marker" ] && args+=(-m "$marker")
  if python3 -c "import xdist" 2>/dev/null; then
    local n=$(( $(nproc) - 2 ))
    [ $n -gt 14 ] && n=14
    [ $n -lt 1 ] && n=1
    # worksteal (pytest-xdist >= 3.2): each worker starts on its share of the tests in order (a file's
    # tests mostly together, so module fixtures are mostly built once), and a worker that runs out takes
    # half of the longest queue. Under loadfile a file went whole to one worker, and on 2026-11-26 (H200,
    # 14 workers) test_cli.py's 223 s on one worker made the whole run's 256 s, of 1554 s of tests.
    local dist=loadfile
    python3 -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" \
      2>/dev/null && dist=worksteal
    args+=(-n "$n" --dist "$dist")
  fi
  # pytest-timeout's signal method fails the test and the worker goes on; its thread method ends the
  # worker (os._exit), and on 2026-11-26 four workers ended so under a 120 s cap while 14 workers
  # shared 16 cores, then pytest-xdist's replacement of them stopped the run (KeyError, INTERNALERROR)
  python3 -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 300 --timeout-method signal)
  python3 -c "import hypothesis" 2>/dev/null || {
    args+=(--ignore=tests/test_fuzz.py)
    echo "left out (hypothesis absent on this machine): tests/test_fuzz.py" >> "$summary"; }
  python3 -c "import transformers" 2>/dev/null \
    || echo "transformers absent: the Hugging Face tests skip themselves" >> "$summary"
  # The workers fill the cores: one torch thread and one inductor compile thread each (by default each
  # takes every core, 14 x 16 threads on 16 cores, and CPU-compiling tests ran past 100 s)
  # tests.run_log: pytest with the plugin, interrupted by SIGINT even where the call started with it ignored
  OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 \
    run_stage "$name" "$(left 15)" python3 -m tests.run_log "${args[@]}" "${extra[@]}"
  local rc=$?
  local expect=(--expect-cuda)
  [ "$marker" = "not cuda" ] && expect=()
  python3 scripts/results_summary.py "$OUT/results.jsonl" "${expect[@]}" | tee -a "$summary"
  [ "${PIPESTATUS[0]}" = 0 ] && [ $rc = 0 ]
}

run_one() {  # stage, its arguments...: one stage; non-zero when it failed
  local stage="$1" rc=0
  shift
  extra=("$@")                       # passed on to pytest (files, -k, -x, ...) or to the report script
  case "$stage" in
    tests) run_pytest tests "" || rc=1 ;;
    cuda) run_pytest cuda cuda || rc=1 ;;
    plain) run_pytest plain "not cuda" || rc=1 ;;
    bench)
      run_stage bench "$(left 10)" python3 bench/report.py --suites examples,comm,kernels,sampling --out "$OUT/bench" \
        "${extra[@]}" || rc=1
      [ -f "$OUT/bench/results.json" ] && mv "$OUT/bench/results.json" "$OUT/bench.json"
      [ -f "$OUT/bench/report.md" ] && cat "$OUT/bench/report.md" >> "$OUT/bench.log"
      rm -rf "$OUT/bench" ;;
    fused)   # --budget-s: no case starts after it; the last one may still run a minute
      run_stage fused "$(left 20)" python3 bench/bench_fused_kernels.py --kernel both --check --dim 0,1 \
        --budget-s "$(left 90)" --json "$OUT/fused.json" "${extra[@]}" || rc=1
      python3 bench/bench_fused_kernels.py --threshold "$OUT/fused.json" --write-rule "$OUT/fusion_measured.json" \
        >> "$OUT/fused.log" 2>&1 || rc=1
      # where the time goes, at a decode and a prefill size (then the stage's own arguments): a second run,
      # profiled, its lines in fused_profile.log, so that a profiler failure costs the run above nothing
      if [ "$(left 40)" -ge 30 ]; then
        run_stage fused_profile "$(left 15)" python3 bench/bench_fused_kernels.py --kernel both --check --profile \
          --budget-s "$(left 45)" --ms 16,1024 --nk 4096 "${extra[@]}" || rc=1
      else
        echo "fused_profile: not started: $(left 0) s of the call's $CALL_S s left" | tee -a "$summary"
      fi ;;
    tune)    # the candidates compile first in (cores - 2) processes (fastpipe/kernels/compile_pool.py)
      run_stage tune "$(left 20)" python3 bench/bench_fused_kernels.py --kernel both --tune --check --ms 1024,8192 \
        --budget-s "$(left 120)" --json "$OUT/tune.json" "${extra[@]}" || rc=1
      python3 bench/bench_fused_kernels.py --write-tuned "$OUT/tuned_configs.json" "$OUT/tune.json" \
        >> "$OUT/tune.log" 2>&1 || rc=1 ;;
    shapes)  # --budget-s: fastpipe tune starts no call after it (and writes its table after each one)
      run_stage shapes "$(left 10)" python3 bench/tune_model_shapes.py --budget-s "$(left 45)" \
        --json "$OUT/shapes.json" "${extra[@]}" || rc=1 ;;
    runtime)   # each bench script rewrites its JSON after every case or section: a cut-off run keeps them
      run_stage runtime "$(left 10)" python3 bench/report_runtime.py --budget-s "$(left 40)" \
        --json "$OUT/runtime.json" "${extra[@]}" || rc=1 ;;
    serving)
      run_stage serving "$(left 10)" python3 bench/report_serving.py --json "$OUT/serving.json" "${extra[@]}" || rc=1 ;;
    memory)
      run_stage memory "$(left 10)" python3 bench/report_memory.py --json "$OUT/memory.json" "${extra[@]}" || rc=1 ;;
    real)    # a real geometry's decode and prefill against its baselines (bench/report_real_size.py); the
             # checkpoint is written once on this machine's disk (GPU_CHECK_REAL_DIR) and reused by later calls
      run_stage real "$(left 10)" python3 bench/report_real_size.py --keep "${GPU_CHECK_REAL_DIR:-/tmp/fastpipe_real}" \
        --budget-s "$(left 60)" --json "$OUT/real.json" "${extra[@]}" || rc=1 ;;
    scale)   # build and load at real size (bench/report_scale.py), on a checkpoint the real stage wrote
      run_stage scale "$(left 10)" python3 bench/report_scale.py --json "$OUT/scale.json" "${extra[@]}" || rc=1 ;;
  esac
  return $rc
}

rc=0
for i in "${!names[@]}"; do
  if [ "$i" -gt 0 ] && [ "$(left 0)" -lt "$STAGE_MIN_S" ]; then   # the first stage always runs
    echo "${names[$i]}: not started: $(left 0) s of the call's $CALL_S s left, under GPU_CHECK_STAGE_MIN_S" \
      "($STAGE_MIN_S s)" | tee -a "$summary"
    rc=1
    continue
  fi
  eval "run_one ${names[$i]} ${args[$i]}" || rc=1
done
[ $cuda_ok = 1 ] || rc=1

# more than 8 files in $OUT: the logs go into one archive, then (still more than 8) all but the summary
count() { find "$OUT" -type f | wc -l; }
if [ "$(count)" -gt 8 ]; then
  (cd "$OUT" && find . -maxdepth 1 -type f -name '*.log' -printf '%P\n' | sort | tar -czf logs.tar.gz -T - \
    && find . -maxdepth 1 -type f -name '*.log' -delete)
  echo "more than 8 files: the logs are in logs.tar.gz (tar -xzf)" | tee -a "$summary"
fi
if [ "$(count)" -gt 8 ]; then
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name all.tar.gz -printf '%P\n' | sort \
    | tar -czf all.tar.gz -T - && find . -type f ! -name summary.txt ! -name all.tar.gz -delete)
  echo "still more than 8 files: all but summary.txt are in all.tar.gz (tar -xzf)" | tee -a "$summary"
fi
exit $rc
