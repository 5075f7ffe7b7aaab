"""A run's store for the tests that need one: a master on a port of its own choosing (no race for a free port)."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from eplb_reference.elastic.protocol import Board, RunSecret


def new_board(timeout_s: float = 10.0, run: str = "ep") -> Board:
    """A client of a new run's store, with a new run secret."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return Board(store, run, RunSecret.generate())


@pytest.fixture
def board() -> Board:
    return new_board()
