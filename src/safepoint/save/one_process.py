"""DCP's save, for a save with no process group: the same planner and storage-writer calls, in the same
order, without DCP's distributed plumbing.

``dcp.save(no_dist=True)`` runs, for one process, exactly the steps below, but through a wrapper built
for many ranks: a ``_DistWrapper`` whose gather/scatter are list copies, a logging decorator on every
step (each builds a dict of the call's arguments for a debug message nobody reads), ``inspect.signature``
of two methods per save, a warning raised and filtered per save, ``Stateful`` unwrapping of a state dict
that holds none (``TrainState.capture`` returned plain dicts). On a small state that plumbing is ~1 ms of
a ~10 ms save (issue 27, round 5 of docs/benchmarks.md). What is kept, the planner's and the writer's
steps, is what decides the bytes: the files and ``.metadata`` are DCP's own, so plain ``dcp.load`` reads
them as before (tests/save/test_one_process.py compares the directory with ``dcp.save``'s).

Failures keep DCP's shape: any exception of the planning steps is raised as ``CheckpointException("plan",
{0: ...})`` and of the write and finish steps as ``CheckpointException("write", {0: ...})``, as DCP's
wrapper does, so the saver reports them alike (errors.describe_exception).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter


def save_one_process(state_dict: dict[str, Any], writer: StorageWriter, planner: SavePlanner) -> Metadata:
    """``dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)``, minus the plumbing.

    ``state_dict`` holds no ``Stateful`` objects (a captured state: nested dicts, lists, tensors, values),
    and ``writer.reset`` is not called (``dcp.save`` calls it only for a ``checkpoint_id``)."""
    try:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=True)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
        plans, metadata = planner.create_global_plan([local_plan])
        central_plan = writer.prepare_global_plan(plans)[0]
    except BaseException as e:  # as DCP's reduce_scatter: every failure becomes the step's exception
        raise CheckpointException("plan", {0: _wrap_exception(e)}) from None
    try:
        results = writer.write_data(planner.finish_plan(central_plan), planner)
        results.wait()
        writer.finish(metadata=metadata, results=[results.value()])
    except BaseException as e:  # as DCP's all_reduce
        raise CheckpointException("write", {0: _wrap_exception(e)}) from None
    return metadata
