"""Per-rank bodies of the multi-rank tests (module level, so spawned processes can import them)."""

import os
import time

import torch


# The movement tests' model: small enough to step eagerly, hot experts drifting every 10 steps.
MOVEMENT = dict(mode="eager", num_layers=2, num_experts=8, num_redundant_experts=4, hidden=32, expert_intermediate=16,
                shared_expert_intermediate=16, top_k=2, drift_every=10, window_size=4, step_interval=8)


def _setup(rank, world_size, init_method, **overrides):
    """The rank's groups and vLLM config (returned as a context to enter), autograd off."""
    from vllm.config import set_current_vllm_config

    from eplb_reference.runtime.config import RunConfig
    from eplb_reference.runtime.groups import init_expert_parallel

    torch.set_num_threads(1)
    cfg = RunConfig(**{**MOVEMENT, "ranks": world_size, **overrides})
    cfg.validate()
    config = init_expert_parallel(
        rank, world_size, init_method, num_redundant_experts=cfg.num_redundant_experts, window_size=cfg.window_size,
        step_interval=cfg.step_interval, timeout_s=20,
    )
    return cfg, set_current_vllm_config(config)


def _stack(cfg, rank, world_size, **options):
    from vllm.distributed.parallel_state import get_ep_group

    from eplb_reference.runtime.stack import build_rank_stack

    group = get_ep_group().device_group if world_size > 1 else None
    return build_rank_stack(cfg, rank, world_size, group, **options)


def _batch(cfg, step, rank):
    from eplb_reference.runtime.workload import make_batch

    return make_batch(cfg.workload(), step, rank)


def _slots_of(placement, num_logical, width):
    """The inverse of a placement, slot by slot: each logical expert's slots, ascending, -1 padded."""
    rows = [[slot for slot, expert in enumerate(placement.tolist()) if expert == logical] for logical in range(num_logical)]
    return [row + [-1] * (width - len(row)) for row in rows]


def live_rebalancing(rank, world_size, init_method, weight_format, steps, load_phase, policy_process=False):
    cfg, context = _setup(rank, world_size, init_method, weight_format=weight_format, policy_process=policy_process)
    with context:
        stack = _stack(cfg, rank, world_size, load_phase=load_phase)
        controller = stack.controller
        placements, recorded, mismatched_steps = [], [], []
        for step in range(steps):
            # ranks disagree on the phase of a batch: each filters its own load, all step together
            is_prefill = (step + rank) % 3 == 0
            pointer = stack.rank_layers[0].tables.lookup.data_ptr()
            stack.step(_batch(cfg, step, rank), is_prefill=is_prefill)
            recorded.append((is_prefill, bool(stack.flags.record_enabled)))
            assert stack.rank_layers[0].tables.lookup.data_ptr() == pointer
            placements.append(controller.placements())
            if not stack.local_weights_match_placement():
                mismatched_steps.append(step)
            # the lookup routes by exactly upstream's committed placement, and upstream's own
            # inverse maps (derived by the adapter's logical_maps in its place) agree with it
            for index, (layer, committed) in enumerate(zip(stack.rank_layers, controller.placements())):
                assert torch.equal(layer.tables.physical_to_logical, committed)
                slots = controller.model_state.logical_to_physical_map[index]  # [N, upstream's width]
                assert slots.tolist() == _slots_of(committed, slots.shape[0], slots.shape[1])
                assert controller.model_state.logical_replica_count[index].tolist() == [
                    int((committed == expert).sum()) for expert in range(slots.shape[0])
                ]
        return {
            "max_abs_diff": max(stack.max_abs_diff),
            "stats": vars(controller.stats),
            "distinct_placements": len({tuple(p.flatten().tolist()) for p in placements}),
            "mismatched_steps": mismatched_steps,
            "bytes_received": controller.communicator.bytes_received,
            "recorded": recorded,
            "upstream_step": controller.state.expert_rearrangement_step,
            "rejected": controller.binding.rejected_placements,
            "patches": controller.binding.capabilities.installed,
            "policy": type(controller.state.policy).__name__,
            "policy_pid": getattr(controller.state.policy, "pid", None),
            "pid": os.getpid(),
        }


