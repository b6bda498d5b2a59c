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
   restarts share it. Values copied from tutorials (``--rdzv-id=456``, ``100``, ``my_job``...) are the
   same for unrelated jobs, so such a run id (:func:`run_id_problem`: a number of fewer than 8 digits, a
   word from the examples, an unexpanded ``$VAR``) is ignored with a warning, once, and the job has no
   identity (a lease is then taken over only when its holder is gone or stale: never by mistake).

The rule: an id must name one job, never two. Two jobs given the same id would take one root from each
other (the one that lost it then fails its next save with LeaseError; nothing is corrupted, but work is
lost), so ids that are obviously shared (``none``, ``default``, ``0``...) are refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("safepoint")

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


MIN_NUMERIC_RUN_ID = 8
"""Fewest digits of an all-digit ``TORCHELASTIC_RUN_ID`` taken as a job identity: the examples use
``--rdzv-id=456``, ``100``, ``123``; a scheduler's job number (a Slurm job id passed along) is longer."""
EXAMPLE_RUN_IDS = frozenset(
    {"job", "myjob", "my_job", "my-job", "jobid", "job_id", "rdzv", "rdzv_id", "foo", "bar", "abc", "xyz"}
    | {"demo", "example", "exp", "experiment", "mnist", "ddp", "elastic", "torchrun", "test_job"}
)
"""Run ids the torchrun and cluster examples use, shared by every job that copied them."""
_warned: set[str] = set()


def run_id_problem(run_id: str) -> str | None:
    """Why ``TORCHELASTIC_RUN_ID`` cannot be trusted to name one job (None: it can)."""
    if (why := job_id_problem(run_id)) is not None:
        return why
    if run_id.isdigit() and len(run_id) < MIN_NUMERIC_RUN_ID:
        return f"{run_id!r} is a number of fewer than {MIN_NUMERIC_RUN_ID} digits (copied from an example?)"
    if run_id.lower() in EXAMPLE_RUN_IDS:
        return f"{run_id!r} is an id from the examples, shared by every job that copied it"
    if "$" in run_id or "{" in run_id:
        return f"{run_id!r} holds an unexpanded shell variable"
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
    why = run_id_problem(run_id)
    if why is None:
        return f"torchrun:{run_id}"
    if run_id.lower() not in ("", "none") and run_id not in _warned:  # "none": torchrun's default
        _warned.add(run_id)
        log.warning(
            "safepoint: TORCHELASTIC_RUN_ID %s: not used as this job's identity, since unrelated jobs would "
            "share it and take one root from each other; set SAFEPOINT_JOB_ID (or ClusterOptions.job_id) "
            "to something unique to this job",
            why,
        )
    return None
