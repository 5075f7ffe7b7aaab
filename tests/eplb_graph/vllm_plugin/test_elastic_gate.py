"""The config gate's elastic EP part, on vLLM's real EngineArgs (no engine, no Ray started):
what is refused by name before any process starts, the config an accepted request builds, and
the resize sizes refused before anything starts (``AsyncLLM.scale_elastic_ep``)."""

from __future__ import annotations

import asyncio
import copy
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from eplb_graph.vllm_plugin.config_gate import EplbConfigError  # noqa: E402
from eplb_graph.vllm_plugin.elastic_gate import ENV_PREFIX, RAY_PREFIXES, RAY_RESOURCE, elastic_problems  # noqa: E402
from eplb_reference.models.tiny_checkpoint import write_tiny_qwen3_moe  # noqa: E402

ELASTIC = dict(enable_expert_parallel=True, enable_eplb=True, enable_elastic_ep=True, elastic_ep_max_dp_size=4,
               data_parallel_size=2, data_parallel_backend="ray",
               eplb_config={"window_size": 4, "step_interval": 8, "num_redundant_experts": 2})


@pytest.fixture(autouse=True)
def own_environment(monkeypatch):
    """The gate writes the engines' environment (Ray's prefixes, the compile cache): into a copy here."""
    monkeypatch.setattr(os, "environ", os.environ.copy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe")))


def elastic_args(model_dir: str, **overrides) -> EngineArgs:
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="float32", max_model_len=128)
    return EngineArgs(**{**kwargs, **ELASTIC, **overrides})


@pytest.mark.parametrize(("overrides", "named"), [
    ({"data_parallel_size": 1, "data_parallel_backend": "ray"}, "data_parallel_size=1: start at 2"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: on CPU eplb-graph serves elastic EP over DP ranks"),
    ({"data_parallel_backend": "mp"}, "data_parallel_backend='mp'"),
    ({"distributed_executor_backend": "ray"}, "distributed_executor_backend='ray'"),
    ({"elastic_ep_max_dp_size": 1}, "elastic_ep_max_dp_size=1 below data_parallel_size=2"),
    ({"eplb_config": {"use_async": False}}, "synchronous EPLB"),
])
def test_what_elastic_ep_cannot_serve_is_refused_by_name_with_the_request_untouched(model_dir, overrides, named):
    args = elastic_args(model_dir, **overrides)
    before = copy.deepcopy((args.enable_eplb, args.eplb_config, args.enable_elastic_ep,
                            args.distributed_executor_backend))
    with pytest.raises(EplbConfigError, match="eplb-graph cannot serve this EPLB request") as error:
        args.create_engine_config()
    assert named in str(error.value)
    assert (args.enable_eplb, args.eplb_config, args.enable_elastic_ep, args.distributed_executor_backend) == before


def test_a_start_bound_that_is_not_one_is_refused_at_start(model_dir):
    problems = elastic_problems(elastic_args(model_dir), on_cpu=True,
                                environ={"EPLB_GRAPH_ELASTIC_START_TIMEOUT_S": "soon"})
    assert [p for p in problems if "EPLB_GRAPH_ELASTIC_START_TIMEOUT_S='soon'" in p]


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_keep_graphs_setting_other_than_0_or_1_is_refused_at_start(model_dir, value):
    problems = elastic_problems(elastic_args(model_dir), on_cpu=True,
                                environ={"EPLB_GRAPH_ELASTIC_KEEP_GRAPHS": value})
    assert [p for p in problems if f"EPLB_GRAPH_ELASTIC_KEEP_GRAPHS={value!r}" in p], problems
    for accepted in ("0", "1"):
        assert not elastic_problems(elastic_args(model_dir), on_cpu=True,
                                    environ={"EPLB_GRAPH_ELASTIC_KEEP_GRAPHS": accepted})


def test_a_kept_placement_file_is_refused_with_elastic_ep(model_dir):
    problems = elastic_problems(elastic_args(model_dir), on_cpu=True, environ={"EPLB_GRAPH_PLACEMENT_FILE": "/p.json"})
    assert [p for p in problems if "EPLB_GRAPH_PLACEMENT_FILE" in p]


def test_elastic_ep_off_cpu_is_refused_by_name(model_dir):
    problems = elastic_problems(elastic_args(model_dir), on_cpu=False, environ={})
    assert problems and "off CPU" in problems[0]


def test_an_accepted_request_builds_elastic_async_eplb_on_cpu_with_the_mp_executor(model_dir, monkeypatch):
    from vllm.platforms import current_platform

    os.environ.pop(RAY_PREFIXES, None)
    os.environ.pop("EPLB_GRAPH_PLACEMENT_FILE", None)
    args = elastic_args(model_dir)
    config = args.create_engine_config()
    parallel = config.parallel_config
    assert parallel.enable_elastic_ep and parallel.enable_eplb and parallel.eplb_config.use_async
    assert parallel.elastic_ep_max_dp_size == 4 and parallel.data_parallel_size == 2
    assert parallel.eplb_config.communicator == "torch_gloo" and parallel.distributed_executor_backend == "mp"
    assert (args.enable_elastic_ep, args.distributed_executor_backend) == (True, None)  # the caller's, as given
    assert type(current_platform).ray_device_key == RAY_RESOURCE
    assert ENV_PREFIX in os.environ[RAY_PREFIXES].split(",") and os.environ["VLLM_DISABLE_COMPILE_CACHE"] == "1"


def test_the_frontend_refuses_a_bad_size_before_upstream_runs(model_dir):
    from vllm.v1.engine.async_llm import AsyncLLM

    elastic_args(model_dir).create_engine_config()  # installs the check, as the server's start does
    engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
        enable_elastic_ep=True, enable_eplb=True, elastic_ep_max_dp_size=4)))  # no lock: upstream never runs
    with pytest.raises(ValueError, match="new_data_parallel_size=1 is refused"):
        asyncio.run(AsyncLLM.scale_elastic_ep(engine, 1))
