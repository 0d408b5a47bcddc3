#!/usr/bin/env bash
# GPU-machine checks: tests/gpu/run.sh SECTION...  (no section: all of them)
#
# Runs on the lent GPU machine (an H200 with torch 2.x, no network): builds there what a
# section needs (never `make deps`), runs its checks and prints a short table last.
# Each section finishes well under five minutes. Logs go to $OUT (default
# /tmp/lgreco-gpu) so that they come back with the device tool.
#
# Sections:
#   register   tools/lgreco-register and its tests on the machine's torch 2.x; the
#              example models' layouts compared with the committed (torch 1.13) ones;
#              the layout of DDP on CUDA with NCCL against the CLI's CPU/gloo file
#   codec      the CUDA quantization kernels (build/bin/lgreco-gpu-codec-check, built
#              here): --check against the CPU reference, one compute-sanitizer memcheck
#              pass of --check --quick (when compute-sanitizer is there and works), and
#              --bench; the bench table is printed after the summary. About 3 minutes
#              on an H200, most of it a cold build; every step is bounded (9 at most)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/lgreco-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 LGRECO_DEBUG=NONE
JOBS=$(nproc 2>/dev/null || echo 4)

rows=()
appendix=()  # files printed after the table (the bench's)
# row SECTION CHECK RESULT DETAIL
row() { rows+=("$(printf '%-9s %-34s %-5s %s' "$1" "$2" "$3" "$4")"); echo "[$1] $2: $3 $4"; }
failed=0
fail_if() { [[ "$1" == FAIL ]] && failed=1; }

section_register() {
  if ! make -j"$JOBS" build/bin/lgreco-config PYTHON="$PY" > "$OUT/register-build.log" 2>&1; then
    row register "build lgreco-config" FAIL "see register-build.log"; failed=1; return
  fi
  local torch
  torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>&1) || { row register "import torch" FAIL "$torch"; failed=1; return; }
  row register "torch" INFO "$torch"
  local r=PASS
  LGRECO_CONFIG_TOOL=build/bin/lgreco-config timeout 300 "$PY" tests/python/register_test.py \
    > "$OUT/register-test.log" 2>&1 || r=FAIL
  row register "tests/python/register_test.py" "$r" "$(grep -E '^(Ran|OK|FAILED)' "$OUT/register-test.log" | tr '\n' ' ')"
  fail_if "$r"
  # The committed examples were produced with Debian's torch 1.13; produce them again here
  # with the same commands (config/examples/README.md) and compare the layouts.
  local name spec
  for spec in "resnet50|--model torchvision.models:resnet50 --input-shape 2,3,224,224" \
              "bert_base|--model config/examples/models.py:bert_base --input-shape 2,32 --input-dtype long --input-high 30522" \
              "gpt2_small|--model config/examples/models.py:gpt2_small --input-shape 2,32 --input-dtype long --input-high 50257"; do
    name=${spec%%|*}
    r=PASS
    # shellcheck disable=SC2086
    if ! timeout 240 "$PY" tools/lgreco-register ${spec#*|} --model-name "$name" -o "$OUT/$name.json" \
         > "$OUT/register-$name.log" 2>&1; then
      row register "lgreco-register $name" FAIL "see register-$name.log"; failed=1; continue
    fi
    if ! build/bin/lgreco-config check "$OUT/$name.json" >> "$OUT/register-$name.log" 2>&1; then
      row register "lgreco-config check $name" FAIL "see register-$name.log"; failed=1; continue
    fi
    local same
    same=$("$PY" - "$OUT/$name.json" "config/examples/$name.json" <<'PYEOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
def shape(r): return [(x["count"], x["dtype"], [l["name"] for l in x["layers"]]) for x in r["buckets"]]
print("same layout as torch 1.13" if shape(a) == shape(b) else
      "differs from torch 1.13: counts %s vs %s" % ([x["count"] for x in a["buckets"]], [x["count"] for x in b["buckets"]]))
PYEOF
)
    row register "lgreco-register $name" PASS "valid; $same"
  done
  # On the GPU: the layout DDP uses with CUDA tensors and NCCL must be the one the CLI
  # wrote on the CPU with gloo (autograd could order gradients differently there).
  local model shape high line
  for spec in "resnet50|torchvision.models:resnet50|2,3,224,224|0" \
              "gpt2_small|config/examples/models.py:gpt2_small|2,32|50257"; do
    IFS='|' read -r name model shape high <<< "$spec"
    [[ -f "$OUT/$name.json" ]] || continue
    line=$(timeout 240 "$PY" tests/gpu/register_cuda_check.py "$model" "$shape" "$high" "$OUT/$name.json" \
           "$OUT/$name-cuda.json" 2> "$OUT/register-cuda-$name.log" | tail -n 1)
    r=${line%% *}
    [[ "$r" == PASS ]] || r=FAIL
    row register "CUDA DDP layout $name" "$r" "${line#* }"
    fail_if "$r"
  done
}

