#!/usr/bin/env bash
# The logic of `tests/gpu/run.sh first` without a GPU: its programs replaced by stubs
# (lgreco-bench, lgreco-gpu-codec-check, lgreco-config, and a python that answers for
# ddp_check.py, ddp_net_check.py and the NCCL lookup), each case a way the real ones can
# answer; the table's rows and the exit code are checked. Run by `make test-python`.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
work=$(mktemp -d /tmp/lgreco-first-stub.XXXXXX)
trap 'rm -rf "$work"' EXIT
stub=$work/bin
mkdir -p "$stub" "$work/lib"
: > "$work/lib/liblgreco.so"

# lgreco-bench: STUB_BENCH=good|reordered-slow|wrong|no-row.
cat > "$stub/lgreco-bench" <<'EOF'
#!/bin/sh
echo "# lgreco-bench stub"
case "$STUB_BENCH" in
  good)
    echo "#        size        count      type                  codec    time(us)     algbw     busbw       wire_B wire_GB/s    rel_err   #wrong   nccl_us  vs_nccl"
    echo "     67108864     16777216     float           quant:bits=4      2000.0    33.554    50.331      8519680     4.260  9.380e-02        0    6400.0     3.20"
    echo "# Out of bounds values : 0 OK" ;;
  reordered-slow)  # other columns first, as the tools issue's nccl-tests layout will have
    echo "#        size        count      type   redop    root  vs_nccl   nccl_us    time(us)  #wrong    rel_err"
    echo "     67108864     16777216     float     sum      -1     0.80    1600.0     2000.0        0  9.380e-02"
    echo "# Out of bounds values : 0 OK" ;;
  wrong)
    echo "#        size        count      type    time(us)   #wrong    rel_err   nccl_us  vs_nccl"
    echo "     67108864     16777216     float      2000.0       12  9.380e-02    6400.0     3.20"
    echo "# Out of bounds values : 12 FAILED" ;;
  no-row)
    echo "#        size        count      type    time(us)   #wrong" ;;
esac
EOF
# lgreco-gpu-codec-check: STUB_CODEC=pass|fail.
cat > "$stub/lgreco-gpu-codec-check" <<'EOF'
#!/bin/sh
if [ "$STUB_CODEC" = pass ]; then echo "SUMMARY: 240 cases, 0 failed"; exit 0; fi
echo "# failed: bits=3 float16 n=1025: byte 17 differs"; echo "SUMMARY: 240 cases, 1 failed"; exit 1
EOF
printf '#!/bin/sh\nexit 0\n' > "$stub/lgreco-config"
# python: STUB_DDP=pass|fail|crash for ddp_check.py, STUB_NET=pass|fail for ddp_net_check.py.
cat > "$stub/python" <<'EOF'
#!/bin/sh
case "$1" in
  -) cat > /dev/null; echo /stub/libnccl.so.2 ;;
  tests/gpu/ddp_check.py)
    case " $* " in *" --ranks 4 --runs plain,uniform,adaptive "*) ;; *) echo "stub: unexpected arguments: $*"; exit 2 ;; esac
    echo "RESULT: register PASS buckets [1, 2]"
    echo "RESULT: ddp-4-plain PASS accuracy 0.95"
    case "$STUB_DDP" in
      pass) echo "RESULT: ddp-4-uniform PASS 2.9x fewer bytes"; echo "RESULT: ddp-4-adaptive PASS 3.4x fewer bytes" ;;
      fail) echo "RESULT: ddp-4-uniform FAIL no compressed calls on rank 2"; echo "RESULT: ddp-4-adaptive PASS ok"; exit 1 ;;
      crash) echo "Traceback: boom"; exit 1 ;;
    esac ;;
  tests/gpu/ddp_net_check.py)
    echo "RESULT: net-plain PASS ok"
    if [ "$STUB_NET" = pass ]; then echo "RESULT: net-plugin PASS compressed on 4 ranks"
    else echo "RESULT: net-plugin FAIL no 'Using network lgreco'"; exit 1; fi ;;
  *) echo "stub python: unexpected $*"; exit 2 ;;
