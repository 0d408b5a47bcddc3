#!/usr/bin/env bash
# GPU-machine checks: tests/gpu/run.sh SECTION...  (no section: all of them)
#
# Runs on the lent GPU machine (an H200 with torch 2.x, no network): builds there what a
# section needs (never `make deps`), runs its checks and prints a short table last.
# Each section finishes well under five minutes, but shim (about 8). Logs go to $OUT (default
# /tmp/lgreco-gpu) so that they come back with the device tool.
#
# Sections:
#   first      the product check, one command under 8 minutes from a bare machine: build,
#              quant kernel parity, 4-rank DDP under LD_PRELOAD (uniform and adaptive)
#              against plain NCCL, lgreco-bench against NCCL at 64 MiB, the same DDP through
#              NCCL_NET_PLUGIN; PASS/FAIL/SKIP rows (section_first below says what each
#              judges). Not part of "no section: all of them"; run it first, alone.
#   register   tools/lgreco-register and its tests on the machine's torch 2.x; the
#              example models' layouts compared with the committed (torch 1.13) ones;
#              the layout of DDP on CUDA with NCCL against the CLI's CPU/gloo file
#   codec      the CUDA quantization kernels (build/bin/lgreco-gpu-codec-check, built
#              here): --check against the CPU reference, one compute-sanitizer memcheck
#              pass of --check --quick (when compute-sanitizer is there and works), and
#              --bench; the bench table is printed after the summary. About 3 minutes
#              on an H200, most of it a cold build; every step is bounded (9 at most)
#   families   the kernels of the codec families beyond quantization, TopK so far
#              (build/bin/lgreco-gpu-topk-check, built here): --check against the CPU
#              reference (a difference fails), --bench against the target (encode of 1e8
#              float32 at density 0.01 in <= 0.5 ms; met or missed is INFO; table after
#              the summary), one compute-sanitizer memcheck pass of --check --quick while
#              time is left. About 4-6 minutes on an H200 with a cold build; bounded by
#              LGRECO_GPU_FAMILIES_SECONDS (default 420). Then PowerSGD's module
#              (build/bin/lgreco-gpu-lowrank-check: --check against the CPU reference
#              within docs/KERNELS.md's tolerances, --bench of one step, memcheck), about
#              1-3 minutes more, bounded by LGRECO_GPU_LOWRANK_SECONDS (default 150). Run
#              the section as its own device-tool command.
#   backend    the engine's CUDA backend (build/bin/lgreco-gpu-backend-check, built here)
#              against its CPU backend: --check (every operation byte for byte on random
#              plans, stream switching, the memory cap, events, marks), and one
#              compute-sanitizer memcheck pass of --check --quick when the tool works.
#              About 2-3 minutes on an H200, most of it a cold build; bounded by
#              LGRECO_GPU_BACKEND_SECONDS (default 420). The shim section does not run
#              it. The device tool allows 10 minutes per command: run `backend` and
#              `shim` as two commands (their deadlines add up to 15 minutes).
#   shim       the collective shim on the GPU, 2 and 4 NCCL ranks sharing the one GPU
#              (a distinct NCCL_HOSTID each, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
#              NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo): builds build/lib/liblgreco.so,
#              lgreco-bench and lgreco-config here, then
#              1. lgreco-bench --fabric nccl, quant:bits=4 uniform, float32, 1 to 64 MiB:
#                 #wrong 0 and outputs bit-identical across ranks (a failure otherwise),
#                 and how many times faster than plain NCCL allreduce of the same buffers;
#                 target: >= 3x at 64 MiB with 4 ranks (met or missed is reported, a miss
#                 does not fail the section); then topk:density=0.01 and powersgd:rank=4
#                 with 4 ranks at 16 and 64 MiB (the CUDA backend's TopK and cuBLAS
#                 paths; correctness as above, speed reported);
#              2. tests/gpu/ddp_check.py: unmodified DDP (tests/gpu/ddp_train.py, an MLP
#                 on scikit-learn's digits, 300 steps) plain, then under
#                 LD_PRELOAD=build/lib/liblgreco.so uniform 4-bit, adaptive and (2 ranks)
#                 adaptive with quant, TopK and PowerSGD candidates, with 2 ranks and,
#                 while time is left, 4: accuracy within 1.5 points and loss within 20%
#                 of plain's, compressed calls in the shim's log, assignment epochs in the
#                 adaptive runs' decision logs.
#              Tables after the summary. About 8 minutes on an H200 with a cold build
#              (the 4-rank DDP runs are the first dropped when time is short); bounded by
#              LGRECO_GPU_SHIM_SECONDS (default 480). It does not run the
#              backend section first: run `tests/gpu/run.sh backend`, then
#              `tests/gpu/run.sh shim`, as two device-tool commands.
#   package    the Python package on the machine's Python and torch: a virtual
#              environment (--system-site-packages, outside $OUT), pip install . with
#              PIP_NO_INDEX=1 (reuses build/; a cold CUDA build takes minutes), then
#              `lgreco info`: torch's NCCL found, the driver new enough for the static CUDA
#              runtime (a miss fails), and lgreco-run's LD_PRELOAD. Output after the
#              summary. Seconds when build/ is warm (run it after shim or net).
#   net        lgreco's NCCL net plugin (build/lib/libnccl-net-lgreco.so) under the real
#              NCCL (LGRECO_GPU_NCCL_LIB, else torch's), ranks sharing the one GPU as in
#              shim: builds the library and build/bin/lgreco-gpu-net-check here, then
#              a. lgreco-gpu-net-check, 2 and 4 ranks, NCCL_NET=lgreco
#                 NCCL_NET_PLUGIN=<that file> LGRECO_NET=socket LGRECO_SOCKET_IFNAME=lo:
#                 allreduce of 1 to 256 MiB float32 correct at every size (float64
#                 reference), and every rank's NCCL log (NCCL_DEBUG=INFO,
#                 NCCL_DEBUG_SUBSYS=INIT,NET) says "Using network lgreco";
#              b. the same with NCCL_NET=Socket (NCCL's own transport), in the same run;
#                 busbw of both per size and lgreco/Socket; target >= 1.0x at 64 MiB and
#                 above (met or missed is reported, a miss does not fail the section);
#              c. tests/gpu/ddp_net_check.py: DDP (tests/gpu/ddp_train.py, 2 ranks) with
#                 NCCL_NET_PLUGIN=<that file>, NCCL_NET=lgreco and no LD_PRELOAD: NCCL
#                 loaded the plugin, the plugin rebound the framework's ncclAllReduce to the
#                 shim, the shim's summary line counts compressed calls on every rank, and
#                 accuracy and loss as in shim (against a plain NCCL_NET=Socket run).
#              Tables after the summary. About 5 minutes on an H200 with a cold build;
#              bounded by LGRECO_GPU_NET_SECONDS (default 380). Run it as its own
#              device-tool command.
#
# LGRECO_GPU_PREBUILT=1: a section's build step uses the binaries already under build/
# instead of running make (built for sm_90 on the CPU machine with the same CUDA, stripped
# with `strip --strip-debug`, and carried to the device machine as one tar.xz: about 18 MB
# for liblgreco.so, lgreco-bench, lgreco-config and the lgreco-gpu-* checks). It saves the
# minutes of a cold nvcc build out of a 15-minute lease; without it every section builds.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/lgreco-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 LGRECO_DEBUG=NONE
JOBS=$(nproc 2>/dev/null || echo 4)
# Where the first section finds lgreco-bench and the checks (a folder of stubs in
# tests/gpu/first_stub_test.sh, which checks the section's logic without a GPU).
BIN=${LGRECO_GPU_BIN:-build/bin}

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
# step_time CAP [DEADLINE]: the timeout of the next step, CAP or what is left until
# DEADLINE (default: the codec section's) if less; 0 when under 20 s.
step_time() {
  local left=$((${2:-$codec_deadline} - SECONDS))
  (( left > $1 )) && left=$1
  (( left < 20 )) && left=0
  echo "$left"
}

