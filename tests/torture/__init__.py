"""The crash-consistency and fault torture suite's harness (test-only; not shipped).

- ``faults``: a fault-injecting layer under every storage operation of a child process (safepoint's and
  DCP's own): crash at the k-th operation (a real SIGKILL), or fail it with ENOSPC/EIO; it journals what
  was made durable (fsync) so the parent can roll back what was not.
- ``durable``: in the parent, rebuild the tree a power loss could leave from that journal.
- ``zygote`` / ``harness`` / ``scenarios``: a clean process that imports torch once and forks one child
  per case; the parent's side of it (with a timeout on every child); the workloads the children run.
- ``checks``: the invariants, checked in the parent (which never had the patches), and the crash and
  fault campaigns.
- ``objstore``: the same for object storage: a fault-injecting HTTP proxy in front of moto's S3 server
  (tests/helpers/s3.py) crashes or fails every mutation a save, a retention pass or an upload sends.
- ``kills`` / ``dist_train``: random SIGKILL campaigns against real training, single process and 2-rank
  torchrun, with bitwise exactness checks.

docs/reliability.md describes what the suite proves and its latest figures; tests/torture/README.md how
it works and what it found.
"""
