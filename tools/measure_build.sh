#!/usr/bin/env bash
# The CPU time of a clean build, and where it goes: clones REV (default HEAD) of this
# repository into a temporary folder, builds what `make test` builds from scratch, and
# prints the wall time, the user + system CPU time of the whole make, and the compiler
# commands that took the most CPU. docs/PERF.md ("Build time") records its figures.
#
#   tools/measure_build.sh [--jobs N] [--top N] [--keep] [REV]
#
# Each compiler call (g++, nvcc, clang++) runs under /usr/bin/time through a wrapper, so
# the breakdown comes from the same build as the total. CUDA_HOME is passed to make as a
# folder of links to the real toolkit whose bin/nvcc is the wrapper.
set -euo pipefail

jobs=$(nproc)
top=15
keep=0
rev=HEAD
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) jobs=$2; shift 2 ;;
    --jobs=*) jobs=${1#--jobs=}; shift ;;
    --top) top=$2; shift 2 ;;
    --top=*) top=${1#--top=}; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "measure_build.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    *) rev=$1; shift ;;
  esac
done
case "$jobs$top" in *[!0-9]*) echo "measure_build.sh: --jobs and --top take a number" >&2; exit 2 ;; esac
[ -x /usr/bin/time ] || { echo "measure_build.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 1; }

cuda=${CUDA_HOME:-/usr/local/cuda}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse --short "$rev")
work=$(mktemp -d /tmp/lgreco-build-time.XXXXXX)
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT
log=$work/commands.log
: > "$log"

# Wrappers: one line per call, "wall user sys compiler output".
mkdir -p "$work/wrap/bin" "$work/cuda/bin"
wrapper() {  # NAME REAL
  cat > "$work/wrap/bin/$1" <<EOF
#!/bin/sh
out=?; prev=
for a in "\$@"; do [ "\$prev" = -o ] && out=\$a; prev=\$a; done
exec /usr/bin/time -a -o "$log" -f "%e %U %S $1 \$out" "$2" "\$@"
EOF
  chmod +x "$work/wrap/bin/$1"
}
wrapper g++ "$(command -v g++)"
command -v clang++ > /dev/null && wrapper clang++ "$(command -v clang++)"
if [ -x "$cuda/bin/nvcc" ]; then
  for f in "$cuda"/*; do [ "$(basename "$f")" = bin ] || ln -s "$f" "$work/cuda/$(basename "$f")"; done
  for f in "$cuda"/bin/*; do ln -s "$f" "$work/cuda/bin/$(basename "$f")"; done
  rm "$work/cuda/bin/nvcc"
  wrapper nvcc "$cuda/bin/nvcc"
  cp "$work/wrap/bin/nvcc" "$work/cuda/bin/nvcc"
fi

git clone -q "$repo" "$work/src"
git -C "$work/src" checkout -q "$commit"
cd "$work/src"
targets="all build/bin/lgreco-unit-tests build/bin/lgreco-tsan-tests"
for t in lgreco-gpu-codec-check lgreco-gpu-backend-check lgreco-gpu-net-check lgreco-gpu-topk-check \
         lgreco-gpu-lowrank-check; do
  grep -q "$t" Makefile && targets="$targets build/bin/$t"
done
echo "measure_build.sh: $commit, make -j$jobs $targets"
start=$(date +%s.%N)
PATH="$work/wrap/bin:$PATH" /usr/bin/time -o "$work/make.time" -f "%e %U %S" \
  make -j"$jobs" CXX=g++ CUDA_HOME="$work/cuda" NCCL_HOME="$cuda" $targets > "$work/make.log" 2>&1 ||
  { tail -30 "$work/make.log"; echo "measure_build.sh: the build failed (log: $work/make.log)" >&2; exit 1; }
read -r wall user sys < "$work/make.time"
awk -v c="$commit" -v j="$jobs" -v w="$wall" -v u="$user" -v s="$sys" 'BEGIN {
  printf "build %s -j%s: wall %.0f s, CPU %.0f s (user %.0f + sys %.0f)\n", c, j, w, u + s, u, s }'
awk '{ cpu[$4] += $2 + $3; n[$4]++ } END {
  for (k in cpu) printf "  %-8s %5d calls, CPU %6.0f s\n", k, n[k], cpu[k] }' "$log"
echo "  the $top costliest commands (CPU s, wall s, output):"
awk '{ printf "%8.1f %8.1f  %s %s\n", $2 + $3, $1, $4, $5 }' "$log" | sort -rn | head -n "$top"
[ "$keep" = 1 ] && echo "measure_build.sh: kept $work"
exit 0
