# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint unit venv clean protos bench docs docs-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel here; an unpinned resolve would pull GBs of CUDA.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Three workers on two cores, one test file each at a time: most tests wait on real processes
# (starting, stopping, timing out), so two workers keep the cores about three quarters busy.
unit: $(STAMP)
	$(PY) -m pytest -n 3 --dist loadfile

test: lint docs-check unit

# The reference pages are generated from the declarations; the site is built with --strict, so a
# broken link, a missing anchor or a page outside the navigation fails.
docs: $(STAMP)
	$(PY) docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-check: $(STAMP)
	$(PY) docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $$(mktemp -d)

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos protos/registry.proto

bench: $(STAMP)
	$(PY) -m benchmarks.serving

clean:
	rm -rf $(VENV) build site *.egg-info .mypy_cache .ruff_cache .pytest_cache