# The CUDA toolkit: $CUDA_HOME, /usr/local/cuda, or wherever the nvcc on PATH lives.
cuda_home() {
  local h=${CUDA_HOME:-/usr/local/cuda} nvcc
  if [[ ! -x "$h/bin/nvcc" ]] && nvcc=$(command -v nvcc 2>/dev/null); then
    h=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  fi
  echo "$h"
}

# The last line of a log, shortened, for a table row.
last_line() { tail -n 1 "$1" 2>/dev/null | cut -c1-100; }

# The codec section's steps share one deadline (LGRECO_GPU_CODEC_SECONDS, default 540 s):
# whatever hangs or crawls, the section ends in time and reports what it could do.
# Expected on an H200: build 1-2 min cold, --check ~10 s, memcheck ~1 min, --bench ~15 s.
codec_deadline=0
# step_time CAP: the timeout of the next step, CAP or what is left if less; 0 when under 20 s.
step_time() {
  local left=$((codec_deadline - SECONDS))
  (( left > $1 )) && left=$1
  (( left < 20 )) && left=0
  echo "$left"
}

section_codec() {
  local bin=build/bin/lgreco-gpu-codec-check cuda rc detail r t
  codec_deadline=$((SECONDS + ${LGRECO_GPU_CODEC_SECONDS:-540}))
  cuda=$(cuda_home)
  if [[ ! -x "$cuda/bin/nvcc" ]]; then
    row codec "build lgreco-gpu-codec-check" FAIL "no nvcc ($cuda/bin/nvcc, PATH): set CUDA_HOME"; failed=1; return
  fi
  # Only this program and the core library it links. nvcc compiles the kernels' three
  # -gencode targets one after the other unless told otherwise; --threads 0 runs them in
  # parallel (the longest step of a cold build).
  t=$(step_time 360)
  NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }--threads 0" \
    timeout "$t" make -j"$JOBS" "$bin" CUDA_HOME="$cuda" PYTHON="$PY" > "$OUT/codec-build.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 || ! -x "$bin" ]]; then
    detail=$(grep -m 1 -E 'error|No rule' "$OUT/codec-build.log" | cut -c1-100)
    detail="exit $rc: ${detail:-$(last_line "$OUT/codec-build.log")}"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row codec "build lgreco-gpu-codec-check" FAIL "$detail (codec-build.log)"; failed=1; return
  fi
  row codec "build lgreco-gpu-codec-check" PASS "CUDA at $cuda"

  # Parity with the CPU reference. Exit 2 is "no CUDA device", 3 its own time limit.
  # --verbose: the log lists each statistic that needed float32's resolution allowance.
  t=$(step_time 150)
  if [[ $t -eq 0 ]]; then row codec "--check" FAIL "skipped: the section ran out of time"; failed=1; return; fi
  timeout "$t" "$bin" --check --verbose --time-limit $((t - 10)) > "$OUT/codec-check.log" 2>&1
  rc=$?
  detail=$(grep -E '^SUMMARY: ' "$OUT/codec-check.log" | tail -n 1 | cut -c10-)
  [[ -z "$detail" ]] && detail="exit $rc: $(last_line "$OUT/codec-check.log")"
  [[ $rc -eq 124 ]] && detail="timed out after $t s; $(last_line "$OUT/codec-check.log")"
  r=PASS; [[ $rc -eq 0 ]] || r=FAIL
  row codec "--check" "$r" "$detail (codec-check.log)"
  fail_if "$r"
  local line
  while IFS= read -r line; do
    row codec "  failed" FAIL "$(cut -c1-150 <<< "${line#\# failed: }")"
  done < <(grep -E '^# failed: ' "$OUT/codec-check.log" | head -n 6)

  # One compute-sanitizer memcheck pass over the smaller set, if the tool is here and can
  # run a trivial CUDA program (--info: one allocation, one copy, one launch).
  local cs="" c
  for c in "$(command -v compute-sanitizer 2>/dev/null)" "$cuda/bin/compute-sanitizer" \
           "$cuda/compute-sanitizer/compute-sanitizer"; do
    if [[ -n "$c" && -x "$c" ]]; then cs=$c; break; fi
  done
  t=$(step_time 60)
  if [[ -z "$cs" ]]; then
    row codec "compute-sanitizer memcheck" INFO "skipped: compute-sanitizer not found (PATH, $cuda/bin, $cuda/compute-sanitizer)"
  elif [[ $t -eq 0 ]]; then
    row codec "compute-sanitizer memcheck" INFO "skipped: the section ran out of time"
  else
    timeout "$t" "$cs" --tool memcheck --error-exitcode 99 "$bin" --info > "$OUT/codec-sanitizer-trivial.log" 2>&1
    rc=$?
    t=$(step_time 240)
    if [[ $rc -ne 0 ]]; then
      row codec "compute-sanitizer memcheck" INFO \
        "skipped: it fails on a trivial run (--info, exit $rc): $(last_line "$OUT/codec-sanitizer-trivial.log")"
    elif [[ $t -eq 0 ]]; then
      row codec "compute-sanitizer memcheck" INFO "skipped: the section ran out of time"
    else
      timeout "$t" "$cs" --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$bin" --check --quick --time-limit $((t - 10)) > "$OUT/codec-memcheck.log" 2>&1
      rc=$?
      local errors result
      errors=$(grep -E 'ERROR SUMMARY' "$OUT/codec-memcheck.log" | tail -n 1 | sed 's/^[= ]*//')
      result=$(grep -E '^RESULT: ' "$OUT/codec-memcheck.log" | tail -n 1)
      # Memory errors decide this row (exit 99, or a summary that counts any); the checks'
      # own results under the sanitizer are those of --check above.
      r=PASS
      if [[ $rc -eq 99 || $rc -eq 124 || ! "$errors" =~ ERROR\ SUMMARY:\ 0\ errors ]]; then r=FAIL; fi
      detail="${errors:-no ERROR SUMMARY (exit $rc)}; --check --quick ${result:-exit $rc}"
      [[ $rc -eq 124 ]] && detail="timed out after $t s; $detail"
      row codec "memcheck --check --quick" "$r" "$detail (codec-memcheck.log)"
      fail_if "$r"
    fi
  fi

  # Throughput; the table comes after the summary.
  t=$(step_time 120)
  if [[ $t -eq 0 ]]; then row codec "--bench" FAIL "skipped: the section ran out of time"; failed=1; return; fi
  timeout "$t" "$bin" --bench --time-limit $((t - 10)) > "$OUT/codec-bench.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    detail="exit $rc: $(last_line "$OUT/codec-bench.log")"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row codec "--bench" FAIL "$detail (codec-bench.log)"; failed=1; return
  fi
  sed -n '/^== lgreco-gpu-codec-check --bench/,$p' "$OUT/codec-bench.log" > "$OUT/codec-bench-table.txt"
  appendix+=("$OUT/codec-bench-table.txt")
  row codec "--bench" INFO "$(grep -E '^== ' "$OUT/codec-bench.log" | sed 's/^== lgreco-gpu-codec-check --bench: //; s/ ==$//' | cut -c1-110) (table below, codec-bench.log)"
  local targets
  targets=$(grep -E '^TARGETS: ' "$OUT/codec-bench.log" | tail -n 1 | cut -c10-)
  if [[ "$targets" =~ ^([0-9]+)\ of\ ([0-9]+)\ met ]] && [[ ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]]; then
    r=PASS
  else
    r=FAIL
  fi
  row codec "bench targets" "$r" "$(cut -c1-200 <<< "${targets:-no TARGETS line}")"
  fail_if "$r"
}

sections=("$@")
[[ ${#sections[@]} -eq 0 ]] && sections=(register codec)
for s in "${sections[@]}"; do
  case "$s" in
    register) section_register ;;
    codec) section_codec ;;
    *) echo "tests/gpu/run.sh: unknown section '$s' (sections: register codec)" >&2; exit 2 ;;
  esac
done

echo
echo "== lgreco GPU checks ($(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || echo 'no GPU')) =="
printf '%-9s %-34s %-5s %s\n' section check result detail
printf '%s\n' "${rows[@]}"
for f in "${appendix[@]}"; do
  echo
  cat "$f"
done
exit "$failed"