def upstream_rearrange_with_our_communicator(rank, world_size, init_method):
    """Drives upstream's own rearrange_expert_weights_inplace with GlooStagedCommunicator."""
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    from vllm.distributed.parallel_state import get_ep_group, get_eplb_group

    from eplb_graph.movement.mover import GlooStagedCommunicator

    _, context = _setup(rank, world_size, init_method)
    with context:
        num_layers, num_physical = 2, 12
        num_local = num_physical // world_size
        gen = torch.Generator().manual_seed(7)
        # an FP8 block checkpoint's weights and scales, and packed int4 weights, move exactly
        logical = [[torch.randn(8, 6, 5, generator=gen).to(torch.float8_e4m3fn), torch.randn(8, 3, generator=gen),
                    torch.randint(-8, 8, (8, 4), generator=gen, dtype=torch.int8)] for _ in range(num_layers)]
        old = torch.stack([torch.cat([torch.arange(8), torch.arange(4)]) for _ in range(num_layers)])
        new = torch.stack([torch.cat([torch.arange(8), torch.randint(0, 8, (4,), generator=gen)])[torch.randperm(num_physical, generator=gen)]
                           for _ in range(num_layers)])
        local = slice(rank * num_local, (rank + 1) * num_local)
        weights = [[w[old[i, local]].clone() for w in logical[i]] for i in range(num_layers)]
        buffers = [torch.empty_like(w) for w in weights[0]]
        communicator = GlooStagedCommunicator(get_eplb_group().cpu_group, timeout_s=20)
        rearrange_expert_weights_inplace(old, new, weights, buffers, get_ep_group().device_group, communicator)
        direct = [[w[new[i, local]] for w in logical[i]] for i in range(num_layers)]
        return {
            "equal": all(torch.equal(a, b) for layer_a, layer_b in zip(weights, direct) for a, b in zip(layer_a, layer_b)),
            "bytes_received": communicator.bytes_received,
        }


def peer_dies_mid_transfer(rank, world_size, init_method):
    from eplb_graph.movement import mover

    cfg, context = _setup(rank, world_size, init_method)
    with context:
        stack = _stack(cfg, rank, world_size, transfer_timeout_s=10)
        execute, transfers = mover.GlooStagedCommunicator.execute, []

        def execute_then_maybe_die(self):
            if self._ops:
                transfers.append(time.monotonic())
                if rank == world_size - 1 and len(transfers) == 3:
                    os._exit(17)  # the peer vanishes in the middle of a rearrangement
            return execute(self)

        mover.GlooStagedCommunicator.execute = execute_then_maybe_die
        committed_before = None
        try:
            for step in range(300):
                committed_before = stack.controller.placements()
                stack.step(_batch(cfg, step, rank))
        except Exception as error:
            return {
                "error_type": type(error).__name__,
                "message": str(error),
                "seconds_after_death": time.monotonic() - transfers[-1] if transfers else None,
                "weights_match_lookup": stack.local_weights_match_placement(),
                "lookup_is_committed": all(
                    torch.equal(layer.tables.physical_to_logical, row)
                    for layer, row in zip(stack.rank_layers, stack.controller.placements())
                ),
                "placement_unchanged_by_failure": torch.equal(committed_before, stack.controller.placements()),
            }
        return {"error_type": None}


def invalid_policy_output_is_rejected(rank, world_size, init_method):
    cfg, context = _setup(rank, world_size, init_method)
    with context:
        stack = _stack(cfg, rank, world_size)

        class BrokenPolicy:
            @classmethod
            def rebalance_experts(cls, weight, num_replicas, *args, **kwargs):
                placement = torch.arange(num_replicas).repeat(weight.shape[0], 1)
                placement[:, 0] = 999  # a logical id that does not exist
                return placement

        stack.controller.state.policy = BrokenPolicy
        before = [(layer.tables.lookup.clone(), [w.clone() for w in layer.weight_view]) for layer in stack.rank_layers]
        bytes_before = stack.controller.communicator.bytes_received
        for step in range(24):
            stack.step(_batch(cfg, step, rank))
        unchanged = all(
            torch.equal(layer.tables.lookup, lookup) and all(torch.equal(a, b) for a, b in zip(layer.weight_view, weights))
            for layer, (lookup, weights) in zip(stack.rank_layers, before)
        )
        return {
            "rejected": stack.controller.binding.rejected_placements,
            "unchanged": unchanged,
            "bytes_moved": stack.controller.communicator.bytes_received - bytes_before,
            "max_abs_diff": max(stack.max_abs_diff),
        }


def run_rank_then_die(rank, world_size, init_method, cfg, die_rank, die_step):
    """The runtime's rank body, except that rank `die_rank` vanishes at step `die_step`."""
    from eplb_reference.runtime import rank as rank_module

    make_batch = rank_module.make_batch

    def make_batch_or_die(spec, step, batch_rank):
        if batch_rank == die_rank and step == die_step:
            os._exit(17)
        return make_batch(spec, step, batch_rank)

    rank_module.make_batch = make_batch_or_die
    return rank_module.run_rank(rank, world_size, init_method, cfg)


def run_rank_losing_weight_moves(rank, world_size, init_method, cfg):
    """The runtime's rank body with upstream's buffer-to-weights copy dropped: every layer
    commit publishes a placement whose weights never arrived (a lost weight move)."""
    import vllm.distributed.eplb.eplb_state as eplb_state

    from eplb_reference.runtime import rank as rank_module

    eplb_state.move_from_buffer = lambda *args, **kwargs: None
    return rank_module.run_rank(rank, world_size, init_method, cfg)


