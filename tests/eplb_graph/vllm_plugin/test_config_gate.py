"""The engine-config gate, on vLLM's real EngineArgs (no engine is started).

EngineArgs.__post_init__ loads the installed ``vllm.general_plugins`` entry point, so these
tests go through exactly the path a user's ``LLM(...)`` takes up to the engine config.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import fx

pytest.importorskip("vllm")

from vllm.compilation.passes.inductor_pass import CallableInductorPass  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.vllm_plugin.config_gate import EplbConfigError  # noqa: E402
from eplb_graph.vllm_plugin.graph_pass import VllmEplbPass  # noqa: E402
from eplb_reference.models.tiny_checkpoint import write_tiny_qwen3_moe  # noqa: E402

EPLB = {"window_size": 4, "step_interval": 8, "num_redundant_experts": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe")))


def engine_args(model_dir: str, **overrides) -> EngineArgs:
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="float32", max_model_len=128)
    return EngineArgs(**{**kwargs, **overrides})


def eplb_args(model_dir: str, **overrides) -> EngineArgs:
    eplb = {**EPLB, **overrides.pop("eplb", {})}
    return engine_args(model_dir, **{"enable_expert_parallel": True, "enable_eplb": True, "eplb_config": eplb, **overrides})


def test_plugin_is_loaded_by_vllm_and_wraps_engine_config_creation(model_dir):
    engine_args(model_dir)  # __post_init__ loads general plugins
    assert patches.installed("gate.create_engine_config")


def test_eplb_off_changes_nothing(model_dir):
    args = engine_args(model_dir)
    with_plugin = args.create_engine_config()
    upstream = EngineArgs.create_engine_config.__wrapped__(engine_args(model_dir))
    assert not with_plugin.parallel_config.enable_eplb
    assert "post_grad_custom_post_pass" not in with_plugin.compilation_config.inductor_compile_config
    assert with_plugin.compute_hash() == upstream.compute_hash()


def test_eplb_on_cpu_is_lifted_with_the_requested_config_and_our_pass(model_dir):
    config = eplb_args(model_dir).create_engine_config()
    parallel = config.parallel_config
    assert parallel.enable_eplb and parallel.enable_expert_parallel
    assert parallel.eplb_config.num_redundant_experts == 2
    assert (parallel.eplb_config.window_size, parallel.eplb_config.step_interval) == (4, 8)
    assert parallel.eplb_config.use_async and parallel.eplb_config.communicator == "torch_gloo"
    slot = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(slot, VllmEplbPass) and slot.user_pass is None


def test_expert_parallel_over_tensor_parallel_workers_is_served_on_cpu(model_dir):
    """EP over 2 workers: each rank's experts run its own pairs (local_experts.py; engines: test_engine.py)."""
    config = eplb_args(model_dir, tensor_parallel_size=2).create_engine_config()
    parallel = config.parallel_config
    assert parallel.enable_eplb and parallel.tensor_parallel_size == 2 and parallel.enable_expert_parallel


def test_a_users_post_grad_pass_is_kept_and_still_runs(model_dir):
    seen = []

    def user_pass(graph: fx.Graph) -> None:
        seen.append(len(graph.nodes))

    user = CallableInductorPass(user_pass, "user-pass-v1")
    config = eplb_args(
        model_dir, compilation_config={"inductor_compile_config": {"post_grad_custom_post_pass": user}}
    ).create_engine_config()
    slot = config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(slot, VllmEplbPass) and slot.user_pass.uuid() == user.uuid()  # vLLM copies the config
    graph = fx.symbolic_trace(torch.nn.Linear(2, 2)).graph
    slot(graph)  # no EPLB layers live in this process: ours maps nothing, the user's runs
    assert seen == [len(graph.nodes)]
    assert slot.uuid() != VllmEplbPass().uuid()  # the user's pass is part of the cache key


def refused_as_given(args, match: str) -> EplbConfigError:
    """The engine config refused by name, the request left exactly as the user gave it (nothing half-applied)."""
    before = copy.deepcopy((args.enable_eplb, args.eplb_config))
    with pytest.raises(EplbConfigError, match=match) as error:
        args.create_engine_config()
    assert (args.enable_eplb, args.eplb_config) == before
    return error.value


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"eplb": {"use_async": False}}, "synchronous EPLB"),
        ({"additional_config": {"dynamic_eplb": True, "expert_map_path": "/x.json"}}, "['dynamic_eplb', 'expert_map_path']"),
        ({"quantization": "bitsandbytes"}, "quantization='bitsandbytes' has no expert-weight view"),
        ({"enable_dbo": True}, "enable_dbo=True"),
        ({"enable_expert_parallel": False}, "enable_expert_parallel=False"),
        ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2 on CPU"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "tensor_parallel_size=2 with data_parallel_size=2 on CPU"),
    ],
)
def test_unsupported_combinations_are_refused_by_name_before_anything_starts(model_dir, overrides, named):
    error = refused_as_given(eplb_args(model_dir, **overrides), "eplb-graph cannot serve this EPLB request")
    assert named in str(error)


