# Two commands for a newcomer: `make run` and `make test`. Both build .venv on first use
# from the pinned CPU stack in requirements/ (about 90 s and 3.2 GB).
PYTHON ?= python3.11
PYTHON312 ?= python3.12
VENV := .venv
STAMP := $(VENV)/.installed
OUT ?= out

.PHONY: run test test-fast bench gpu-carry gpu-dryrun gpu-image-check venv clean

$(STAMP): requirements/cpu.txt requirements/dev.txt requirements/triton-interpreter.txt pyproject.toml reference/pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-deps -r requirements/cpu.txt -r requirements/dev.txt
	$(VENV)/bin/pip install -q --no-deps --upgrade --target $(VENV)/triton-interpreter -r requirements/triton-interpreter.txt
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e . -e reference
	$(VENV)/bin/python -c "import torch, vllm, eplb_graph, eplb_reference; print('torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/eplb-graph run --out $(OUT)/run

# Two workers, one per core of the machines this runs on (tests/conftest.py: each file one unit of
# work); then the tests marked alone (bounds in time), with the machine to themselves. Both parts
# run whatever the first gives; the first failure is the exit status.
# $(1): the parallel part's markers, $(2): the alone part's, $(3): options of both
define parallel_then_alone
	$(VENV)/bin/pytest -q -n 2 -m "$(1)" $(3) tests; parallel=$$?; \
	$(VENV)/bin/pytest -q -m "$(2)" $(3) tests; alone=$$?; \
	test $$parallel -eq 0 && exit $$alone || exit $$parallel
endef

test: $(STAMP)
	$(call parallel_then_alone,not alone,alone,--durations=25)

# A developer's inner loop: everything but the tests that start rank processes or a vLLM engine
test-fast: $(STAMP)
	$(call parallel_then_alone,not launches and not alone,alone and not launches,)

# Every benchmark, JSON under $(OUT)/bench; `python benchmarks/results.py record $(OUT)/bench` keeps
# the run and `python benchmarks/results.py render` writes benchmarks/RESULTS.md and the README table
BENCH := $(OUT)/bench
bench: $(STAMP)
	$(VENV)/bin/eplb-graph run --out $(BENCH)/run
	$(VENV)/bin/eplb-graph bench --out $(BENCH)/bench
	$(VENV)/bin/eplb-graph bench --data-plane --steps 1000 --out $(BENCH)/bench_data_plane
	$(VENV)/bin/eplb-graph bench --data-plane --mode compiled --steps 1000 --cpp-wrapper --out $(BENCH)/bench_data_plane_cpp_wrapper
	$(VENV)/bin/python benchmarks/bench_routing_ops.py --out $(BENCH)/bench_routing_ops.json
	$(VENV)/bin/python benchmarks/bench_op_in_step.py --out $(BENCH)/bench_op_in_step.json
	$(VENV)/bin/python benchmarks/bench_commit.py --out $(BENCH)/bench_commit.json
	$(VENV)/bin/python benchmarks/bench_transfer_planning.py --out $(BENCH)/bench_transfer_planning.json
	$(VENV)/bin/python benchmarks/bench_policy_stall.py --out $(BENCH)/bench_policy_stall.json
	$(VENV)/bin/python benchmarks/bench_movement.py --out $(BENCH)/bench_movement.json
	$(VENV)/bin/python benchmarks/bench_injected_work.py --out $(BENCH)/bench_injected_work.json
	$(VENV)/bin/eplb-graph run --scale-plan 2,4,2 --out $(BENCH)/elastic
	$(VENV)/bin/eplb-graph run --scale-plan 2,4,4 --kill 3@150 --out $(BENCH)/elastic_fault
	$(VENV)/bin/eplb-graph run --scale-plan 2,4,4 --kill 0@150 --out $(BENCH)/elastic_fault_rank0
	$(VENV)/bin/python benchmarks/bench_elastic_control.py --out $(BENCH)/bench_elastic_control.json
	$(VENV)/bin/eplb-graph run --chaos 1 --resize-deadline 120 --out $(BENCH)/chaos_1
	$(VENV)/bin/eplb-graph run --chaos 2 --resize-deadline 120 --out $(BENCH)/chaos_2
	$(VENV)/bin/eplb-graph run --chaos 3 --resize-deadline 120 --out $(BENCH)/chaos_3
	$(VENV)/bin/python benchmarks/bench_vllm_eplb.py --out $(BENCH)/bench_vllm_eplb.json
	$(VENV)/bin/python benchmarks/bench_vllm_elastic.py --out $(BENCH)/bench_vllm_elastic.json
	$(VENV)/bin/python benchmarks/bench_vllm_elastic.py --sizes 2 4 2 --out $(BENCH)/bench_vllm_elastic_2_4_2.json
	$(VENV)/bin/python benchmarks/bench_kept_placement.py --out $(BENCH)/bench_kept_placement.json
	$(VENV)/bin/python benchmarks/bench_local_pairs.py --out $(BENCH)/bench_local_pairs.json

# vLLM's control plane for the lent GPU image (no vLLM there): benchmarks/gpu_carry.py
gpu-carry: $(STAMP)
	$(VENV)/bin/python benchmarks/gpu_carry.py --out .gpu-carry

# The device call on the host: its stages, budget, report and kills, CUDA stages replaced by
# their CPU equivalents and `run` made to time out (benchmarks/gpu_bench.py --dry-run)
gpu-dryrun: $(STAMP)
	$(VENV)/bin/python benchmarks/gpu_bench.py --dry-run --out $(OUT)/gpu-dryrun

# The device call's imports under the lent image's Python 3.12 / torch 2.11 / Triton 3.6, and the
# Triton kernel compiled by that Triton (benchmarks/gpu_image_check.py); needs python3.12
GPU_IMAGE_VENV := .venv-gpu-image
gpu-image-check: gpu-carry
	test -x $(GPU_IMAGE_VENV)/bin/python || $(PYTHON312) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/pip install -q -r requirements/gpu-image.txt
	$(GPU_IMAGE_VENV)/bin/pip install -q --no-deps --no-build-isolation -e . -e reference
	$(GPU_IMAGE_VENV)/bin/python benchmarks/gpu_image_check.py --carry .gpu-carry

clean:
	rm -rf $(VENV) $(GPU_IMAGE_VENV) $(OUT) build *.egg-info .gpu-carry
