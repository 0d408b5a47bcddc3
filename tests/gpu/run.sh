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
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/lgreco-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 LGRECO_DEBUG=NONE
JOBS=$(nproc 2>/dev/null || echo 4)

rows=()
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

sections=("$@")
[[ ${#sections[@]} -eq 0 ]] && sections=(register)
for s in "${sections[@]}"; do
  case "$s" in
    register) section_register ;;
    *) echo "tests/gpu/run.sh: unknown section '$s' (sections: register)" >&2; exit 2 ;;
  esac
done

echo
echo "== lgreco GPU checks ($(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || echo 'no GPU')) =="
printf '%-9s %-34s %-5s %s\n' section check result detail
printf '%s\n' "${rows[@]}"
exit "$failed"