def test_online_fp8_per_block_is_accepted(model_dir):
    config = eplb_args(model_dir, quantization="fp8_per_block", dtype="bfloat16").create_engine_config()
    assert config.parallel_config.enable_eplb and config.model_config.quantization == "fp8_per_block"


@pytest.mark.parametrize("quantization", ["fp8_per_tensor", "fp8_per_channel"])
def test_online_fp8_no_view_was_bound_to_is_refused_by_name(model_dir, quantization):
    with pytest.raises(EplbConfigError, match=f"quantization='{quantization}' has no expert-weight view"):
        eplb_args(model_dir, quantization=quantization, dtype="bfloat16").create_engine_config()


@pytest.mark.parametrize(("quantization", "quantization_config", "built"), [
    ("fp8", None, "Fp8PerTensorOnlineMoEMethod"),  # a bf16 checkpoint: vLLM quantizes `fp8` online per tensor
    ("fp8_per_block", {"moe": "fp8_per_tensor"}, "Fp8PerTensorOnlineMoEMethod"),  # the user's MoE spec wins
])
def test_online_fp8_is_judged_by_the_moe_method_vllm_builds(model_dir, quantization, quantization_config, built):
    args = eplb_args(model_dir, quantization=quantization, quantization_config=quantization_config, dtype="bfloat16")
    refused_as_given(args, rf"quantization='{quantization}' builds {built} for the MoE layers "
                           rf"\(online, weights fp8_per_tensor_static\).* has no expert-weight view")


@pytest.mark.parametrize("quantization_config", [
    {"moe": "fp8_per_block", "linear": "fp8_per_block"},  # builds a viewed method
    {"ignore": ["*experts*"]},  # the experts' method depends on their names: checked when each layer is bound
])
def test_fp8_online_is_accepted_where_the_moe_method_is_viewed_or_chosen_per_layer(model_dir, quantization_config):
    config = eplb_args(model_dir, quantization="fp8", quantization_config=quantization_config,
                       dtype="bfloat16").create_engine_config()
    assert config.parallel_config.enable_eplb and config.model_config.quantization == "fp8"


