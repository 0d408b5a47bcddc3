#!/usr/bin/env bash
# Installs the Debian packages lgreco's build and tests need, and only those missing:
# on a machine that has them all this does nothing (and needs no network).
set -euo pipefail

PACKAGES=(
  g++                 # C++20 compiler (g++ 12)
  make
  libboost-test-dev   # Boost.Test, the unit-test runner
  nlohmann-json3-dev  # JSON for problem files and the decision log (header-only)
  python3             # /usr/bin/python3 for the file-format decoder test
  python3-venv        # the Python package's test: pip install . in a fresh virtual environment
  python3-torch       # tools/lgreco-register's tests: DDP in a one-process gloo group (torch 1.13)
  python3-torchvision # the ResNet-50 example registration
  python3-matplotlib  # `lgreco plot`: the decision log drawn (make demo draws its picture with it)
  clang               # libFuzzer for `make fuzz` (clang++ -fsanitize=fuzzer)
  libclang-rt-14-dev  # clang's fuzzer and sanitizer runtimes (Debian 12's clang is 14)
  iproute2            # ip and tc: `make netbench` (namespaces, veth, tbf rate limits)
)

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "make deps: not a Debian-like system; install the equivalents of: ${PACKAGES[*]}" >&2
  exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "make deps: all ${#PACKAGES[@]} Debian packages present"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "make deps: missing Debian packages: ${missing[*]}" >&2
  echo "make deps: installing them needs root; run 'sudo make deps' or" >&2
  echo "           sudo apt-get install --no-install-recommends ${missing[*]}" >&2
  exit 1
fi

echo "make deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
