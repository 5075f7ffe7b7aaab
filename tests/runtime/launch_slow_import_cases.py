"""A rank body whose module is slow to import: a spawned rank imports it before it can start."""

import multiprocessing
import time

IMPORT_S = 4

if multiprocessing.parent_process() is not None:  # in a spawned rank, not in pytest's own import
    time.sleep(IMPORT_S)


def body(rank, world_size, init_method):
    return rank