def test_a_checkpoints_own_quantization_is_checked_accepted_or_refused_by_name(tmp_path):
    fp8 = write_tiny_qwen3_moe(tmp_path / "fp8", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    assert eplb_args(str(fp8), dtype="bfloat16").create_engine_config().model_config.quantization == "fp8"
    awq = write_tiny_qwen3_moe(tmp_path / "awq", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"})
    refused_as_given(eplb_args(str(awq), dtype="bfloat16"), "quantization='awq' has no expert-weight view")


def test_a_stall_bound_that_is_not_one_is_refused_at_engine_start_naming_the_variable(model_dir, monkeypatch):
    monkeypatch.setenv("EPLB_GRAPH_STALL_STEPS", "0")
    with pytest.raises(EplbConfigError, match="EPLB_GRAPH_STALL_STEPS must be an int >= 1, got 0"):
        eplb_args(model_dir).create_engine_config()


def test_an_adaptation_upstream_broke_is_refused_at_engine_start_by_name(model_dir, monkeypatch):
    """Before any worker starts, naming each target, as ``eplb-graph doctor`` does; EPLB off serves."""
    from vllm.distributed.eplb import eplb_state

    monkeypatch.delattr(eplb_state, "_commit_eplb_maps_for_layer")
    monkeypatch.setattr(eplb_state.EplbState, "_should_record_current_step", lambda self: False)
    with pytest.raises(EplbConfigError) as refused:
        eplb_args(model_dir).create_engine_config()
    message = str(refused.value)
    assert message.startswith("eplb-graph cannot serve EPLB on this vLLM: upstream changed what it adapts")
    assert "vllm.distributed.eplb.eplb_state._commit_eplb_maps_for_layer: target missing; eplb-graph adapts it" in message
    assert "EplbState._should_record_current_step: signature changed (expected parameters (self, log_stats" in message
    assert message.count("\n  ") == 2  # those two (the step probes' layer is not the plugin's)
    assert not engine_args(model_dir).create_engine_config().parallel_config.enable_eplb


def test_a_placement_file_that_cannot_serve_is_refused_at_engine_start_naming_why(model_dir, tmp_path, monkeypatch):
    """EPLB_GRAPH_PLACEMENT_FILE, checked in the frontend before any worker starts: a file kept for
    another EP size, another model, or one that is corrupt; a directory that cannot hold it (not on a
    headless node: EP rank 0 alone reads and writes it). The layer, expert and slot counts are the
    built model's, checked by the workers (tests/eplb_graph/upstream/test_kept_placement.py, test_engine.py)."""
    from eplb_graph.core.placement import initial_placement
    from eplb_graph.core.placement_file import PlacementRecord, save
    from eplb_graph.vllm_plugin.kept_placement import CONFIG_HASH, check_at_engine_start, vllm_identity

    config = eplb_args(model_dir).create_engine_config()
    fits = dataclasses.replace(vllm_identity(config.model_config, 1, {}), num_layers=2, num_logical_experts=8,
                               num_physical_experts=10)
    path = tmp_path / "placement.json"
    monkeypatch.setenv("EPLB_GRAPH_PLACEMENT_FILE", str(path))
    monkeypatch.setenv(CONFIG_HASH, "")  # taken back after the test, though the gate sets it
    eplb_args(model_dir).create_engine_config()  # no file yet: the engine will write it
    assert os.environ[CONFIG_HASH] == fits.config_hash  # what the workers will put in the file

    def kept(identity):  # a file of that identity, its placement of that shape
        redundant = identity.num_physical_experts - identity.num_logical_experts
        placement = initial_placement(identity.num_logical_experts, redundant).repeat(identity.num_layers, 1)
        save(path, PlacementRecord(identity, placement, None, 1, "vllm"))

    def refused(identity, message):
        kept(identity)
        with pytest.raises(EplbConfigError, match=message):
            eplb_args(model_dir).create_engine_config()

    kept(fits)
    eplb_args(model_dir).create_engine_config()  # fits
    refused(dataclasses.replace(fits, ep_size=2), "ep_size is 2 in the file, 1 here")
    refused(dataclasses.replace(fits, config_hash="0"), "config_hash is '0' in the file")
    refused(dataclasses.replace(fits, quantization="fp8"), "quantization is 'fp8' in the file, 'none' here")
    kept(dataclasses.replace(fits, num_layers=3, num_logical_experts=6, num_physical_experts=12))
    eplb_args(model_dir).create_engine_config()  # counts the gate does not know: the workers check them
    path.write_text(path.read_text().replace('"written_by": "vllm"', '"written_by": "x"'))
    with pytest.raises(EplbConfigError, match="is corrupt: its checksum does not match"):
        eplb_args(model_dir).create_engine_config()
    monkeypatch.setenv("EPLB_GRAPH_PLACEMENT_FILE", str(tmp_path / "missing" / "placement.json"))
    with pytest.raises(EplbConfigError, match="directory .*missing does not exist"):
        eplb_args(model_dir).create_engine_config()
    eplb_args(model_dir).create_engine_config(headless=True)  # a node without EP rank 0 neither reads nor writes it
    assert not engine_args(model_dir).create_engine_config().parallel_config.enable_eplb  # EPLB off reads nothing
    staged = copy.copy(config)  # one EP group per pipeline stage: which would the file be?
    staged.parallel_config = copy.copy(config.parallel_config)
    staged.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="keeps one EP group's placement; pipeline parallel"):
        check_at_engine_start(staged, {"EPLB_GRAPH_PLACEMENT_FILE": str(path)})


@pytest.mark.launches
def test_without_the_plugin_vllm_refuses_eplb_on_cpu(model_dir):
    """What the plugin lifts is real: the same request fails in upstream vLLM alone."""
    script = (
        "import sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"args = EngineArgs(model={model_dir!r}, skip_tokenizer_init=True, load_format='dummy', dtype='float32',"
        f" max_model_len=128, enable_expert_parallel=True, enable_eplb=True, eplb_config={EPLB!r})\n"
        "from eplb_graph.upstream import patches\n"
        "assert not patches.installed('gate.create_engine_config')\n"
        "try:\n    args.create_engine_config()\nexcept Exception as error:\n    print('REFUSED', error)\n"
        "else:\n    print('ACCEPTED')\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver"}  # every plugin but ours
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "only supported on CUDA" in out.stdout


@pytest.mark.launches
def test_vllms_cpu_build_cannot_load_online_per_tensor_fp8_with_eplb_off_either(model_dir):
    """Why no view of online per-tensor FP8 was bound here: upstream alone, EPLB off, fails at load
    (its per-tensor FP8 quant op is registered without a kernel in the CPU build)."""
    script = (
        "import os\n"
        "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n"
        "from vllm import LLM\n"
        "try:\n"
        f"    LLM(model={model_dir!r}, skip_tokenizer_init=True, load_format='dummy', dtype='bfloat16',"
        " max_model_len=128, quantization='fp8', enforce_eager=True)\n"
        "except Exception as error:\n    print('FAILED', type(error).__name__, error)\n"
        "else:\n    print('LOADED')\n"
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "FAILED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "_C::static_scaled_fp8_quant()" in out.stdout + out.stderr, out.stderr[-3000:]  # the op, with no arguments