esac
EOF
chmod +x "$stub"/*

failures=0
# case NAME EXPECTED_EXIT ENV... -- PATTERN...: run the section; each PATTERN (an extended
# regular expression) must match a line of its output.
case_() {
  local name=$1 want=$2 out rc p
  shift 2
  local envs=()
  while [[ $# -gt 0 && "$1" != -- ]]; do envs+=("$1"); shift; done
  shift
  out=$(env STUB_BENCH=good STUB_CODEC=pass STUB_DDP=pass STUB_NET=pass "${envs[@]}" LGRECO_GPU_PREBUILT=1 \
        LGRECO_GPU_BIN="$stub" LGRECO_GPU_LIB_DIR="$work/lib" PYTHON="$stub/python" OUT="$work/out-$name" \
        bash tests/gpu/run.sh first 2>&1)
  rc=$?
  local bad=""
  [[ $rc -eq $want ]] || bad="exit $rc, expected $want"
  for p in "$@"; do
    grep -qE -- "$p" <<< "$out" || bad="${bad:+$bad; }no line matches /$p/"
  done
  if [[ -n "$bad" ]]; then
    echo "FAIL first_stub_test $name: $bad"; echo "$out" | sed 's/^/    /'; failures=$((failures + 1))
  else
    echo "ok   first_stub_test $name"
  fi
}

case_ all-good 0 -- \
  '^first +build +PASS +prebuilt' \
  '^first +quant kernels = CPU reference +PASS +240 cases, 0 failed' \
  '^first +DDP ddp-4-uniform +PASS' '^first +DDP ddp-4-adaptive +PASS' \
  '^first +bench 4 ranks 64 MiB: correct +PASS +1 rows, 0 with #wrong > 0; largest 67108864 B: 2000.0 us, NCCL 6400.0 us: 3.20x' \
  '^first +bench 4 ranks 64 MiB: vs NCCL +PASS +3.20x plain NCCL.s time \(target 3x: met\)' \
  '^first +DDP net-plugin +PASS'
case_ columns-by-name-slower-than-nccl 1 STUB_BENCH=reordered-slow -- \
  '^first +bench 4 ranks 64 MiB: correct +PASS +1 rows, 0 with #wrong > 0; largest 67108864 B: 2000.0 us, NCCL 1600.0 us: 0.80x' \
  '^first +bench 4 ranks 64 MiB: vs NCCL +FAIL +0.80x'
case_ wrong-values 1 STUB_BENCH=wrong -- \
  '^first +bench 4 ranks 64 MiB: correct +FAIL +1 rows, 1 with #wrong > 0'
case_ no-result-row 1 STUB_BENCH=no-row -- \
  '^first +bench 4 ranks 64 MiB: correct +FAIL +0 rows' '^first +bench 4 ranks 64 MiB: vs NCCL +FAIL +no 64 MiB row'
case_ kernel-mismatch 1 STUB_CODEC=fail -- \
  '^first +quant kernels = CPU reference +FAIL +240 cases, 1 failed' '^first +  failed +FAIL +bits=3 float16'
case_ ddp-fails 1 STUB_DDP=fail -- \
  '^first +DDP ddp-4-uniform +FAIL +no compressed calls on rank 2' '^first +DDP ddp-4-adaptive +PASS'
case_ ddp-crashes 1 STUB_DDP=crash -- '^first +DDP 4 ranks under LD_PRELOAD +FAIL +ddp_check.py exit 1: Traceback: boom'
case_ net-plugin-fails 1 STUB_NET=fail -- '^first +DDP net-plugin +FAIL +no .Using network lgreco.'
case_ out-of-time 1 LGRECO_GPU_FIRST_SECONDS=1 -- \
  '^first +DDP 4 ranks under LD_PRELOAD +SKIP +the section ran out of time' \
  '^first +bench 4 ranks 64 MiB +SKIP' '^first +DDP 4 ranks, net plugin +SKIP'
# Without LGRECO_GPU_PREBUILT and without nvcc, the build step says so and nothing else runs.
out=$(env CUDA_HOME="$work/no-cuda" PATH=/usr/bin:/bin LGRECO_GPU_BIN="$stub" OUT="$work/out-nocuda" \
      bash tests/gpu/run.sh first 2>&1)
if [[ $? -eq 1 ]] && grep -qE '^first +build +FAIL +no nvcc' <<< "$out" && ! grep -q 'quant kernels' <<< "$out"; then
  echo "ok   first_stub_test no-nvcc"
else
  echo "FAIL first_stub_test no-nvcc"; echo "$out" | sed 's/^/    /'; failures=$((failures + 1))
fi

[[ $failures -eq 0 ]] && echo "first_stub_test: all cases pass" || echo "first_stub_test: $failures case(s) failed"
exit $((failures > 0))
