# The front door: `make demo`, `make test`. CMake does the real work; this
# file installs what the build needs (Debian packages) and names the usual
# commands. Run `make help` for the list.

BUILD_DIR      ?= build
ASAN_BUILD_DIR ?= build-asan
BUILD_TYPE     ?= Release
CMAKE_ARGS     ?=
PREFIX         ?= /usr/local
JOBS           ?= $(shell nproc 2>/dev/null || echo 2)
CTEST_JOBS     ?= 2
CTEST_ARGS     ?=
FUZZ_SECONDS   ?= 60
DEMO_ARGS      ?=
TORCH_VENV     ?= $(BUILD_DIR)/venv-torch

# What `deps` makes sure is installed. The CUDA toolkit, cuDNN and NCCL are
# not Debian packages here; CMake finds them when present (see README).
DEB_PACKAGES ?= cmake pkg-config gcc g++ make check libsubunit-dev \
                libopenblas-dev libdnnl-dev libgloo-dev libssl-dev python3
# What the test targets add: PyTorch, which tests/test_optim_vs_torch.py and
# tests/test_gpt_names.py compare against (under CI=true they fail, not
# skip, without it); iproute2 (ip), with which tests/test_multinode*.py make
# two network namespaces.
# clang-14 and libclang-rt-14-dev (libFuzzer), with which tests/test_fuzz.py
# builds and briefly runs every fuzz target.
TEST_DEB_PACKAGES ?= python3-torch iproute2 clang-14 libclang-rt-14-dev

CTEST := ctest --output-on-failure --no-tests=error -j$(CTEST_JOBS) $(CTEST_ARGS)

.PHONY: all help deps test-deps build test test-emu test-asan demo bench bench-torch fuzz install clean

all: build

help:
	@echo "make deps       install the Debian packages the build needs (apt-get, only what is missing)"
	@echo "make test-deps  install the Debian packages the tests add: $(TEST_DEB_PACKAGES)"
	@echo "make build      configure (once) and build into $(BUILD_DIR)/"
	@echo "make test       build, install python3-torch if missing (test-deps), then run every test with ctest"
	@echo "                but the CUDA kernel emulator's (label emu: minutes of CPU; make test-emu runs them)"
	@echo "make test-asan  the same with AddressSanitizer + UBSan, in $(ASAN_BUILD_DIR)/"
	@echo "make demo       build, then train a small GPT on the shipped text with DDP (2 CPU processes or every GPU)"
	@echo "make bench      build, then run every benchmark ($(BUILD_DIR)/bin/bench_*)"
	@echo "make bench-torch  build, set up $(TORCH_VENV) with PyPI's torch if missing, then time our training"
	@echo "                 steps against it (eager, torch.compile; f32, bf16) and against Debian's 1.13 if installed"
	@echo "make fuzz       build and run every fuzz/fuzz_*.c for FUZZ_SECONDS=$(FUZZ_SECONDS) s each (clang, libFuzzer)"
	@echo "make install    install the library, headers, CMake and pkg-config files, nbrun, nb_plot, the"
	@echo "                tutorial's program and the shipped datasets (share/nabla/) to PREFIX=$(PREFIX)"
	@echo "make clean      remove $(BUILD_DIR)/ and $(ASAN_BUILD_DIR)/"
	@echo "Variables: BUILD_DIR BUILD_TYPE CMAKE_ARGS (e.g. -DNABLA_CUDA=OFF) PREFIX JOBS CTEST_JOBS CTEST_ARGS FUZZ_SECONDS"
	@echo "           BENCH_TORCH_ARGS (benchmarks/compare_torch.py flags, e.g. --quick or --threads 2)"
	@echo "           DEMO_ARGS (train_gpt flags for make demo, e.g. DEMO_ARGS=\"--steps 100\")"

# Installs only what dpkg does not already list as installed, so that the
# common case costs no network and needs no root. $(1): packages, $(2): the
# target's name for messages.
install_debs = \
	missing=""; \
	for p in $(1); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "install ok installed" \
	    || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "$(2): all packages present"; exit 0; fi; \
	echo "$(2): missing:$$missing"; \
	sudo=""; \
	if [ "$$(id -u)" -ne 0 ]; then \
	  if command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; \
	  else echo "$(2): not root and no sudo; install:$$missing" >&2; exit 1; fi; \
	fi; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update </dev/null && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing </dev/null

deps:
	@$(call install_debs,$(DEB_PACKAGES),deps)

