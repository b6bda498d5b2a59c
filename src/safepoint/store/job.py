"""Which job owns a root: the identity a restart shares with the attempt it replaces.

A lease records its holder's job. A new holder of the *same* job takes the lease over at once, on any
host: it is a restart of that job (torchrun restarting workers after a node died, Slurm requeueing), and
the old holder is dead or about to be (fencing stops it from committing or deleting either way: its token
is no longer on the store). A holder of another job, or of none, is refused until its heartbeat is stale.

The identity is, first match wins:

1. ``ClusterOptions(job_id=...)``, then the environment variable ``SAFEPOINT_JOB_ID`` (``job:<id>``): what
   the user says. On Kubernetes, set it from the Job's name with the downward API
   (``fieldRef: metadata.labels['batch.kubernetes.io/job-name']``): a pod cannot see its labels otherwise.
2. ``SLURM_JOB_ID`` with ``SLURM_CLUSTER_NAME`` (``slurm:<cluster>/<id>``): unique per cluster, and kept
   by a requeued job, so a requeue on other nodes takes over at once. Job steps of one allocation count
   as the same job.
3. ``TORCHELASTIC_RUN_ID`` (``torchrun:<id>``): torchrun's ``--rdzv-id``, the same on every node and
   every restart of one launch. torchrun's default is the literal ``none`` (no identity: ignored);
   ``--standalone`` and single-node launches get a random uuid per launch, so only torchrun's own
   restarts share it.

The rule: an id must name one job, never two. Two jobs given the same id would take one root from each
other (the one that lost it then fails its next save with LeaseError; nothing is corrupted, but work is
lost), so ids that are obviously shared (``none``, ``default``, ``0``...) are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

JOB_ENV = "SAFEPOINT_JOB_ID"
MAX_JOB_ID = 256
NOT_UNIQUE = frozenset(
    {
        "",
        "none",
        "null",
        "nil",
        "default",
        "job",
        "jobs",
        "run",
        "test",
        "train",
        "training",
        "0",
        "1",
        "unknown",
    }
)
"""Ids that many jobs would share (torchrun's ``--rdzv-id`` default is ``none``): never an identity."""


def job_id_problem(job_id: object) -> str | None:
    """Why ``job_id`` cannot name a job (None: it can)."""
    if not isinstance(job_id, str):
        return f"must be a string, got {type(job_id).__name__}"
    if len(job_id) > MAX_JOB_ID:
        return f"must be at most {MAX_JOB_ID} characters, got {len(job_id)}"
    if not job_id.isprintable() or job_id != job_id.strip():
        return f"must be printable, without surrounding blanks, got {job_id!r}"
    if job_id.lower() in NOT_UNIQUE:
        return f"{job_id!r} is not unique to one job (two jobs sharing an id take one root from each other)"
    return None


def check_job_id(job_id: object, name: str = "ClusterOptions.job_id") -> None:
    """ValueError, in one line, unless ``job_id`` can name one job."""
    if (why := job_id_problem(job_id)) is not None:
        raise ValueError(f"{name} {why}")


def job_identity(explicit: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The job this process belongs to (see the module docstring), or None when nothing names it."""
    env = os.environ if env is None else env
    if explicit is not None:
        check_job_id(explicit)
        return f"job:{explicit}"
    if JOB_ENV in env:
        check_job_id(env[JOB_ENV], f"environment variable {JOB_ENV}")
        return f"job:{env[JOB_ENV]}"
    slurm = env.get("SLURM_JOB_ID", "")
    if slurm.isdigit():  # Slurm's ids are numbers, unique per cluster (job 1 is a real job there)
        return f"slurm:{env.get('SLURM_CLUSTER_NAME', '')}/{slurm}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if job_id_problem(run_id) is None:
        return f"torchrun:{run_id}"
    return None
