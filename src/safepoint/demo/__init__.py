"""``safepoint demo``: the driver, the torchrun job, its report and its timeline plot."""
