"""Policies for the helper-process tests: importable by module name, as the helper must import them."""

import os
import time

import torch


class PidPolicy:
    """Writes the computing process's pid into every slot: shows where the policy ran."""

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None):
        print("a policy that logs to stdout")  # must not reach the reply pipe
        return torch.full((weight.shape[0], num_replicas), os.getpid(), dtype=torch.int64)


class FailingPolicy:
    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None):
        raise ValueError(f"cannot place {num_replicas} replicas")


class SlowPolicy:
    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None):
        time.sleep(float(weight.flatten()[0]))
        return old_global_expert_indices