# prebuilt FILE...: true when LGRECO_GPU_PREBUILT=1 and every FILE is there: binaries
# built for sm_90 on another machine with the same CUDA and carried here (the device tool's
# carry), so that a section spends none of the lease on a cold build.
prebuilt() {
  [[ "${LGRECO_GPU_PREBUILT:-0}" == 1 ]] || return 1
  local f
  for f in "$@"; do [[ -e "$f" ]] || return 1; done
}

# The steps the check programs' sections share. Each takes the section's deadline and
# writes $OUT/NAME-<step>.log; a step that cannot go on returns 1 (the section stops).
#
# build_step SECTION BIN NAME CAP DEADLINE [MORE TARGETS...]: make BIN (and what it
# links) for this GPU, with every core (the Makefile's nvcc runs its two architectures
# side by side, and the quantization kernels are split across five files).
build_step() {
  local section=$1 bin=$2 name=$3 cap=$4 deadline=$5 cuda rc detail t
  shift 5
  if prebuilt "$bin"; then row "$section" "build ${bin##*/}" PASS "prebuilt (LGRECO_GPU_PREBUILT)"; return 0; fi
  cuda=$(cuda_home)
  if [[ ! -x "$cuda/bin/nvcc" ]]; then
    row "$section" "build ${bin##*/}" FAIL "no nvcc ($cuda/bin/nvcc, PATH): set CUDA_HOME"; failed=1; return 1
  fi
  t=$(step_time "$cap" "$deadline")
  timeout "$t" make -j"$JOBS" "$bin" "$@" CUDA_HOME="$cuda" PYTHON="$PY" > "$OUT/$name-build.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 || ! -x "$bin" ]]; then
    detail=$(grep -m 1 -E 'error|No rule' "$OUT/$name-build.log" | cut -c1-100)
    detail="exit $rc: ${detail:-$(last_line "$OUT/$name-build.log")}"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row "$section" "build ${bin##*/}" FAIL "$detail ($name-build.log)"; failed=1; return 1
  fi
  row "$section" "build ${bin##*/}" PASS "CUDA at $cuda"
}

