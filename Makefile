# lgreco build. `make` builds the library and the tools; `make help` lists the targets.
#
# Variables (override on the command line, e.g. `make CUDA_HOME=/opt/cuda`):
#   CUDA_HOME  CUDA toolkit; CUDA sources are built when $(CUDA_HOME)/bin/nvcc exists
#   NCCL_HOME  where include/nccl.h is (default: CUDA_HOME)
#   CUDA_LIB_DIR, NCCL_LIB_DIR  where libcudart_static.a and libnccl.so are (default: found
#              under the toolkit's lib64, lib, targets/<arch>-linux/lib or Debian's
#              lib/<multiarch>; `make cuda-info` says which)
#   PYTHON     interpreter for Python tools and tests (Debian's python3-* packages live
#              under /usr/bin/python3; on the GPU machine use the python3 that has torch)
#   PREFIX     install prefix for `make install`
#   DEBUG_FLAGS  debug information (default -g1, line tables; -g for full)
#   CXX        C++20 compiler (g++ 12 or newer)

CUDA_HOME ?= /usr/local/cuda
NCCL_HOME ?= $(CUDA_HOME)
PYTHON    ?= /usr/bin/python3
PREFIX    ?= /usr/local
CXX       ?= g++
BUILD     := build

NVCC      := $(CUDA_HOME)/bin/nvcc
HAVE_CUDA := $(shell test -x $(NVCC) && echo 1)
HAVE_NCCL_H := $(shell test -f $(NCCL_HOME)/include/nccl.h && echo 1)
# Toolkits keep their libraries in different folders: lib64 (NVIDIA's runfile and
# packages), lib, targets/<arch>-linux/lib (conda, some containers), lib/<multiarch>
# (Debian's nvidia-cuda-toolkit, CUDA_HOME=/usr). The first that holds the file wins.
MULTIARCH := $(shell $(CXX) -print-multiarch 2>/dev/null)
lib_dirs   = $(1)/lib64 $(1)/lib $(1)/targets/$(shell uname -m)-linux/lib $(if $(MULTIARCH),$(1)/lib/$(MULTIARCH))
find_lib   = $(patsubst %/,%,$(dir $(firstword $(wildcard $(addsuffix /$(2),$(call lib_dirs,$(1)))))))
CUDA_LIB_DIR ?= $(call find_lib,$(CUDA_HOME),libcudart_static.a)
NCCL_LIB_DIR ?= $(call find_lib,$(NCCL_HOME),libnccl.so*)
GIT_REV   := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)

# Baseline x86-64 (no -march): the library must load on any x86-64 node of a cluster.
# Hot CPU loops are compiled a second time for AVX2 and picked at load time
# (kernels/cpu_dispatch.h). -ffp-contract=off: no FMA contraction, so the CPU reference
# and the CUDA kernels round identically (docs/FORMAT.md). -fno-math-errno only lets
# floor() inline; no -ffast-math anywhere.
CPPFLAGS  := -I. -MMD -MP
ifeq ($(HAVE_NCCL_H),1)
CPPFLAGS  += -isystem $(NCCL_HOME)/include
endif
# Line tables only by default (-g1): what backtraces, perf and sanitizers' reports need,
# at two thirds of the compile time of full debug info (-g: variable tracking is the
# costliest pass of a build); `make DEBUG_FLAGS=-g` for a debugger's view of locals.
DEBUG_FLAGS ?= -g1
CXXFLAGS  := -std=c++20 -O2 $(DEBUG_FLAGS) -fPIC -fvisibility=hidden -fvisibility-inlines-hidden \
             -ffp-contract=off -fno-math-errno -pthread -Wall -Wextra -Wshadow
KERNEL_CXXFLAGS := -O3
# --threads 2: the two architectures' cicc and ptxas run side by side within one nvcc.
NVCCFLAGS := -std=c++20 -O3 -I. --fmad=false -ccbin $(CXX) --threads 2 \
             -Xcompiler -fPIC,-fvisibility=hidden,-ffp-contract=off,$(DEBUG_FLAGS) \
             -gencode arch=compute_80,code=sm_80 \
             -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90

