# The two commands (see README.md): `make workbook` and `make test`. Both set themselves up.
PYTHON    ?= python3
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
SMOKE     ?= 1
NOTEBOOKS ?= $(sort $(wildcard notebooks/*.ipynb))
BUILD     ?= build
NBVAL     := --nbval-lax --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider

.PHONY: setup workbook test test-slow peers lab clean

setup: $(STAMP)

# One line per step, and pip says what it downloads and installs (torch is the big one).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"Python 3.11+ needed, {sys.executable} is {sys.version.split()[0]}"'
	@if test -x $(PY); then echo "[setup 1/4] $(VENV) exists: reusing it"; \
	 else echo "[setup 1/4] creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); fi
	@echo "[setup 2/4] upgrading pip"
	$(PY) -m pip install --upgrade pip
	@echo "[setup 3/4] installing nvrx_lab and its dependencies from pyproject.toml (about 1.5 min on a fresh machine)"
	$(PY) -m pip install -e '.[test]'
	@echo "[setup 4/4] registering the Jupyter kernel python3 in $(VENV)"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (nvrx_lab)" >/dev/null
	@rm -f $(VENV)/.installed-* && touch $@
	@echo "[setup] done: $(VENV) is ready"

# Execute every notebook of NOTEBOOKS in its small CPU configuration into $(BUILD)/notebooks/, then
# write the report. A failing notebook does not stop the others: all run, the failures are named at
# the end (their partial output is in $(BUILD)/notebooks/), and the exit status is non-zero.
workbook: $(STAMP)
	@mkdir -p $(BUILD)/notebooks
	@failed=""; \
	for nb in $(NOTEBOOKS); do \
		echo "== $$nb"; \
		NVRX_LAB_SMOKE=$(SMOKE) $(PY) -m nvrx_lab.workbook.papermill --cwd "$$(dirname "$$nb")" -k python3 --log-level WARNING \
			"$$nb" "$(BUILD)/notebooks/$$(basename "$$nb")" || { echo "!! $$nb failed"; failed="$$failed $$nb"; }; \
	done; \
	report=ok; $(PY) -m nvrx_lab.observe.report --build $(BUILD) || report=failed; \
	echo "executed notebooks: $(abspath $(BUILD))/notebooks/"; \
	echo "report:             $(abspath $(BUILD))/report.md (and report.html)"; \
	if [ -n "$$failed" ]; then \
		echo "FAILED (each executed up to its error in $(abspath $(BUILD))/notebooks/):"; \
		for nb in $$failed; do echo "  $$nb"; done; \
	fi; \
	if [ "$$report" = failed ]; then echo "FAILED: the report (python -m nvrx_lab.observe.report --build $(BUILD))"; fi; \
	if [ -n "$$failed" ] || [ "$$report" = failed ]; then exit 1; fi; \
	echo "every notebook ran"

# The whole suite: unit and multi-process tests and every notebook under nbval, two files at a time (each
# file's tests, a notebook's cells, in order in one worker); every test must pass under that load anyway.
# pytest's temp folders go in a folder of this run's own: another pytest session on the box (another clone's make
# test) deletes all but the newest three of /tmp/pytest-of-$$USER, this run's files included (seen: a job whose
# checkpoints vanished mid-run). Kept where a test failed, and said.
test: $(STAMP)
	@tmp=$$(mktemp -d /tmp/nvrx-test.XXXXXX); \
	NVRX_LAB_SMOKE=1 $(PY) -m pytest tests notebooks $(NBVAL) -q -m "not slow" -n 2 --dist loadfile --durations=25 \
		--basetemp=$$tmp/t; rc=$$?; \
	if [ $$rc = 0 ]; then rm -rf $$tmp; else echo "the failed tests' folders: $$tmp/t"; fi; exit $$rc

# The long end-to-end runs and the variants of those make test runs once per mechanism (a node lost under the
# launcher, index 0 starting late, the other fault kinds and modes, the repeats): `pytest -m slow`.
test-slow: $(STAMP)
	@tmp=$$(mktemp -d /tmp/nvrx-test.XXXXXX); \
	NVRX_LAB_SMOKE=1 $(PY) -m pytest tests -q -m slow --basetemp=$$tmp/t; rc=$$?; \
	if [ $$rc = 0 ]; then rm -rf $$tmp; else echo "the failed tests' folders: $$tmp/t"; fi; exit $$rc

# The peers extra (NVRx 0.4.1, torchft 0.2.0) in the same environment, the tests of every peer row, then every benchmark at
# quick size with its peers side by side (tables on stdout, JSON under build/bench/).
peers: $(STAMP)
	$(PY) -m pip install -e '.[test,peers]'
	NVRX_LAB_SMOKE=1 $(PY) -m pytest tests/test_peers.py -q -p no:cacheprovider
	@failed=""; \
	for b in "checkpoint --quick" "launcher --quick" "recovery --quick" "efficiency --quick" "local --quick" \
	         "goodput --quick" "nodes --quick" "reliability --quick" "replicas --quick" "straggler --quick" "stability --runs 2" \
	         "scale --ranks 8 64 512"; do \
		echo "== python -m nvrx_lab.bench $$b"; $(PY) -m nvrx_lab.bench $$b || failed="$$failed\n  $$b"; \
	done; \
	if [ -n "$$failed" ]; then printf "FAILED (each printed why above; a peer that cannot recover a fault is one):$$failed\n"; exit 1; fi

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(BUILD) .pytest_cache