def run_rank_with_nan_weight_moves(rank, world_size, init_method, cfg):
    """The runtime's rank body with every expert slot a commit changes overwritten with NaN
    after upstream's buffer-to-weights copy (a corrupt weight move)."""
    import vllm.distributed.eplb.eplb_state as eplb_state

    from eplb_reference.runtime import rank as rank_module

    move_from_buffer = eplb_state.move_from_buffer

    def move_then_poison(expert_weights, expert_weights_buffers, transfer_metadata, new_indices, ep_rank):
        move_from_buffer(expert_weights, expert_weights_buffers, transfer_metadata, new_indices, ep_rank)
        changed = torch.from_numpy(~transfer_metadata.is_unchanged)  # [local slots]
        for weight in expert_weights:
            if weight.is_floating_point():
                weight[changed] = float("nan")

    eplb_state.move_from_buffer = move_then_poison
    return rank_module.run_rank(rank, world_size, init_method, cfg)


def close_mid_rearrangement(rank, world_size, init_method):
    """Steps until a rearrangement is under way, then closes the controller at once."""
    cfg, context = _setup(rank, world_size, init_method)
    with context:
        stack = _stack(cfg, rank, world_size)
        controller = stack.controller
        step = 0
        while not controller.rebalancing:
            stack.step(_batch(cfg, step, rank), check=False)
            step += 1
        committed_before = controller.stats.layers_committed
        controller.close()
        model_state = controller.model_state
        return {
            "closed_at_step": step,
            "committed_before_close": committed_before,
            "rebalanced_after_close": model_state.rebalanced,
            "pending_after_close": model_state.pending_result is not None,
            "weights_match_lookup": stack.local_weights_match_placement(),
            "lookup_is_committed": all(
                torch.equal(layer.tables.physical_to_logical, committed)
                for layer, committed in zip(stack.rank_layers, controller.placements())
            ),
        }


def failed_controller_leaves_upstream_unpatched(rank, world_size, init_method):
    """The policy helper fails to start: the controller raises and takes its patches back."""
    from vllm.distributed.eplb import async_worker, eplb_state, rebalance_execute

    from eplb_reference.runtime import policy_process

    def refuse(*args, **kwargs):
        raise policy_process.PolicyProcessError("helper refused to start")

    originals = {(module, name): getattr(module, name) for module, name in (
        (eplb_state, "compute_logical_maps"), (eplb_state, "CpuGpuEvent"), (eplb_state, "start_async_worker"),
        (rebalance_execute, "get_ep_ranks_with_experts_batch"))}
    cfg, context = _setup(rank, world_size, init_method, policy_process=True)
    with context:
        policy_process.PolicyProcess = refuse
        try:
            _stack(cfg, rank, world_size)
        except policy_process.PolicyProcessError as error:
            message = str(error)
        else:
            message = None
    return {
        "message": message,
        "restored": all(getattr(module, name) is original for (module, name), original in originals.items()),
        "worker_event_restored": async_worker.CpuGpuEvent.__module__.startswith("vllm."),
    }


def stalled_worker(rank, world_size, init_method, stall_steps, release_at):
    """Upstream's async worker blocks inside its transfer (stalls, does not die) until step
    `release_at`: the watchdog must count the stall while the committed placement serves on."""
    import threading
    import warnings

    from eplb_graph.movement import mover
    from eplb_graph.upstream.watchdog import EplbStallWarning

    cfg, context = _setup(rank, world_size, init_method, stall_steps=stall_steps)
    released, execute = threading.Event(), mover.GlooStagedCommunicator.execute

    def execute_when_released(self):
        released.wait(600)  # bounded: the test releases it
        return execute(self)

    mover.GlooStagedCommunicator.execute = execute_when_released
    with context, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EplbStallWarning)
        stack = _stack(cfg, rank, world_size)
        stalls_before_release, committed_before_release = None, None
        for step in range(release_at + 40):
            if step == release_at:
                stalls_before_release = stack.controller.binding.rearrangement_stalls
                committed_before_release = stack.controller.stats.layers_committed
                released.set()
            stack.step(_batch(cfg, step, rank))
        stack.close()
    return {
        "stalls_before_release": stalls_before_release,
        "committed_before_release": committed_before_release,
        "committed_after_release": stack.controller.stats.layers_committed,
        "stall_warnings": [str(w.message) for w in caught if issubclass(w.category, EplbStallWarning)],
        "max_abs_diff": max(stack.max_abs_diff),
        "weights_match_lookup": stack.local_weights_match_placement(),
    }


def start_from_placement_file(rank, world_size, init_method, paths):
    """A rank started from ``paths[rank]`` (checked by the ranks together, not by ``validate``, so
    each rank may see another file): its tables and weights before the first forward, then one
    checked step; or the error every rank raised."""
    import dataclasses

    from eplb_graph.core.placement_file import PlacementFileError

    cfg, context = _setup(rank, world_size, init_method)
    cfg = dataclasses.replace(cfg, placement_file=paths[rank])
    with context:
        try:
            stack = _stack(cfg, rank, world_size)
        except PlacementFileError as error:
            return {"error": str(error)}
        start = [layer.tables.physical_to_logical.tolist() for layer in stack.rank_layers]
        weights_match = stack.local_weights_match_placement()
        stack.step(_batch(cfg, 0, rank))  # checked against the one-process model
        stats = dict(vars(stack.controller.stats))
        stack.close()
        return {"start": start, "weights_match": weights_match, "max_abs_diff": max(stack.max_abs_diff),
                "stats": stats}
