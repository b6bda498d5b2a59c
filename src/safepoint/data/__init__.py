"""Per-rank data position and RNG state: ResumableSampler and RNG capture; and the linear-time optimizer
load that TrainState.apply uses (optim_load.py: it needs torch only, so it lives in this lowest room)."""
