"""A rank body whose module is slow to import: a rank process imports it before it can start."""

import multiprocessing
import time

IMPORT_S = 4

# true only while a starting child unpickles what it runs (spawned or forked from the fork
# server), not in pytest's own import
if getattr(multiprocessing.current_process(), "_inheriting", False):
    time.sleep(IMPORT_S)


def body(rank, world_size, init_method):
    return rank
