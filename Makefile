# The README's two commands: `make demo` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stager-installed

.PHONY: demo test lint bench bench-setup faults clean-venv cluster cluster-down

$(STAMP): pyproject.toml tools/setup_venv.sh
	bash tools/setup_venv.sh $(PY) $(VENV)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python tools/demo.py

# TESTS narrows the run (make test TESTS=tests/test_pack.py). `exec`: make passes SIGTERM to its recipe's
# process, which must be pytest itself (a shell in between would die and leave pytest running), so that
# an interrupted run still tears down what it brought up (tests/conftest.py, tools/cluster/session.py).
# TEST_WORKERS pytest-xdist processes (2: CI's cores; 0 runs in one process); the tests that share a
# singleton run in one worker (the cluster suite: docs/testing.md, "In parallel"). A worker that dies is
# not replaced (its replacement would run the test it died in again: a retry, and a second cluster).
TESTS ?= tests
TEST_WORKERS ?= 2
test: $(STAMP)
	exec $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0 --durations=30 \
	  -m "not slow and not gpu and not faults" $(TESTS)

lint: $(STAMP)
	$(BIN)/ruff check stager tools tests
	$(BIN)/mypy

bench-setup: $(STAMP)
	bash tools/bench/setup_peers.sh $(BIN)

bench: bench-setup
	$(BIN)/python tools/bench/run_all.py

# Full fault-injection counts (pytest -m faults and the hostile/parser suites); rewrites docs/reliability.md.
faults: $(STAMP)
	$(BIN)/python -m tools.faults.report

clean-venv:
	rm -rf $(VENV)

# A real Slurm cluster on this machine (root; installs slurm-wlm, munge, sshfs, openssh-sftp-server, openmpi-bin,
# libpmix-dev with apt when missing):
# CLUSTER_NODES (4) nodes, a storage host behind a CLUSTER_STORAGE_MBIT (400) link, slurmctld. Writes
# .cluster/env; tools/cluster/README.md. cluster-down removes everything it made, at any time.
cluster: $(STAMP)
	$(PY) -m tools.cluster up

cluster-down:
	$(PY) -m tools.cluster down
