# poolserve: every command a developer or CI needs. `make test` is what CI runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.run-installed
REPO ?= examples/models
PACKAGES := -p poolserve.protos -p poolserve.service -p poolserve.supervisor
PROTOS := $(wildcard protos/*.proto)

.PHONY: install test lint typecheck pytest protos run clean ns bench bench-quick bench-workerpool stress chaos fuzz interop

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev,sklearn,mlserver]'
	touch $@

install: $(STAMP) ns

# A namespace view of the source folders (poolserve/service -> service, ...)
# for the tools that resolve modules by path: mypy and protoc.
ns:
	@mkdir -p .ns/poolserve
	@for d in protos service supervisor; do ln -sfn ../../$$d .ns/poolserve/$$d; done

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=.ns $(BIN)/lint-imports --no-cache

typecheck: install
	MYPYPATH=.ns $(BIN)/mypy $(PACKAGES)

pytest: install
	$(BIN)/pytest

test: lint typecheck pytest

protos: install
	$(BIN)/python -m poolserve.protos.generate

# What serving examples/models needs, and no more (scikit-learn for iris and
# boosted); a .venv that `make install` made already has it all.
$(RUN_STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "make run: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; else \
		echo "make run: installing poolserve and scikit-learn into $(VENV) (make install adds the developer tools)"; \
		$(BIN)/python -m pip install --disable-pip-version-check -e '.[sklearn]'; fi
	touch $@

run: $(RUN_STAMP)
	@test -f examples/models/iris/model.joblib || $(BIN)/python examples/models/iris/train.py
	@test -f examples/models/boosted/model.joblib || $(BIN)/python examples/models/boosted/train.py
	@echo "poolserve: serving $(REPO) on 127.0.0.1:8081 (gRPC) and :8080 (REST) (Ctrl-C stops it)."
	@echo "  try: $(BIN)/python examples/client.py 127.0.0.1:8081"
	@echo "   or: curl -s localhost:8080/v2/models/echo/infer -d '{\"inputs\": [{\"name\": \"INPUT0\", \"shape\": [1, 2], \"datatype\": \"FP32\", \"data\": [1, 2]}]}'"
	$(BIN)/poolserve serve $(REPO)

# Side-by-side benchmark against MLServer, KServe and a bare grpc.aio server, over gRPC
# and REST (bench/rest.py: perf_analyzer -i http, a bare uvicorn echo as the REST floor).
# Peers live in bench/.peers, never in .venv. Writes bench/results/.
bench: install
	$(BIN)/python bench/run.py --mode full
	$(BIN)/python bench/workerpool_bench.py

# WorkerPool in a FastAPI-style app versus scoring on the event loop (MLPool's comparison).
bench-workerpool: install
	$(BIN)/python bench/workerpool_bench.py

bench-quick: install
	$(BIN)/python bench/run.py --mode quick

# Reliability suite (docs/reliability.md): pass options with ARGS, e.g.
# `make stress ARGS=--assert-bound` or `make chaos ARGS=--quick`.
stress: install
	$(BIN)/python reliability/stress.py $(ARGS)

chaos: install
	$(BIN)/python reliability/chaos.py $(ARGS)

fuzz: install
	$(BIN)/python reliability/fuzz.py $(ARGS)

# Other gRPC stacks against a real tree on both engines of the gRPC port: grpc-js
# (npm) and grpcurl (grpc-go), installed on first use under reliability/.interop/.
# Slow, and it needs npm: not part of `make test`.
interop: install
	$(BIN)/python reliability/interop.py $(ARGS)

clean:
	rm -rf $(VENV) .ns build .mypy_cache .pytest_cache .ruff_cache
