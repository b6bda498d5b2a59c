"""Per-rank data position and RNG state: ResumableSampler and RNG capture."""
