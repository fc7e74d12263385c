# Two commands do everything on a fresh machine:
#   make train   set up .venv, prepare the default corpus, train the default tiny Llama (or finish an interrupted
#                run), print a sample
#   make test    set up .venv (with the test extras) and run every test that runs on this machine
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test setup clean

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

setup: $(VENV)/.runtime

data/cache/stdlib/meta.json: | $(VENV)/.runtime
	$(PY) data/prepare.py --stdlib --out data/cache/stdlib

train: $(VENV)/.runtime data/cache/stdlib/meta.json
	$(PY) train.py $$([ -f out/default/ckpt/config.json ] && echo --init_from=resume)  # a second run goes on from the first
	$(PY) sample.py --ckpt=out/default/ckpt --prompt="def " --max_new_tokens=300

test: $(VENV)/.test
	$(PY) -m pytest -q

clean:
	rm -rf out data/cache