# check_step SECTION LABEL BIN NAME CAP DEADLINE [ARGS...]: BIN --check ARGS against the
# CPU reference, with its own --time-limit inside the step's. The row is its SUMMARY line
# (exit 2 is "no CUDA device", 3 its time limit), then up to six of its '# failed:' lines.
check_step() {
  local section=$1 label=$2 bin=$3 name=$4 cap=$5 deadline=$6 rc detail r t line log
  shift 6
  log="$OUT/$name-check.log"
  t=$(step_time "$cap" "$deadline")
  if [[ $t -eq 0 ]]; then row "$section" "$label" FAIL "skipped: the section ran out of time"; failed=1; return 1; fi
  timeout "$t" "$bin" --check "$@" --time-limit $((t - 10)) > "$log" 2>&1
  rc=$?
  detail=$(grep -E '^SUMMARY: ' "$log" | tail -n 1 | cut -c10-)
  [[ -z "$detail" ]] && detail="exit $rc: $(last_line "$log")"
  [[ $rc -eq 124 ]] && detail="timed out after $t s; $(last_line "$log")"
  r=PASS; [[ $rc -eq 0 ]] || r=FAIL
  row "$section" "$label" "$r" "$(cut -c1-300 <<< "$detail") (${log##*/})"
  fail_if "$r"
  while IFS= read -r line; do
    row "$section" "  failed" FAIL "$(cut -c1-150 <<< "${line#\# failed: }")"
  done < <(grep -E '^# failed: ' "$log" | head -n 6)
}

# memcheck_step SECTION LABEL BIN NAME DEADLINE [TRIVIAL]: one compute-sanitizer memcheck
# pass of BIN --check --quick, if the tool is here, works on a trivial CUDA program
# (TRIVIAL --info, default BIN --info: one allocation, one copy, one launch) and time is
# left. Memory errors decide the row: FAIL on the sanitizer's exit 99 or an ERROR SUMMARY
# that counts any (or none printed); a run cut short by the time limit with none reported
# is INFO (the sanitizer slows everything tenfold), as is a --check that fails under it
# (the --check row above reports that); else PASS.
memcheck_step() {
  local section=$1 label=$2 bin=$3 name=$4 deadline=$5 trivial=${6:-$3} cs="" c cuda rc t errors result r detail log
  cuda=$(cuda_home)
  for c in "$(command -v compute-sanitizer 2>/dev/null)" "$cuda/bin/compute-sanitizer" \
           "$cuda/compute-sanitizer/compute-sanitizer"; do
    if [[ -n "$c" && -x "$c" ]]; then cs=$c; break; fi
  done
  t=$(step_time 60 "$deadline")
  if [[ -z "$cs" ]]; then
    row "$section" "$label" INFO "skipped: compute-sanitizer not found (PATH, $cuda/bin, $cuda/compute-sanitizer)"
    return
  elif [[ $t -eq 0 ]]; then
    row "$section" "$label" INFO "skipped: the section ran out of time"; return
  fi
  timeout "$t" "$cs" --tool memcheck --error-exitcode 99 "$trivial" --info > "$OUT/$name-sanitizer-trivial.log" 2>&1
  rc=$?
  t=$(step_time 240 "$deadline")
  if [[ $rc -ne 0 ]]; then
    row "$section" "$label" INFO \
      "skipped: it fails on a trivial run (--info, exit $rc): $(last_line "$OUT/$name-sanitizer-trivial.log")"
    return
  elif [[ $t -eq 0 ]]; then
    row "$section" "$label" INFO "skipped: the section ran out of time"; return
  fi
  log="$OUT/$name-memcheck.log"
  timeout "$t" "$cs" --tool memcheck --error-exitcode 99 --print-limit 20 \
    "$bin" --check --quick --time-limit $((t - 10)) > "$log" 2>&1
  rc=$?
  errors=$(grep -E 'ERROR SUMMARY' "$log" | tail -n 1 | sed 's/^[= ]*//')
  result=$(grep -E '^RESULT: ' "$log" | tail -n 1)
  detail="${errors:-no ERROR SUMMARY (exit $rc)}; --check --quick ${result:-exit $rc}"
  if [[ $rc -eq 99 || ( -n "$errors" && ! "$errors" =~ ERROR\ SUMMARY:\ 0\ errors ) ]]; then
    r=FAIL
  elif [[ $rc -eq 124 || $rc -eq 3 ]]; then
    r=INFO; detail="did not finish in $t s under the sanitizer; no memory error reported before"
  elif [[ -z "$errors" ]]; then
    r=FAIL
  elif [[ $rc -eq 0 ]]; then
    r=PASS
  else
    r=INFO
  fi
  row "$section" "$label --check --quick" "$r" "$detail (${log##*/})"
  fail_if "$r"
}

section_codec() {
  local bin=build/bin/lgreco-gpu-codec-check rc detail r t
  codec_deadline=$((SECONDS + ${LGRECO_GPU_CODEC_SECONDS:-540}))
  # Only this program and the core library it links.
  build_step codec "$bin" codec 360 "$codec_deadline" || return
  # --verbose: the log lists each statistic that needed float32's resolution allowance.
  check_step codec "--check" "$bin" codec 150 "$codec_deadline" --verbose || return
  memcheck_step codec "memcheck" "$bin" codec "$codec_deadline"

  # Throughput; the table comes after the summary.
  t=$(step_time 120 "$codec_deadline")
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

# The codec families' kernels beyond quantization, one function per family, each with its
# own deadline. TopK: lgreco-gpu-topk-check, built here, --check against the CPU reference
# (FAIL on any difference), --bench against the issue's target (encode of 1e8 float32 at
# density 0.01 in <= 0.5 ms; met or missed is INFO, the table comes after the summary),
# then one compute-sanitizer memcheck pass of --check --quick while time is left; its steps
# share LGRECO_GPU_FAMILIES_SECONDS (default 420 s). Expected on an H200: build 1-2 min
# cold (less after codec), --check about a minute (the CPU reference of 1e7 values
# dominates), --bench under 30 s, memcheck 1-3 min.
families_deadline=0
section_families() {
  section_families_topk
  # PowerSGD's CUDA module: its own steps and deadline (below).
  section_families_lowrank
}

# TopK's steps of the families section (a step that cannot go on returns; the next
# family's steps run anyway).
section_families_topk() {
  local bin=build/bin/lgreco-gpu-topk-check rc detail t line
  families_deadline=$((SECONDS + ${LGRECO_GPU_FAMILIES_SECONDS:-420}))
  build_step families "$bin" families 300 "$families_deadline" || return
  check_step families "topk --check" "$bin" families-topk 180 "$families_deadline" || return

  # Speed: encode of 1e8 float32 at densities 0.01 and 0.001 (and the other kernels, for
  # information); the target is reported, a miss does not fail the section.
  t=$(step_time 120 "$families_deadline")
  if [[ $t -eq 0 ]]; then row families "topk --bench" FAIL "skipped: the section ran out of time"; failed=1; return; fi
  timeout "$t" "$bin" --bench --time-limit $((t - 10)) > "$OUT/families-topk-bench.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    detail="exit $rc: $(last_line "$OUT/families-topk-bench.log")"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row families "topk --bench" FAIL "$detail (families-topk-bench.log)"; failed=1
  else
    sed -n '/^== lgreco-gpu-topk-check --bench/,$p' "$OUT/families-topk-bench.log" > "$OUT/families-topk-bench-table.txt"
    appendix+=("$OUT/families-topk-bench-table.txt")
    line=$(grep -E '^TARGET: ' "$OUT/families-topk-bench.log" | tail -n 1 | cut -c9-)
    if [[ "$line" =~ :\ met ]]; then detail="met: $line"
    elif [[ -n "$line" ]]; then detail="missed: $line"
    else detail="missed: no TARGET line (families-topk-bench.log)"; fi
    row families "topk target: 1e8 f32 1% <= 0.5 ms" INFO "$(cut -c1-200 <<< "$detail")"
  fi

  memcheck_step families "topk memcheck" "$bin" families-topk "$families_deadline"
}

# PowerSGD's CUDA module (kernels/lowrank_cuda.h), the last step of the families section:
# lgreco-gpu-lowrank-check, built here, --check against the CPU reference (every operation;
# the tolerances are docs/KERNELS.md's, "PowerSGD on the GPU"; FAIL above them or on any
# difference where bits must match), --bench (one step, project + orthonormalize +
# back_project + reconstruct, of a 4096 x 4096 float32 layer at rank 4 and 32 and of
# ResNet-50's 54 matrix layers at rank 4, median of 30 with CUDA events: INFO rows, the
# table after the summary), then one compute-sanitizer memcheck pass of --check --quick
# while time is left. Its own deadline (LGRECO_GPU_LOWRANK_SECONDS, default 150 s), so that
# the TopK steps before it cannot starve it. Expected on an H200: the build is one file and
# a link after TopK's, --check 30-60 s (the CPU reference of the 1024 x 4096 layers at
# rank 32 dominates), --bench under 15 s, memcheck 1-2 min.
section_families_lowrank() {
  local bin=build/bin/lgreco-gpu-lowrank-check rc detail t line deadline
  deadline=$((SECONDS + ${LGRECO_GPU_LOWRANK_SECONDS:-150}))
  build_step families "$bin" lowrank 120 "$deadline" || return
  check_step families "lowrank --check" "$bin" lowrank 120 "$deadline" || return

  # One step's time; a row per case, the lines after the summary.
  t=$(step_time 60 "$deadline")
  if [[ $t -eq 0 ]]; then row families "lowrank --bench" FAIL "skipped: the section ran out of time"; failed=1; return; fi
  timeout "$t" "$bin" --bench --reps 30 --time-limit $((t - 10)) > "$OUT/lowrank-bench.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    detail="exit $rc: $(last_line "$OUT/lowrank-bench.log")"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row families "lowrank --bench" FAIL "$detail (lowrank-bench.log)"; failed=1
  else
    { echo "== lgreco-gpu-lowrank-check --bench: one PowerSGD step on the GPU =="
      grep -E '^(# |bench )' "$OUT/lowrank-bench.log"; } > "$OUT/lowrank-bench-table.txt"
    appendix+=("$OUT/lowrank-bench-table.txt")
    while IFS= read -r line; do
      row families "lowrank step" INFO "$(sed -E 's/^bench +//; s/ +step +/: /; s/ +/ /g' <<< "$line" | cut -c1-200)"
    done < <(grep -E '^bench ' "$OUT/lowrank-bench.log")
  fi

  # cuBLAS's kernels included.
  memcheck_step families "lowrank memcheck" "$bin" lowrank "$deadline"
}

# The engine's CUDA backend against the CPU backend. Its steps share one deadline
# (LGRECO_GPU_BACKEND_SECONDS, default 420 s). Expected on an H200: build 1-2 min cold
# (less after the codec section), --check 10-30 s, memcheck of --check --quick 1-2 min.
section_backend() {
  local bin=build/bin/lgreco-gpu-backend-check deadline
  deadline=$((SECONDS + ${LGRECO_GPU_BACKEND_SECONDS:-420}))
  build_step backend "$bin" backend 300 "$deadline" build/bin/lgreco-gpu-codec-check || return
  check_step backend "--check" "$bin" backend 120 "$deadline" || return
  # The per-check table comes after the summary.
  sed -n '/^== lgreco-gpu-backend-check --check/,$p' "$OUT/backend-check.log" > "$OUT/backend-check-table.txt"
  [[ -s "$OUT/backend-check-table.txt" ]] && appendix+=("$OUT/backend-check-table.txt")
  # The trivial run is the codec check's (--info; this program has none).
  memcheck_step backend "memcheck" "$bin" backend "$deadline" build/bin/lgreco-gpu-codec-check
}

# The collective shim on the GPU: lgreco-bench --fabric nccl against plain NCCL, then
# unmodified DDP under LD_PRELOAD (tests/gpu/ddp_check.py). One deadline for all steps
# (LGRECO_GPU_SHIM_SECONDS, default 480 s). Expected on an H200: build 1-2 min cold, the
# bench about 20 s per world size and codec, DDP about 1.5 min for 2 ranks and 2 min for 4.
shim_deadline=0
# shim_time CAP: the timeout of the next step, CAP or what is left if less; 0 when under 20 s.
shim_time() {
  local left=$((shim_deadline - SECONDS))
  (( left > $1 )) && left=$1
  (( left < 20 )) && left=0
  echo "$left"
}

# The libnccl torch loads (its own, in its venv), so that the bench and DDP run the same
# NCCL; else the one the dynamic loader finds (the system's).
torch_nccl() {
  "$PY" - 2> /dev/null <<'NCCLPY' || echo libnccl.so.2
import glob, os, sys
import torch
import torch.distributed
for line in open("/proc/self/maps"):
    if "libnccl" in line and line.split()[-1].startswith("/"):
        print(line.split()[-1]); sys.exit(0)
site = os.path.dirname(os.path.dirname(torch.__file__))
found = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libnccl.so*"), recursive=True))
if not found: sys.exit(1)
print(found[0])
NCCLPY
}

# run_ranks NAME N SECONDS CMD...: N processes of CMD, one per rank, all on GPU 0 with
# their own NCCL_HOSTID, meeting as torchrun's environment says; logs in
# $OUT/NAME.rank<R>.log. Sets rank_codes to their exit codes (124: timed out).
rank_codes=()
run_ranks() {
  local name=$1 n=$2 t=$3 r port pids=()
  shift 3
  port=$((20000 + RANDOM % 20000))
  for ((r = 0; r < n; r++)); do
    env RANK=$r WORLD_SIZE="$n" LOCAL_RANK=0 LOCAL_WORLD_SIZE="$n" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      NCCL_HOSTID="lgreco-$name-$r" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \
      timeout -k 10 "$t" "$@" > "$OUT/$name.rank$r.log" 2>&1 &
    pids+=($!)
  done
  rank_codes=()
  for r in "${pids[@]}"; do wait "$r"; rank_codes+=($?); done
}

# bench_columns LOG NAME...: the named columns of lgreco-bench's result rows in LOG, one
# line per row, found by the names of its header line ("#  size  count  type ..."), never
# by position (the columns change: the tools issue adds nccl-tests' in-place half, whose
# names repeat; the first, out-of-place one is taken). "-" for a name the header lacks.
bench_columns() {
  local log=$1
  shift
  awk -v want="$*" '
    BEGIN { n = split(want, names, " ") }
    /^#/ && !have {
      for (i = 2; i <= NF; i++) if (!($i in col)) col[$i] = i - 1
      if (("size" in col) && ("count" in col)) have = 1; else split("", col)
      next
    }
    /^#/ || !have || NF < 2 { next }
    { line = ""
      for (k = 1; k <= n; k++) line = line (k > 1 ? " " : "") ((names[k] in col) ? $(col[names[k]]) : "-")
      print line }' "$log"
}

# shim_bench NAME NRANKS SECONDS TITLE LABEL [LGRECO-BENCH ARGS...]: lgreco-bench --fabric
# nccl on NRANKS ranks (logs $OUT/NAME.rank<R>.log); rank 0's table after the summary under
# TITLE, and a row LABEL that fails unless every rank exits 0, the bench's own bound check
# passes ("# Out of bounds values : 0 OK": #wrong 0 and outputs bit-identical across ranks)
# and it printed result rows.
shim_bench() {
  local name=$1 n=$2 t=$3 title=$4 label=$5 log table detail r
  shift 5
  run_ranks "$name" "$n" "$t" "$BIN/lgreco-bench" --fabric nccl "$@"
  log="$OUT/$name.rank0.log"
  table="$OUT/$name-table.txt"
  { echo "== $title =="; grep -v 'LGRECO' "$log"; } > "$table"
  appendix+=("$table")
  detail=$(bench_columns "$log" size 'time(us)' nccl_us vs_nccl rel_err '#wrong' |
           awk '{ rows++; if ($6 != "0") bad++; last = $1 " B: " $2 " us, NCCL " $3 " us: " $4 "x, rel_err " $5 }
                END { printf "%d rows, %d with #wrong > 0; largest %s", rows, bad, last }')
  r=PASS
  if [[ " ${rank_codes[*]} " =~ [^0\ ] ]]; then
    r=FAIL
    detail="exit codes ${rank_codes[*]} (124: timed out): $(grep -h -m 1 'error' "$OUT/$name".rank*.log | head -n 1 | cut -c1-120)"
  elif ! grep -q '^# Out of bounds values : 0 OK' "$log" || [[ -z "$(bench_columns "$log" size)" ]]; then
    r=FAIL
  fi
  row "${bench_section:-shim}" "$label" "$r" "$detail ($name.rank*.log)"
  fail_if "$r"
}

section_shim() {
  local cuda rc detail r t nccl n log
  shim_deadline=$((SECONDS + ${LGRECO_GPU_SHIM_SECONDS:-480}))
  cuda=$(cuda_home)
  if [[ ! -x "$cuda/bin/nvcc" ]]; then
    row shim "build liblgreco.so, lgreco-bench" FAIL "no nvcc ($cuda/bin/nvcc, PATH): set CUDA_HOME"; failed=1; return
  fi
  t=$(shim_time 240)
  prebuilt build/lib/liblgreco.so build/bin/lgreco-bench build/bin/lgreco-config ||
    timeout "$t" make -j"$JOBS" build/lib/liblgreco.so build/bin/lgreco-bench build/bin/lgreco-config \
    CUDA_HOME="$cuda" PYTHON="$PY" > "$OUT/shim-build.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 || ! -x build/bin/lgreco-bench || ! -f build/lib/liblgreco.so ]]; then
    detail=$(grep -m 1 -E 'error|No rule' "$OUT/shim-build.log" | cut -c1-100)
    detail="exit $rc: ${detail:-$(last_line "$OUT/shim-build.log")}"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row shim "build liblgreco.so, lgreco-bench" FAIL "$detail (shim-build.log)"; failed=1; return
  fi
  row shim "build liblgreco.so, lgreco-bench" PASS "CUDA at $cuda"
  nccl=$(torch_nccl)
  row shim "NCCL for lgreco-bench" INFO "$nccl"

  # 1. lgreco-bench --fabric nccl, 2 and 4 ranks on the one GPU.
  local at64 target_row=""
  for n in 2 4; do
    t=$(shim_time 90)
    if [[ $t -eq 0 ]]; then row shim "bench $n ranks" FAIL "skipped: the section ran out of time"; failed=1; continue; fi
    shim_bench "shim-bench-$n" "$n" "$t" "lgreco-bench --fabric nccl, $n ranks on one GPU (rank 0)" \
      "bench $n ranks: #wrong 0, bit-identical" \
      --nccl-lib "$nccl" --codec quant:bits=4 -d float -b 1M -e 64M -f 4 -n 10 -w 3 --timeout 60
    if [[ $n -eq 4 ]]; then
      at64=$(bench_columns "$OUT/shim-bench-$n.rank0.log" size vs_nccl | awk '$1 == 67108864 { print $2 }')
      if [[ -z "$at64" ]]; then target_row="missed: no 64 MiB row"
      elif awk -v s="$at64" 'BEGIN { exit !(s >= 3.0) }'; then target_row="met: ${at64}x plain NCCL"
      else target_row="missed: ${at64}x plain NCCL"; fi
    fi
  done
  [[ -n "$target_row" ]] && row shim "target: 4 ranks, 64 MiB, >= 3x NCCL" INFO "$target_row"

  # 1b. The other families through the CUDA backend: TopK's kernels and PowerSGD's
  # (cuBLAS), 4 ranks, 16 and 64 MiB. Correct as above (PowerSGD has no per-element bound:
  # rel_err and bit-identity only); their speed against NCCL is reported, not judged.
  local codec
  for codec in topk:density=0.01 powersgd:rank=4; do
    t=$(shim_time 60)
    if [[ $t -eq 0 ]]; then row shim "bench 4 ranks $codec" INFO "skipped: the section ran out of time"; continue; fi
    shim_bench "shim-bench-${codec%%:*}" 4 "$t" "lgreco-bench --fabric nccl --codec $codec, 4 ranks on one GPU (rank 0)" \
      "bench 4 ranks $codec: #wrong 0, bit-identical" \
      --nccl-lib "$nccl" --codec "$codec" -d float -b 16M -e 64M -f 4 -n 10 -w 3 --timeout 50
  done

  # 2. Unmodified DDP under LD_PRELOAD (its own per-run timeouts; this one is a backstop).
  t=$(shim_time 600)
  if [[ $t -eq 0 ]]; then row shim "DDP under LD_PRELOAD" FAIL "skipped: the section ran out of time"; failed=1; return; fi
  timeout -k 10 "$t" "$PY" tests/gpu/ddp_check.py --python "$PY" --lib build/lib/liblgreco.so --out "$OUT" \
    --ranks 2,4 --seconds $((t - 15)) --table "$OUT/shim-ddp-table.txt" > "$OUT/shim-ddp.log" 2>&1
  rc=$?
  local name verdict line
  while IFS= read -r line; do
    line=${line#RESULT: }
    name=${line%% *}; line=${line#* }
    verdict=${line%% *}; detail=${line#* }
    [[ "$verdict" == SKIP ]] && verdict=INFO
    row shim "DDP $name" "$verdict" "$(cut -c1-200 <<< "$detail")"
    fail_if "$verdict"
  done < <(grep -E '^RESULT: ' "$OUT/shim-ddp.log")
  if [[ $rc -ne 0 ]] && ! grep -qE '^RESULT: [^ ]+ FAIL' "$OUT/shim-ddp.log"; then
    row shim "DDP under LD_PRELOAD" FAIL "ddp_check.py exit $rc: $(last_line "$OUT/shim-ddp.log") (shim-ddp.log)"; failed=1
  fi
  [[ -s "$OUT/shim-ddp-table.txt" ]] && appendix+=("$OUT/shim-ddp-table.txt")
}

# lgreco's net plugin under the real NCCL: lgreco-gpu-net-check over NCCL_NET=lgreco and
# NCCL_NET=Socket, then DDP with the plugin and no LD_PRELOAD (tests/gpu/ddp_net_check.py).
# One deadline for all steps (LGRECO_GPU_NET_SECONDS, default 380 s). Expected on an H200:
# build 1-2 min cold, each net check 10-30 s (NCCL over loopback sockets moved 1.86 GB/s
# algbw with 2 ranks and 0.62 GB/s with 4 at 256 MB), DDP about 1 min per run.
net_deadline=0
net_time() {
  local left=$((net_deadline - SECONDS))
  (( left > $1 )) && left=$1
  (( left < 20 )) && left=0
  echo "$left"
}

# net_run NAME NRANKS NET SECONDS: lgreco-gpu-net-check over NCCL_NET=NET; its table in
# $OUT/NAME.log, NCCL's log of each rank in $OUT/NAME.nccl.<pid>.log. Sets net_rc.
net_run() {
  local name=$1 n=$2 net=$3 t=$4 plugin_env
  rm -f "$OUT/$name".nccl.*.log
  if [[ "$net" == lgreco ]]; then
    plugin_env=(NCCL_NET_PLUGIN="$PWD/build/lib/libnccl-net-lgreco.so" LGRECO_NET=socket LGRECO_SOCKET_IFNAME=lo)
  else
    plugin_env=(NCCL_NET_PLUGIN=none)
  fi
  env NCCL_NET="$net" "${plugin_env[@]}" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET \
    NCCL_DEBUG_FILE="$OUT/$name.nccl.%p.log" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
    NCCL_HOSTID="lgreco-$name" LGRECO_DEBUG=WARN \
    timeout -k 10 "$t" build/bin/lgreco-gpu-net-check --ranks "$n" --nccl-lib "$net_nccl" \
      -b 1M -e 256M -f 4 -n 5 -w 2 --timeout $((t - 10)) > "$OUT/$name.log" 2>&1
  net_rc=$?
}

section_net() {
  local cuda rc detail r t n net name log files using
  local -A busbw=()
  net_deadline=$((SECONDS + ${LGRECO_GPU_NET_SECONDS:-380}))
  cuda=$(cuda_home)
  if [[ ! -x "$cuda/bin/nvcc" ]]; then
    row net "build plugin, lgreco-gpu-net-check" FAIL "no nvcc ($cuda/bin/nvcc, PATH): set CUDA_HOME"; failed=1; return
  fi
  t=$(net_time 240)
  timeout "$t" make -j"$JOBS" build/lib/libnccl-net-lgreco.so build/bin/lgreco-gpu-net-check \
    CUDA_HOME="$cuda" PYTHON="$PY" > "$OUT/net-build.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 || ! -x build/bin/lgreco-gpu-net-check || ! -e build/lib/libnccl-net-lgreco.so ]]; then
    detail=$(grep -m 1 -E 'error|No rule' "$OUT/net-build.log" | cut -c1-100)
    detail="exit $rc: ${detail:-$(last_line "$OUT/net-build.log")}"
    [[ $rc -eq 124 ]] && detail="timed out after $t s"
    row net "build plugin, lgreco-gpu-net-check" FAIL "$detail (net-build.log)"; failed=1; return
  fi
  row net "build plugin, lgreco-gpu-net-check" PASS "CUDA at $cuda"
  net_nccl=${LGRECO_GPU_NCCL_LIB:-$(torch_nccl)}
  row net "NCCL for the checks" INFO "$net_nccl"

  # a, b. lgreco's transport and NCCL's Socket, 2 and 4 ranks, one after the other.
  # Rows: size count type redop time(us) algbw busbw #wrong max_err/bound
  for n in 2 4; do
    for net in lgreco Socket; do
      name="net-${net,,}-$n"
      t=$(net_time $((n == 2 ? 75 : 110)))
      if [[ $t -eq 0 ]]; then
        row net "$net, $n ranks: allreduce correct" FAIL "skipped: the section ran out of time"; failed=1; continue
      fi
      net_run "$name" "$n" "$net" "$t"
      log="$OUT/$name.log"
      files=$(find "$OUT" -maxdepth 1 -name "$name.nccl.*.log" | wc -l)
      using=$(grep -l "NCCL INFO Using network $net\$" "$OUT/$name".nccl.*.log 2>/dev/null | wc -l)
      detail=$(awk '!/^#/ && NF == 9 { rows++; if ($8 != "0") bad++; if ($9 + 0 > worst) worst = $9 + 0 }
                    END { printf "%d sizes, %d with #wrong > 0, max err/bound %.3g", rows, bad, worst }' "$log")
      r=PASS
      if [[ $net_rc -ne 0 ]]; then
        # 1: wrong values or a rank failed, 3: its watchdog, 124: killed by timeout here.
        r=FAIL
        detail="$detail; exit $net_rc$( ((net_rc == 124)) && echo " (timed out after $t s)"): $(
          grep -m 1 -E 'error|outside the bound|changed' "$log" | cut -c1-160)"
      elif ! grep -q '^# Out of bounds values : 0 OK' "$log" || \
           [[ $(awk '!/^#/ && NF == 9' "$log" | wc -l) -ne 5 ]]; then
        r=FAIL
      fi
      if [[ $using -ne $n ]]; then
        r=FAIL
        detail="$detail; 'Using network $net' in $using of $n ranks' NCCL logs ($files files$(
          grep -h -o -m 1 'Using network [^ ]*' "$OUT/$name".nccl.*.log 2>/dev/null | sort -u | sed 's/^/, /' | tr -d '\n'))"
      else
        detail="$detail; every rank: Using network $net"
      fi
      if [[ "$net" == lgreco ]] && ! grep -q 'Successfully loaded external network plugin' "$OUT/$name".nccl.*.log 2>/dev/null; then
        detail="$detail; no 'Successfully loaded external network plugin' line"
      fi
      row net "$net, $n ranks: allreduce correct" "$r" "$detail ($name.log)"
      fail_if "$r"
      while read -r size bw; do busbw[$net,$n,$size]=$bw; done < <(awk '!/^#/ && NF == 9 { print $1, $7 }' "$log")
    done
  done

  # The busbw table, and the target: lgreco's transport at least as fast as NCCL's Socket
  # from 64 MiB up.
  local table="$OUT/net-busbw-table.txt" size lg so ratio worst
  {
    echo "== NCCL allreduce float32 busbw (GB/s), ranks sharing one GPU over loopback: lgreco's net plugin vs NCCL's Socket =="
    printf '%6s %12s %10s %10s %8s\n' ranks size lgreco Socket ratio
  } > "$table"
  for n in 2 4; do
    worst=""
    for size in 1048576 4194304 16777216 67108864 268435456; do
      lg=${busbw[lgreco,$n,$size]:-}; so=${busbw[Socket,$n,$size]:-}
      ratio=-
      if [[ -n "$lg" && -n "$so" ]]; then
        ratio=$(awk -v a="$lg" -v b="$so" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
      fi
      printf '%6s %12s %10s %10s %8s\n' "$n" "$size" "${lg:--}" "${so:--}" "$ratio" >> "$table"
      if (( size >= 67108864 )); then
        if [[ "$ratio" == - ]]; then worst=missing
        elif [[ "$worst" != missing ]] && { [[ -z "$worst" ]] || awk -v a="$ratio" -v b="$worst" 'BEGIN { exit !(a < b) }'; }; then
          worst=$ratio
        fi
      fi
    done
    if [[ "$worst" == missing || -z "$worst" ]]; then detail="missed: no busbw for both at 64 and 256 MiB"
    elif awk -v a="$worst" 'BEGIN { exit !(a >= 1.0) }'; then detail="met: ${worst}x Socket's busbw at worst (64, 256 MiB)"
    else detail="missed: ${worst}x Socket's busbw at worst (64, 256 MiB)"; fi
    row net "target n=$n: >=64 MiB >=1.0x Socket" INFO "$detail"
  done
  appendix+=("$table")

  # c. DDP with the plugin and no LD_PRELOAD (its own per-run timeouts; this is a backstop).
  t=$(net_time 600)
  if [[ $t -lt 60 ]]; then row net "DDP with the net plugin" FAIL "skipped: the section ran out of time"; failed=1; return; fi
  timeout -k 10 "$t" "$PY" tests/gpu/ddp_net_check.py --python "$PY" --plugin build/lib/libnccl-net-lgreco.so \
    --out "$OUT" --ranks 2 --seconds $((t - 15)) --table "$OUT/net-ddp-table.txt" > "$OUT/net-ddp.log" 2>&1
  rc=$?
  local verdict line
  while IFS= read -r line; do
    line=${line#RESULT: }
    name=${line%% *}; line=${line#* }
    verdict=${line%% *}; detail=${line#* }
    [[ "$verdict" == SKIP ]] && verdict=INFO
    row net "DDP $name" "$verdict" "$(cut -c1-300 <<< "$detail")"
    fail_if "$verdict"
  done < <(grep -E '^RESULT: ' "$OUT/net-ddp.log")
  if [[ $rc -ne 0 ]] && ! grep -qE '^RESULT: [^ ]+ FAIL' "$OUT/net-ddp.log"; then
    row net "DDP with the net plugin" FAIL "ddp_net_check.py exit $rc: $(last_line "$OUT/net-ddp.log") (net-ddp.log)"; failed=1
  fi
  [[ -s "$OUT/net-ddp-table.txt" ]] && appendix+=("$OUT/net-ddp-table.txt")
}

section_package() {
  local venv=/tmp/lgreco-gpu-venv log="$OUT/package.log" info="$OUT/package-info.txt" version preload
  rm -rf "$venv"
  if ! timeout 120 "$PY" -m venv --system-site-packages "$venv" > "$log" 2>&1; then
    row package "venv of $PY" FAIL "$(last_line "$log") (package.log)"; failed=1; return
  fi
  if ! PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 LGRECO_MAKE_JOBS=$JOBS timeout 480 \
       "$venv/bin/pip" install --no-cache-dir . >> "$log" 2>&1; then
    row package "pip install . (offline)" FAIL "$(last_line "$log") (package.log)"; failed=1; return
  fi
  version=$("$venv/bin/python" -c 'import lgreco; print(lgreco.__version__)' 2>> "$log")
  row package "pip install . (offline)" PASS "lgreco $version"
  "$venv/bin/lgreco" info > "$info" 2>&1
  if grep -qE '^  torch [^ ]+: NCCL 2\.' "$info"; then
    row package "lgreco info: torch's NCCL" PASS "$(grep -E '^  torch ' "$info" | head -n1 | cut -c3-120)"
  else
    row package "lgreco info: torch's NCCL" FAIL "$(grep -E '^  torch ' "$info" | head -n1 | cut -c3-120) (package-info.txt)"
    failed=1
  fi
  if grep -qE '^CUDA driver: .*: fine$' "$info"; then
    row package "lgreco info: CUDA driver" PASS "$(grep -E '^CUDA driver:' "$info" | cut -c17-140)"
  else
    row package "lgreco info: CUDA driver" FAIL "$(grep -E '^CUDA driver:' "$info" | cut -c17-140) (package-info.txt)"
    failed=1
  fi
  preload=$("$venv/bin/lgreco-run" -- sh -c 'echo $LD_PRELOAD' 2>> "$log")
  if [[ "$preload" == "$venv"/lib/python*/site-packages/lgreco/_lib/liblgreco.so ]]; then
    row package "lgreco-run LD_PRELOAD" PASS "$preload"
  else
    row package "lgreco-run LD_PRELOAD" FAIL "'$preload' (package.log)"; failed=1
  fi
  appendix+=("$info")
}

# The product check: one command, under 8 minutes from a bare GPU machine with a cold
# build (LGRECO_GPU_FIRST_SECONDS, default 460, bounds every step together). A row per
# check, PASS, FAIL or SKIP (not run: out of time, or an earlier step it needs failed),
# each with its figure; full logs under $OUT. Steps:
#   1. build liblgreco.so (+ the net plugin's name), lgreco-bench, lgreco-config and
#      lgreco-gpu-codec-check with every core (or LGRECO_GPU_PREBUILT); its wall time
#      against the 90 s target, and the build's first line (which CUDA folders it used)
#   2. the quantization kernels against the CPU reference (lgreco-gpu-codec-check
#      --check --quick)
#   3. unmodified DDP, 4 ranks on the one GPU, under LD_PRELOAD: plain NCCL, uniform 4-bit
#      and adaptive (tests/gpu/ddp_check.py --runs plain,uniform,adaptive): compressed
#      calls on every rank, identical parameters on every rank, loss and accuracy within
#      ddp_check.py's bounds of plain NCCL's
#   4. lgreco-bench --fabric nccl, quant:bits=4, 4 ranks, 64 MiB float32, against plain
#      NCCL (columns read by name): #wrong 0, bit-identical outputs; PASS when faster
#      than NCCL, the 3x target reported in the row
#   5. the same DDP job (4 ranks) through NCCL_NET_PLUGIN=lgreco without LD_PRELOAD
#      (tests/gpu/ddp_net_check.py)
first_deadline=0
first_time() { step_time "$1" "$first_deadline"; }

# first_results LOG: a row per `RESULT: NAME VERDICT DETAIL` line of a ddp check's log.
first_results() {
  local line name verdict detail
  while IFS= read -r line; do
    line=${line#RESULT: }
    name=${line%% *}; line=${line#* }
    verdict=${line%% *}; detail=${line#* }
    row first "DDP $name" "$verdict" "$(cut -c1-200 <<< "$detail")"
    fail_if "$verdict"
  done < <(grep -E '^RESULT: ' "$1")
}

section_first() {
  local cuda rc t detail r start log nccl at64 lib=${LGRECO_GPU_LIB_DIR:-build/lib}
  local tools=("$lib/liblgreco.so" "$BIN/lgreco-bench" "$BIN/lgreco-config" "$BIN/lgreco-gpu-codec-check")
  first_deadline=$((SECONDS + ${LGRECO_GPU_FIRST_SECONDS:-460}))

  # 1. Build.
  if prebuilt "${tools[@]}"; then
    row first "build" PASS "prebuilt (LGRECO_GPU_PREBUILT)"
  else
    cuda=$(cuda_home)
    if [[ ! -x "$cuda/bin/nvcc" ]]; then
      row first "build" FAIL "no nvcc ($cuda/bin/nvcc, PATH): set CUDA_HOME"; failed=1; return
    fi
    t=$(first_time 200)
    start=$SECONDS
    timeout "$t" make -j"$JOBS" build/lib/liblgreco.so build/lib/libnccl-net-lgreco.so build/bin/lgreco-bench \
      build/bin/lgreco-config build/bin/lgreco-gpu-codec-check CUDA_HOME="$cuda" PYTHON="$PY" > "$OUT/first-build.log" 2>&1
    rc=$?
    local f missing=""
    for f in "${tools[@]}"; do [[ -e "$f" ]] || missing="$missing ${f##*/}"; done
    if [[ $rc -ne 0 || -n "$missing" ]]; then
      detail=$(grep -m 1 -E 'error|No rule' "$OUT/first-build.log" | cut -c1-120)
      detail="exit $rc: ${detail:-$(last_line "$OUT/first-build.log")}${missing:+; missing:$missing}"
      [[ $rc -eq 124 ]] && detail="timed out after $t s"
      row first "build" FAIL "$detail (first-build.log)"; failed=1; return
    fi
    t=$((SECONDS - start))
    row first "build" PASS "$t s wall with -j$JOBS (target < 90 s: $( ((t < 90)) && echo met || echo missed))"
    row first "  toolkit" INFO "$(grep -m 1 '^lgreco build: ' "$OUT/first-build.log" | cut -c15-220)"
  fi
  [[ -e "$lib/libnccl-net-lgreco.so" ]] || ln -sf liblgreco.so "$lib/libnccl-net-lgreco.so"

  # 2. The quantization kernels against the CPU reference.
  check_step first "quant kernels = CPU reference" "$BIN/lgreco-gpu-codec-check" first-codec 60 "$first_deadline" --quick

  # 3. Unmodified DDP under LD_PRELOAD, 4 ranks: plain, uniform, adaptive.
  t=$(first_time 200)
  if [[ $t -eq 0 ]]; then
    row first "DDP 4 ranks under LD_PRELOAD" SKIP "the section ran out of time"
  else
    log="$OUT/first-ddp.log"
    timeout -k 10 "$t" "$PY" tests/gpu/ddp_check.py --python "$PY" --lib "$lib/liblgreco.so" --out "$OUT" \
      --ranks 4 --runs plain,uniform,adaptive --seconds $((t - 15)) --config-tool "$BIN/lgreco-config" \
      --table "$OUT/first-ddp-table.txt" > "$log" 2>&1
    rc=$?
    first_results "$log"
    if [[ $rc -ne 0 ]] && ! grep -qE '^RESULT: [^ ]+ FAIL' "$log"; then
      row first "DDP 4 ranks under LD_PRELOAD" FAIL "ddp_check.py exit $rc: $(last_line "$log") (first-ddp.log)"; failed=1
    fi
    [[ -s "$OUT/first-ddp-table.txt" ]] && appendix+=("$OUT/first-ddp-table.txt")
  fi

  # 4. lgreco-bench against plain NCCL at 64 MiB, 4 ranks.
  t=$(first_time 90)
  if [[ $t -eq 0 ]]; then
    row first "bench 4 ranks 64 MiB" SKIP "the section ran out of time"
  else
    nccl=$(torch_nccl)
    bench_section=first shim_bench first-bench 4 "$t" "lgreco-bench --fabric nccl, 4 ranks on one GPU (rank 0)" \
      "bench 4 ranks 64 MiB: correct" --nccl-lib "$nccl" --codec quant:bits=4 -d float -b 64M -e 64M -n 10 -w 3 \
      --timeout $((t - 10))
    at64=$(bench_columns "$OUT/first-bench.rank0.log" size vs_nccl | awk '$1 == 67108864 { print $2 }')
    if [[ -z "$at64" || "$at64" == - ]]; then
      row first "bench 4 ranks 64 MiB: vs NCCL" FAIL "no 64 MiB row with a vs_nccl column (first-bench.rank0.log)"
      failed=1
    elif awk -v s="$at64" 'BEGIN { exit !(s >= 1.0) }'; then
      row first "bench 4 ranks 64 MiB: vs NCCL" PASS \
        "${at64}x plain NCCL's time (target 3x: $(awk -v s="$at64" 'BEGIN { print (s >= 3.0) ? "met" : "missed" }'))"
    else
      row first "bench 4 ranks 64 MiB: vs NCCL" FAIL "${at64}x plain NCCL's time: slower than NCCL (target 3x)"
      failed=1
    fi
  fi

  # 5. The same DDP job through the net plugin, no LD_PRELOAD.
  t=$(first_time 150)
  if [[ $t -lt 60 ]]; then
    row first "DDP 4 ranks, net plugin" SKIP "the section ran out of time"
  else
    log="$OUT/first-net-ddp.log"
    timeout -k 10 "$t" "$PY" tests/gpu/ddp_net_check.py --python "$PY" --plugin "$lib/libnccl-net-lgreco.so" \
      --out "$OUT" --ranks 4 --seconds $((t - 15)) --table "$OUT/first-net-ddp-table.txt" > "$log" 2>&1
    rc=$?
    first_results "$log"
    if [[ $rc -ne 0 ]] && ! grep -qE '^RESULT: [^ ]+ FAIL' "$log"; then
      row first "DDP 4 ranks, net plugin" FAIL "ddp_net_check.py exit $rc: $(last_line "$log") (first-net-ddp.log)"
      failed=1
    fi
    [[ -s "$OUT/first-net-ddp-table.txt" ]] && appendix+=("$OUT/first-net-ddp-table.txt")
  fi
}

sections=("$@")
[[ ${#sections[@]} -eq 0 ]] && sections=(register codec families backend shim net package)
for s in "${sections[@]}"; do
  case "$s" in
    first) section_first ;;
    register) section_register ;;
    codec) section_codec ;;
    families) section_families ;;
    backend) section_backend ;;
    shim) section_shim ;;
    net) section_net ;;
    package) section_package ;;
    *) echo "tests/gpu/run.sh: unknown section '$s' (sections: first register codec families backend shim net package)" >&2; exit 2 ;;
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
