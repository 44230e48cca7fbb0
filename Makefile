# Two commands, each doing its own set-up from a fresh clone:
#   make lab    open the course in JupyterLab
#   make test   the whole suite: pytest over tests/ and nbval over chapters/
# A second run skips what is already installed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The install is redone when pyproject.toml changes.
STAMP  := $(VENV)/.installed

.PHONY: lab test setup kernels notebooks clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[dev]"
	@# With an NVIDIA GPU, add the CuPy that matches the driver's CUDA major version.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	    cuda=$$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1); \
	    case "$$cuda" in \
	        12) extra=cuda12 ;; \
	        *)  extra=cuda13 ;; \
	    esac; \
	    echo "GPU found (CUDA $$cuda): installing CuPy ($$extra)"; \
	    $(PY) -m pip install --quiet -e ".[dev,$$extra]"; \
	else \
	    echo "No NVIDIA GPU found: kernels will run on the CPU executor"; \
	fi
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

setup: $(STAMP)

# In the lab, the CPU executor checks every array access: a kernel that runs off an array stops with an
# error naming it, instead of corrupting memory and killing the notebook. `GPT2_CUPY_CHECKS= make lab` turns
# the check off (it has no effect on a GPU).
GPT2_CUPY_CHECKS ?= bounds

lab: setup
	@# JupyterLab refuses root unless told; in a container root is the usual user.
	GPT2_CUPY_CHECKS="$(GPT2_CUPY_CHECKS)" $(VENV)/bin/jupyter lab chapters/ $$([ "$$(id -u)" = 0 ] && echo --allow-root)

test: setup
	$(PY) -m pytest tests/ chapters/ --nbval

# Rewrite kernels/**/*.cu and kernels/include/*.cuh from the chapters' exported cells.
kernels: setup
	$(PY) -m gpt2_cupy.export chapters/

clean:
	rm -rf $(VENV)

# Re-execute every chapter in place, storing its outputs (run it on a GPU before committing notebooks).
notebooks: setup
	$(VENV)/bin/jupyter execute --inplace chapters/*.ipynb
