"""The vLLM setting for a kept placement: ``EPLB_GRAPH_PLACEMENT_FILE=PATH``.

Like the stall bound, it is an environment variable, which vLLM's frontend hands to every engine
and worker process it starts. With EPLB on:

* the config gate refuses, before any process starts, a path whose directory cannot be written,
  pipeline parallel (one EP group per stage), and a file that is not a placement file or was kept
  for another model, EP size or quantization (``check_at_engine_start``);
* each worker, right after ``load_model``, checks the file EP rank 0 read against everything it
  knows (layers, experts, slots too), agrees with the other EP ranks, and moves its experts to the
  file's placement before the first forward (``start``, ``upstream/kept_placement.py``);
* EP rank 0 rewrites the file each time a rearrangement has fully committed (a background
  writer) and at a clean shutdown (the runner's ``shutdown``).

Without the variable nothing is read or written.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING

from eplb_graph.core.placement_file import PlacementFileError, PlacementIdentity, check_start_file, config_hash
from eplb_graph.upstream import patches
from eplb_graph.upstream.kept_placement import PlacementKeeper

from .active_line import vllm_logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    from .worker import VllmEplbWorker

PLACEMENT_FILE = "EPLB_GRAPH_PLACEMENT_FILE"
# the gate's hash of the model config, named to the workers: a model may change its config while
# vLLM builds it, and the file a worker writes must fit the next start's gate
CONFIG_HASH = "EPLB_GRAPH_MODEL_CONFIG_HASH"


def placement_path(environ: Mapping[str, str]) -> str | None:
    return environ.get(PLACEMENT_FILE) or None


def vllm_identity(model_config: ModelConfig, ep_size: int, environ: Mapping[str, str],
                  moe_model: MixtureOfExperts | None = None) -> PlacementIdentity:
    """The identity a placement must have to serve this model; the layer and expert counts only
    where the model is built (``moe_model``: upstream's ``MixtureOfExperts``). The config's expert
    count is in its hash already, and the slot count is the built model's own: some upstream
    models hold no redundant slots whatever ``num_redundant_experts`` says (Sarvam, Param2MoE)."""
    counts = (None, None, None) if moe_model is None else (
        moe_model.num_moe_layers, moe_model.num_logical_experts, moe_model.num_physical_experts)
    hashed = environ.get(CONFIG_HASH) or config_hash(model_config.hf_config)
    return PlacementIdentity(model_config.architecture, hashed, *counts, ep_size, model_config.quantization or "none")


def check_at_engine_start(config: VllmConfig, environ: MutableMapping[str, str], *, check_file: bool = True) -> None:
    """In the frontend, before any worker starts: the file's directory is writable, and a file
    there fits this model, EP size and quantization (``PlacementFileError`` names what differs);
    the workers get the config hash checked here. ``check_file`` False (a headless node): the
    hash only; EP rank 0, which alone reads and writes the file, runs elsewhere."""
    path = placement_path(environ)
    if path is None:
        return
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise PlacementFileError(f"{PLACEMENT_FILE} keeps one EP group's placement; pipeline parallel "
                                 f"({parallel.pipeline_parallel_size} stages) has one EP group per stage")
    environ[CONFIG_HASH] = config_hash(config.model_config.hf_config)
    if check_file:
        ep_size = parallel.world_size_across_dp // parallel.pipeline_parallel_size
        check_start_file(path, vllm_identity(config.model_config, ep_size, environ))


def start(worker: VllmEplbWorker, environ: Mapping[str, str]) -> PlacementKeeper | None:
    """On every EP rank, after the worker bound its layers and before the async loop starts:
    the experts moved to the kept placement where the file exists; the keeper is closed by the
    runner's ``shutdown``. None without the setting."""
    from vllm.distributed.parallel_state import get_ep_group

    path = placement_path(environ)
    if path is None:
        return None
    runner = worker.runner
    model_state = worker.model_state
    identity = vllm_identity(runner.model_config, worker.ep_size, environ, model_state.model)
    keeper = PlacementKeeper(path, identity, ep_rank=worker.ep_rank, written_by="vllm")
    try:
        record = keeper.restore(worker.binding, runner.eplb_state, get_ep_group().cpu_group)
    except BaseException:
        keeper.abandon()
        raise
    if worker.ep_rank == 0:
        if record is None:
            vllm_logger().info("eplb-graph: no placement file at %s yet: serving starts from the initial placement; "
                               "the file is written as rearrangements commit", path)
        else:
            vllm_logger().info("eplb-graph: experts moved to the placement kept in %s (%d rearrangements, written by "
                               "%s) before the first forward", path, record.rearrangements, record.written_by)
    upstream_shutdown = runner.shutdown

    def shutdown(*args, **kwargs):
        try:
            keeper.close(model_state, worker.stats.rearrangements_finished)
        except Exception:  # noqa: BLE001  (the rest of the worker's shutdown must still run)
            vllm_logger().exception("eplb-graph: the placement file %s could not be written at shutdown", path)
        upstream_shutdown(*args, **kwargs)

    patches.install("worker.shutdown", shutdown, by=worker, on=runner)
    return keeper
