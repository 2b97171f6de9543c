# The two commands (see README.md): `make workbook` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
SMOKE  ?= 1
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider

.PHONY: setup workbook test lab clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"Python 3.11+ needed, {sys.executable} is {sys.version.split()[0]}"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (nvrx_lab)" >/dev/null
	@rm -f $(VENV)/.installed-* && touch $@

# Execute every notebook in its small CPU configuration into build/, then write the report.
workbook: $(STAMP)
	@mkdir -p build/notebooks
	@set -e; for nb in notebooks/*.ipynb; do \
		echo "== $$nb"; \
		NVRX_LAB_SMOKE=$(SMOKE) $(VENV)/bin/papermill --cwd notebooks -k python3 --log-level WARNING "$$nb" "build/$$nb"; \
	done
	$(PY) -m nvrx_lab.report --build build
	@echo "executed notebooks: $(CURDIR)/build/notebooks/"
	@echo "report:             $(CURDIR)/build/report.md (and report.html)"

# The whole suite: unit and multi-process tests, then every notebook under nbval.
test: $(STAMP)
	NVRX_LAB_SMOKE=1 $(PY) -m pytest tests notebooks $(NBVAL) -q

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf build .pytest_cache
