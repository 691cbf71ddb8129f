# make train : create .venv if missing, install, train the default config (shakespeare_cpu)
# make test  : create .venv if missing, install with dev extras, run the test suite
# make test-fast : tests/unit only (in-process: exact numbers, equivalences, CLI checks before any work): the edit loop
# Extra arguments: make train ARGS="--train.steps=100"   make test PYTEST_ARGS="-k data"

VENV   := .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.installed-base
DEV    := $(VENV)/.installed-dev

.PHONY: train test test-fast bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(BASE): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

# mup (tests/unit/test_mup.py's reference μP) without its dependencies: it asks for torchvision, whose build for torch
# 2.13 breaks transformers' import ("operator torchvision::nms does not exist"); it needs none beyond pandas
$(DEV): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps mup==1.0.0
	touch $@ $(BASE)

train: $(BASE)
	$(PY) train.py $(ARGS)

# pytest exits 5 when nothing was collected: say so, and fail, rather than pass silently.
test: $(DEV)
	@JAX_PLATFORMS=cpu $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)"; fi; exit $$rc

test-fast: $(DEV)
	@JAX_PLATFORMS=cpu $(PY) -m pytest tests/unit $(PYTEST_ARGS)

bench: $(DEV)
	$(PY) -m benchmarks.train_step $(ARGS)

clean:
	rm -rf $(VENV) runs