# ---------------------------------------------------------------------------------------
# Sources. liblgreco_core.a holds everything the tests and tools link; the shared
# library adds plugin/library.cc (load-time logging and the exported entry points).

CORE_SRCS := $(wildcard config/*.cc) $(wildcard controller/*.cc) \
             $(filter-out %_none.cc,$(wildcard kernels/*.cc)) \
             $(wildcard plugin/transport/*.cc) $(wildcard plugin/collective/*.cc) \
             $(filter-out plugin/hook/c_api.cc,$(wildcard plugin/hook/*.cc)) \
             $(filter-out plugin/shim/entry_points.cc,$(wildcard plugin/shim/*.cc)) \
             $(filter-out plugin/net/exports.cc,$(wildcard plugin/net/*.cc))
ifeq ($(HAVE_CUDA),1)
CU_SRCS   := $(wildcard kernels/*.cu) $(wildcard plugin/shim/*.cu)
# A *_none.cc stands in for a .cu file in builds without CUDA only.
CORE_SRCS := $(filter-out plugin/shim/%_none.cc,$(CORE_SRCS))
ifeq ($(CUDA_LIB_DIR),)
$(error lgreco: $(NVCC) exists but libcudart_static.a is in none of $(call lib_dirs,$(CUDA_HOME)); set CUDA_LIB_DIR to its folder)
endif
CUDA_LIBS := $(CUDA_LIB_DIR)/libcudart_static.a -ldl -lrt
else
CORE_SRCS += $(wildcard kernels/*_none.cc)
CU_SRCS   :=
CUDA_LIBS :=
endif
SO_SRCS   := plugin/library.cc plugin/shim/entry_points.cc plugin/net/exports.cc plugin/hook/c_api.cc
TEST_SRCS := $(wildcard tests/unit/*.cc)
# Each tools/lgreco_NAME.cc is one program, build/bin/lgreco-NAME ('_' becomes '-').
TOOL_SRCS := $(wildcard tools/lgreco_*.cc)
TOOLS     := $(subst _,-,$(basename $(notdir $(TOOL_SRCS))))

obj = $(patsubst %,$(BUILD)/obj/%.o,$(1))
CORE_OBJS := $(call obj,$(CORE_SRCS) $(CU_SRCS))
SO_OBJS   := $(call obj,$(SO_SRCS))
TEST_OBJS := $(call obj,$(TEST_SRCS))

LIB       := $(BUILD)/lib/liblgreco.so
PLUGIN    := $(BUILD)/lib/libnccl-net-lgreco.so
CORE_LIB  := $(BUILD)/lib/liblgreco_core.a
TOOL_BINS := $(addprefix $(BUILD)/bin/,$(TOOLS))
TEST_BIN  := $(BUILD)/bin/lgreco-unit-tests

.PHONY: all deps test test-tsan test-python accuracy fuzz bench netbench demo install clean help cuda-info FORCE

# What this build uses, on the first line of every build (a GPU machine's log then says
# which toolkit folders were found) and from `make cuda-info`.
BUILD_INFO = lgreco build: $(if $(HAVE_CUDA),CUDA $(NVCC) with libcudart_static.a from $(CUDA_LIB_DIR),no CUDA \
  ($(NVCC) not found): CPU-only build); NCCL headers $(if $(HAVE_NCCL_H),$(NCCL_HOME)/include,not found); \
  libnccl.so $(if $(NCCL_LIB_DIR),in $(NCCL_LIB_DIR),not found under $(NCCL_HOME))
ifeq ($(MAKELEVEL),0)
ifeq ($(filter help clean cuda-info deps,$(MAKECMDGOALS)),)
$(info $(BUILD_INFO))
endif
endif
cuda-info:
	@echo "$(BUILD_INFO)"
all: $(LIB) $(PLUGIN) $(TOOL_BINS)

help:
	@echo "make            build $(LIB) (+ its NCCL plugin name) and build/bin/ tools"
	@echo "make deps       install the Debian packages the build and tests need (root)"
	@echo "make test       deps + build + every test suite (including test-tsan)"
	@echo "make test-tsan  the controller's and the engine's thread tests under ThreadSanitizer"
	@echo "make test-python  the Python package's and lgreco-register's tests (torch for $(PYTHON), python3-venv)"
	@echo "make fuzz       the registration/parameter parsers under libFuzzer for FUZZ_SECONDS ($(FUZZ_SECONDS))"
	@echo "make accuracy   real training through the comm hook: a character transformer, 4 gloo ranks, every mode (~70 min)"
	@echo "make bench      CPU codec, solver and call-matching benchmarks (one core), as tables; the comm hook's overlap"
	@echo "make netbench   lgreco-bench, 4 ranks over rate-limited links in network namespaces (root)"
	@echo "make demo       deps + build + compressed allreduce with L-GreCo on ResNet-50's buckets, 4 ranks"
	@echo "make install    PREFIX=$(PREFIX): library, plugin name, tools, docs"
	@echo "make cuda-info  the CUDA and NCCL folders this build uses"
	@echo "CUDA: $(if $(HAVE_CUDA),$(NVCC),not found (CPU-only build))"

deps:
	@tools/install_deps.sh

# ---------------------------------------------------------------------------------------
# Compile

$(BUILD)/obj/kernels/%.cc.o: kernels/%.cc
	@mkdir -p $(@D)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) $(KERNEL_CXXFLAGS) -c $< -o $@

# The git revision goes into a generated header that changes only when HEAD does, so
# the version string stays true without rebuilding everything.
GIT_REV_HEADER := $(BUILD)/gen/git_revision.h
$(GIT_REV_HEADER): FORCE
	@mkdir -p $(@D)
	@echo '#define LGRECO_GIT_REVISION "$(GIT_REV)"' > $@.tmp
	@cmp -s $@.tmp $@ && rm -f $@.tmp || mv -f $@.tmp $@
$(BUILD)/obj/config/version.cc.o: $(GIT_REV_HEADER)
$(BUILD)/obj/config/version.cc.o: CPPFLAGS += -I$(BUILD)/gen
$(BUILD)/tsan/config/version.cc.o: $(GIT_REV_HEADER)
$(BUILD)/tsan/config/version.cc.o: CPPFLAGS += -I$(BUILD)/gen
FORCE:

# lgreco-demo carries the ResNet-50 registration in its binary, as a raw string literal.
DEMO_REG_HEADER := $(BUILD)/gen/lgreco_demo_registration.h
$(DEMO_REG_HEADER): config/examples/resnet50.json
	@mkdir -p $(@D)
	@{ echo '// Generated by the Makefile from $<; do not edit.'; \
	   echo 'namespace lgreco::demo_data {'; \
	   echo 'inline constexpr char kRegistrationSource[] = "$<";'; \
	   echo 'inline constexpr char kRegistration[] = R"lgreco_json('; cat $<; \
	   echo ')lgreco_json";'; echo '}  // namespace lgreco::demo_data'; } > $@.tmp && mv -f $@.tmp $@
$(BUILD)/obj/tools/lgreco_demo.cc.o: $(DEMO_REG_HEADER)
$(BUILD)/obj/tools/lgreco_demo.cc.o: CPPFLAGS += -I$(BUILD)/gen

$(BUILD)/obj/%.cc.o: %.cc
	@mkdir -p $(@D)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@
# The solver's DP loop needs the full vectorizer too.
$(BUILD)/obj/controller/solver.cc.o: CXXFLAGS += $(KERNEL_CXXFLAGS)

$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

# ---------------------------------------------------------------------------------------
# Link

$(CORE_LIB): $(CORE_OBJS)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

# libstdc++ and libgcc are linked statically and hidden: the library is loaded into
# frameworks that may bring an older libstdc++ of their own (conda), and must not
# depend on which one the process already has.
$(LIB): $(SO_OBJS) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -shared -o $@ -Wl,-soname,liblgreco.so -Wl,-z,defs -Wl,--exclude-libs,ALL \
	  -static-libstdc++ -static-libgcc $(SO_OBJS) -Wl,--whole-archive $(CORE_LIB) -Wl,--no-whole-archive \
	  $(CUDA_LIBS) -ldl -pthread

$(PLUGIN): $(LIB)
	ln -sf liblgreco.so $@

.SECONDEXPANSION:
$(TOOL_BINS): $(BUILD)/bin/%: $$(call obj,tools/$$(subst -,_,%).cc) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< $(CORE_LIB) $(CUDA_LIBS) -ldl -pthread

$(TEST_BIN): $(TEST_OBJS) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -o $@ $(TEST_OBJS) $(CORE_LIB) $(CUDA_LIBS) -lboost_unit_test_framework -ldl -pthread

$(TEST_OBJS): CPPFLAGS += -DBOOST_TEST_DYN_LINK
# Tests, checks and harnesses compile at -O1 with line tables only (-g1: backtraces keep
# file:line): half the CPU time of -O2 -g, and what they run hot is the library's code,
# built at -O2. docs/PERF.md ("Build time") has the figures.
TEST_CXXFLAGS := -O1 -g1
$(TEST_OBJS) $(call obj,$(wildcard tests/gpu/*.cc) tests/net/net_harness.cc): CXXFLAGS += $(TEST_CXXFLAGS)

# The CUDA kernels against the CPU reference, and their throughput, on a GPU
# (tests/gpu/quant_cuda_check.cc; run by tests/gpu/run.sh codec; the TopK kernels' below),
# and the engine's CUDA backend against its CPU backend (below). Built with CUDA only,
# and by `make test` so that CI compiles it; nothing runs it there (it needs a GPU).
ifeq ($(HAVE_CUDA),1)
GPU_CHECK_BIN := $(BUILD)/bin/lgreco-gpu-codec-check $(BUILD)/bin/lgreco-gpu-backend-check $(BUILD)/bin/lgreco-gpu-net-check \
                 $(BUILD)/bin/lgreco-gpu-topk-check
$(call obj,tests/gpu/quant_cuda_check.cc tests/gpu/backend_check.cc tests/gpu/net_check.cc tests/gpu/topk_cuda_check.cc): \
  CPPFLAGS += -isystem $(CUDA_HOME)/include
$(BUILD)/bin/lgreco-gpu-codec-check: $(call obj,tests/gpu/quant_cuda_check.cc) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< $(CORE_LIB) $(CUDA_LIBS) -ldl -pthread
# The TopK kernels against the CPU reference, and their speed (tests/gpu/topk_cuda_check.cc;
# run by tests/gpu/run.sh families).
$(BUILD)/bin/lgreco-gpu-topk-check: $(call obj,tests/gpu/topk_cuda_check.cc) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< $(CORE_LIB) $(CUDA_LIBS) -ldl -pthread
# The engine's CUDA backend against the CPU backend (tests/gpu/backend_check.cc; run by
# tests/gpu/run.sh backend).
$(BUILD)/bin/lgreco-gpu-backend-check: $(call obj,tests/gpu/backend_check.cc) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< $(CORE_LIB) $(CUDA_LIBS) -ldl -pthread
# NCCL's allreduce over lgreco's net plugin or NCCL's Socket transport, ranks as processes
# on one GPU (tests/gpu/net_check.cc; run by tests/gpu/run.sh net). It loads libnccl
# itself and links no lgreco code.
$(BUILD)/bin/lgreco-gpu-net-check: $(call obj,tests/gpu/net_check.cc)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< $(CUDA_LIBS) -ldl -pthread
endif

# lgreco-bench --fabric nccl drives the GPU itself (its device, its stream) through the
# CUDA runtime; built without CUDA, that option is a usage error.
ifeq ($(HAVE_CUDA),1)
$(call obj,tools/lgreco_bench.cc): CPPFLAGS += -isystem $(CUDA_HOME)/include -DLGRECO_BENCH_CUDA
endif

# PowerSGD's CUDA module (kernels/lowrank_cuda.h) against the CPU reference, and the time
# of one step (tests/gpu/lowrank_cuda_check.cc; the last step of tests/gpu/run.sh
# families). cuBLAS is not linked: the module dlopens libcublas.so.<major> (the loader's
# path, then this toolkit's CUDA_LIB_DIR), so liblgreco.so loads where cuBLAS is missing and
# shares a framework's.
ifeq ($(HAVE_CUDA),1)
GPU_CHECK_BIN += $(BUILD)/bin/lgreco-gpu-lowrank-check
$(call obj,tests/gpu/lowrank_cuda_check.cc): CPPFLAGS += -isystem $(CUDA_HOME)/include
$(BUILD)/bin/lgreco-gpu-lowrank-check: $(call obj,tests/gpu/lowrank_cuda_check.cc) $(CORE_LIB)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< $(CORE_LIB) $(CUDA_LIBS) -ldl -pthread
$(call obj,kernels/lowrank_cuda.cu): NVCCFLAGS += -DLGRECO_CUDA_LIB_DIR='"$(CUDA_LIB_DIR)"'
endif

# A stand-in libnccl and a program linked against it (tests/interpose/): a framework's
# NCCL calls through the PLT, for the LD_PRELOAD test in tests/unit/library_test.cc,
# which needs no GPU.
CC ?= gcc
INTERPOSE_LIB := $(BUILD)/lib/test/libfakenccl.so
INTERPOSE_BIN := $(BUILD)/bin/lgreco-interpose-probe
$(INTERPOSE_LIB): tests/interpose/fake_libnccl.c
	@mkdir -p $(@D)
	$(CC) -shared -fPIC -O1 -Wall -o $@ $<
$(INTERPOSE_BIN): tests/interpose/probe.c $(INTERPOSE_LIB)
	@mkdir -p $(@D)
	$(CC) -O1 -Wall -o $@ $< -L$(dir $(INTERPOSE_LIB)) -lfakenccl -Wl,-rpath,$(abspath $(dir $(INTERPOSE_LIB)))
# Drives the NCCL net plugin (dlopen of liblgreco.so, ncclNetPlugin_vN) as NCCL's proxy
# does, for tests/unit/net_plugin_test.cc; links nothing of lgreco's (headers only).
NET_HARNESS_BIN := $(BUILD)/bin/lgreco-net-harness
$(NET_HARNESS_BIN): $(call obj,tests/net/net_harness.cc)
	@mkdir -p $(@D)
	$(CXX) -o $@ $< -ldl -pthread
# For the net plugin's loader (plugin/net/loader.h, tests/unit/loader_test.cc): a library
# calling that libnccl through its PLT, with lazy binding and with full RELRO, and a
# program that loads it and then liblgreco.so as NCCL loads a net plugin.
CALLER_LIB    := $(BUILD)/lib/test/liblgreco-caller
CALLER_LIBS   := $(CALLER_LIB)-lazy.so $(CALLER_LIB)-now.so
PLUGIN_PROBE  := $(BUILD)/bin/lgreco-plugin-probe
$(CALLER_LIB)-lazy.so: CALLER_LDFLAGS := -Wl,-z,lazy -Wl,-z,norelro
# The full-RELRO build also has only the old DT_HASH table, for LoadedObject::defines.
$(CALLER_LIB)-now.so: CALLER_LDFLAGS := -Wl,-z,now -Wl,-z,relro -Wl,--hash-style=sysv
$(CALLER_LIBS): $(CALLER_LIB)-%.so: tests/interpose/caller.c $(INTERPOSE_LIB)
	$(CC) -shared -fPIC -O1 -Wall $(CALLER_LDFLAGS) -o $@ $< -L$(dir $(INTERPOSE_LIB)) -lfakenccl -Wl,-rpath,$(abspath $(dir $(INTERPOSE_LIB)))
$(PLUGIN_PROBE): tests/interpose/plugin_probe.cc plugin/net/net_abi.h
	@mkdir -p $(@D)
	$(CXX) -std=c++20 -I. -O1 -Wall -o $@ $< -ldl

# The multi-threaded parts, built again with ThreadSanitizer: the controller's solver
# thread, the engine with the in-process and socket fabrics (ranks as threads), the
# transport's helper threads, and the net plugin's objects and telemetry exporter.
# No CUDA. No target_clones: their ifunc resolvers run before the sanitizer's runtime is up.
TSAN_SRCS := tests/unit/main.cc tests/unit/controller_test.cc tests/unit/inproc_fabric_test.cc \
             tests/unit/engine_test.cc tests/unit/socket_fabric_test.cc tests/unit/shim_test.cc tests/unit/fake_nccl.cc \
             tests/unit/transport_test.cc tests/unit/telemetry_test.cc tests/unit/net_adapter_test.cc \
             plugin/net/telemetry.cc plugin/net/net_plugin.cc \
             plugin/shim/shim.cc plugin/shim/nccl_fabric.cc plugin/shim/host_runtime.cc plugin/shim/nccl_api.cc \
             plugin/shim/nccl_locator.cc \
             $(wildcard controller/*.cc) $(wildcard plugin/collective/*.cc) $(wildcard plugin/transport/*.cc) \
             config/log.cc config/params.cc config/text_file.cc config/json_strict.cc config/registration.cc \
             config/bucket_matcher.cc config/version.cc \
             kernels/codec_spec.cc kernels/codec.cc kernels/quant_ref.cc kernels/topk_ref.cc kernels/lowrank_ref.cc kernels/dtype.cc
TSAN_OBJS := $(patsubst %,$(BUILD)/tsan/%.o,$(TSAN_SRCS))
TSAN_BIN  := $(BUILD)/bin/lgreco-tsan-tests
$(BUILD)/tsan/%.cc.o: %.cc
	@mkdir -p $(@D)
	$(CXX) $(CPPFLAGS) -DBOOST_TEST_DYN_LINK -DLGRECO_NO_MULTIVERSION $(CXXFLAGS) $(TEST_CXXFLAGS) -fsanitize=thread -c $< -o $@
$(TSAN_BIN): $(TSAN_OBJS)
	@mkdir -p $(@D)
	$(CXX) -fsanitize=thread -o $@ $(TSAN_OBJS) -lboost_unit_test_framework -pthread

# ---------------------------------------------------------------------------------------
# Run

# Every suite runs in one Boost.Test runner, which ends with its summary. The tool and
# file-format suites run the built binaries and $(PYTHON).
# The runner's log is kept in $(UNIT_LOG); a failure repeats its failed checks at the end,
# after the libraries' WARN lines, so that a log's tail (CI shows only that) names them.
UNIT_LOG := $(BUILD)/unit-tests.log
# deps runs first even under -j: the build starts from the recipe, after it. The builds
# use every core (TEST_JOBS) unless make was given -j itself; the suites run one at a time.
NPROC     := $(shell nproc 2>/dev/null || echo 2)
TEST_JOBS  = $(if $(filter -j%,$(MAKEFLAGS)),,-j$(NPROC))
test: deps
	@$(MAKE) $(TEST_JOBS) --no-print-directory all $(TEST_BIN) $(GPU_CHECK_BIN) $(INTERPOSE_BIN) $(CALLER_LIBS) $(PLUGIN_PROBE) $(NET_HARNESS_BIN)
	@rm -f $(UNIT_LOG).rc
	{ LGRECO_TEST_BIN_DIR=$(CURDIR)/$(BUILD)/bin LGRECO_TEST_LIB=$(CURDIR)/$(LIB) LGRECO_TEST_PYTHON=$(PYTHON) \
	LGRECO_TEST_NCCL_LIB=$(NCCL_LIB_DIR)/libnccl.so LGRECO_TEST_SOURCE_DIR=$(CURDIR) \
	LGRECO_TEST_INTERPOSE_PROBE=$(CURDIR)/$(INTERPOSE_BIN) LGRECO_TEST_NET_HARNESS=$(CURDIR)/$(NET_HARNESS_BIN) \
	LGRECO_TEST_CALLER_LIB=$(CURDIR)/$(CALLER_LIB) LGRECO_TEST_PLUGIN_PROBE=$(CURDIR)/$(PLUGIN_PROBE) \
	  $(TEST_BIN) --report_level=short --log_level=warning 2>&1 || echo $$? > $(UNIT_LOG).rc; } | tee $(UNIT_LOG)
	@if [ -f $(UNIT_LOG).rc ]; then \
	  echo "== make test: the unit tests failed (exit $$(cat $(UNIT_LOG).rc)); their failed checks (the whole log: $(UNIT_LOG)):"; \
	  grep -E ': in "[^"]+"' $(UNIT_LOG) | head -40; exit 1; fi
	@$(MAKE) $(TEST_JOBS) --no-print-directory $(TSAN_BIN) $(LIB) $(BUILD)/bin/lgreco-config $(BUILD)/bin/lgreco-demo \
	  $(FUZZ_BIN)
	@$(MAKE) --no-print-directory test-tsan
	@$(MAKE) --no-print-directory test-python
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=$(TEST_FUZZ_SECONDS)

# The registration tool's tests run DDP in a one-process gloo group on the CPU. The
# package's tests install it (pip install ., offline) into a fresh virtual environment of
# $(PYTHON) and run its commands; the install reuses this build.
# `lgreco plot` is tested on the decision log lgreco-demo writes (matplotlib).
# tests/gpu/first_stub_test.sh checks the GPU script's product check against stubs.
# The comm hook's tests and the quick real-training run (tests/accuracy/char_lm.py, 4
# ranks of DDP on gloo, a 0.1M-parameter character transformer on the license texts)
# train through the library in build/lib.
test-python: $(LIB) $(BUILD)/bin/lgreco-config $(BUILD)/bin/lgreco-demo $(INTERPOSE_BIN)
	LGRECO_DEBUG=NONE $(PYTHON) tests/python/register_test.py
	$(PYTHON) tests/python/plot_test.py
	LGRECO_TEST_INTERPOSE_PROBE=$(CURDIR)/$(INTERPOSE_BIN) $(PYTHON) tests/python/package_test.py
	$(PYTHON) tests/python/comm_hook_test.py
	bash tests/gpu/first_stub_test.sh
	@mkdir -p $(BUILD)/accuracy
	rm -f $(BUILD)/accuracy/quick.jsonl
	$(PYTHON) tests/accuracy/char_lm.py --size quick --check --plot $(BUILD)/accuracy/quick.png --json $(BUILD)/accuracy/quick.jsonl
	$(PYTHON) tests/accuracy/char_lm.py --report $(BUILD)/accuracy/quick.jsonl
	$(PYTHON) tests/python/char_lm_report_test.py
	$(PYTHON) tests/python/drift_law_test.py

# Real training, the full variant (docs/PERF.md, "Real training"): every mode on seed 1,
# then uniform on seeds 2 and 3 for the run-to-run spread; then the targets' report and
# the loss curves. About 10 minutes per mode on 2 cores, 6 runs.
ACCURACY_RUN = $(PYTHON) tests/accuracy/char_lm.py --size full --timeout 3600 --json $(BUILD)/accuracy/full.jsonl
accuracy: $(LIB) $(BUILD)/bin/lgreco-config
	@mkdir -p $(BUILD)/accuracy
	rm -f $(BUILD)/accuracy/full.jsonl $(BUILD)/accuracy/decisions.*
	$(ACCURACY_RUN) --decision-log $(BUILD)/accuracy/decisions
	$(ACCURACY_RUN) --modes uniform --seed 2
	$(ACCURACY_RUN) --modes uniform --seed 3
	$(PYTHON) tests/accuracy/char_lm.py --report $(BUILD)/accuracy/full.jsonl
	$(PYTHON) tests/accuracy/char_lm.py --plot-from $(BUILD)/accuracy/full.jsonl --plot $(BUILD)/accuracy/full.png

# libFuzzer (clang) over the parsers of user input. The committed corpus (seeds and any
# input that once crashed) is replayed first; new inputs go to build/fuzz/corpus, and a
# crash leaves its input in build/fuzz/ and fails the run.
FUZZ_CXX      ?= clang++
FUZZ_SECONDS  ?= 300
TEST_FUZZ_SECONDS ?= 30
FUZZ_SRCS := tests/fuzz/config_fuzz.cc config/json_strict.cc config/registration.cc config/params.cc config/text_file.cc \
             config/log.cc config/bucket_matcher.cc kernels/codec_spec.cc kernels/dtype.cc
FUZZ_BIN  := $(BUILD)/bin/lgreco-config-fuzz
$(FUZZ_BIN): $(FUZZ_SRCS) $(wildcard config/*.h kernels/*.h)
	@mkdir -p $(@D)
	$(FUZZ_CXX) -std=c++20 -O1 -g -I. -DLGRECO_NO_MULTIVERSION -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=all $(FUZZ_SRCS) -o $@
fuzz: $(FUZZ_BIN)
	@mkdir -p $(BUILD)/fuzz/corpus
	@echo "fuzz: $(FUZZ_SECONDS) s over the registration, parameter and codec-spec parsers and the bucket matcher"
	@LGRECO_DEBUG=NONE $(FUZZ_BIN) -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=10 \
	  -artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/corpus tests/fuzz/corpus > $(BUILD)/fuzz/log 2>&1 && \
	  grep -E '^Done [0-9]+ runs' $(BUILD)/fuzz/log || \
	  { tail -n 40 $(BUILD)/fuzz/log; echo "fuzz: FAILED; the input is in $(BUILD)/fuzz/ (add it to" \
	    "tests/fuzz/corpus/ with a regression test)"; exit 1; }

# halt_on_error: a race fails the run instead of scrolling past.
test-tsan: $(TSAN_BIN)
	TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" LGRECO_DEBUG=NONE \
	  $(TSAN_BIN) --report_level=short --log_level=warning

bench: $(BUILD)/bin/lgreco-codec-bench $(BUILD)/bin/lgreco-solve-bench $(BUILD)/bin/lgreco-match-bench $(BUILD)/bin/lgreco-shim-bench $(LIB)
	$(BUILD)/bin/lgreco-codec-bench
	$(BUILD)/bin/lgreco-solve-bench
	$(BUILD)/bin/lgreco-match-bench
	$(BUILD)/bin/lgreco-shim-bench
	$(PYTHON) tests/python/hook_overlap.py

# Four ranks in network namespaces over tbf-limited veth links (tests/netbench/netbench.sh
# says what it measures). Needs root; not part of `make test`.
netbench: $(BUILD)/bin/lgreco-bench
	LGRECO_NETBENCH_BIN=$(BUILD)/bin/lgreco-bench tests/netbench/netbench.sh

# The demo's picture: its decision log drawn by the package's `lgreco plot` (matplotlib).
demo: deps
	@$(MAKE) --no-print-directory all
	$(BUILD)/bin/lgreco-demo --decision-log $(BUILD)/demo/decisions.jsonl
	PYTHONPATH=$(CURDIR)/python $(PYTHON) -m lgreco plot $(BUILD)/demo/decisions.jsonl -o $(BUILD)/demo/decisions.png

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/doc/lgreco
	install -m 0755 $(LIB) $(DESTDIR)$(PREFIX)/lib/liblgreco.so
	ln -sf liblgreco.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-lgreco.so
	install -m 0755 $(TOOL_BINS) tools/lgreco-register $(DESTDIR)$(PREFIX)/bin/
	install -d $(DESTDIR)$(PREFIX)/share/lgreco/python/lgreco
	install -m 0644 python/lgreco/*.py $(DESTDIR)$(PREFIX)/share/lgreco/python/lgreco/
	install -m 0644 README.md docs/*.md $(DESTDIR)$(PREFIX)/share/doc/lgreco/

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj $(BUILD)/tsan -name '*.d' 2>/dev/null)