# Without root or sudo a developer's `make test` goes on (the suites that
# need these packages report themselves skipped); under CI=true it stops.
test-deps:
	@( $(call install_debs,$(TEST_DEB_PACKAGES),test-deps) ) || { \
	  [ "$$CI" != true ] || exit 1; \
	  echo "test-deps: going on without them; the suites that need them will be skipped" >&2; }

# Configures when $(1) has no build system yet, or when CMAKE_ARGS asks for
# a change; otherwise `cmake --build` re-runs CMake by itself when
# CMakeLists.txt or the set of source files changes.
configure = \
	if [ -n "$(strip $(CMAKE_ARGS))" ] || { [ ! -f $(1)/Makefile ] && [ ! -f $(1)/build.ninja ]; }; then \
	  echo "cmake -S . -B $(1) $(2) $(CMAKE_ARGS)"; \
	  cmake -S . -B $(1) $(2) $(CMAKE_ARGS); \
	fi

build: deps
	@$(call configure,$(BUILD_DIR),-DCMAKE_BUILD_TYPE=$(BUILD_TYPE))
	cmake --build $(BUILD_DIR) -j$(JOBS)

# The emulator's drivers (label emu, dev/cuda_emu) take minutes of CPU:
# test-emu runs them, test leaves them out.
test: build test-deps
	$(CTEST) --test-dir $(BUILD_DIR) -LE emu

test-emu: build
	$(CTEST) --test-dir $(BUILD_DIR) -L emu

test-asan: deps test-deps
	@$(call configure,$(ASAN_BUILD_DIR),-DCMAKE_BUILD_TYPE=Debug -DNABLA_SANITIZE=ON)
	cmake --build $(ASAN_BUILD_DIR) -j$(JOBS)
	$(CTEST) --test-dir $(ASAN_BUILD_DIR) -LE emu

# examples/run_demo.sh picks the processes (every GPU, or 2 on the CPU) and
# the settings; DEMO_ARGS adds or overrides train_gpt flags.
demo: build
	@examples/run_demo.sh $(BUILD_DIR) $(DEMO_ARGS)

bench: build
	@set -e; found=0; \
	for b in $(BUILD_DIR)/bin/bench_*; do \
	  [ -x "$$b" ] || continue; found=1; \
	  echo "== $$b"; rc=0; "$$b" || rc=$$?; \
	  if [ $$rc -eq 77 ]; then echo "(skipped: it needs a GPU)"; elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done; \
	[ $$found -eq 1 ] || echo "bench: no benchmarks built yet (benchmarks/bench_*.c)"

# Our training step against PyTorch's on the same models and batches; a
# benchmark, not a test. The current PyTorch release comes from PyPI into a
# virtual environment, $(TORCH_VENV), made on first use (PyPI's Linux wheel is
# its CUDA build, ~3 GB with its libraries, run here on the CPU); Debian's
# 1.13 (python3-torch, which the numerical tests use) is compared too where it
# is installed. Eager and torch.compile, f32 and bf16 autocast, interleaved
# (Note [Which PyTorch] in benchmarks/compare_torch.py). BENCH_TORCH_ARGS:
# flags of benchmarks/compare_torch.py (e.g. --threads 2 --repeats 9).
bench-torch: build
	@$(call install_debs,python3-venv,bench-torch)
	@if ! $(TORCH_VENV)/bin/python -c 'import torch' 2>/dev/null; then \
	  echo "bench-torch: installing PyPI's torch into $(TORCH_VENV) (once; a few GB)"; \
	  /usr/bin/python3 -m venv $(TORCH_VENV) && $(TORCH_VENV)/bin/pip install --quiet torch numpy || exit 1; \
	fi
	@pythons=$(TORCH_VENV)/bin/python; \
	if /usr/bin/python3 -c 'import torch' 2>/dev/null; then pythons=$$pythons,/usr/bin/python3; fi; \
	echo "/usr/bin/python3 benchmarks/compare_torch.py --torch-python $$pythons --compile $(BENCH_TORCH_ARGS)"; \
	/usr/bin/python3 benchmarks/compare_torch.py --torch-python $$pythons --compile $(BENCH_TORCH_ARGS)

# Long libFuzzer runs (minutes per target) against an instrumented library;
# `make test` only builds each target and runs it a few seconds
# (tests/test_fuzz.py). See fuzz/README.md.
fuzz:
	fuzz/run.sh $(FUZZ_SECONDS)

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)
	@if [ "$$(id -u)" -eq 0 ] && command -v ldconfig >/dev/null 2>&1; then ldconfig; fi

clean:
	rm -rf $(BUILD_DIR) $(ASAN_BUILD_DIR)
