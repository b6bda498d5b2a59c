"""torchrun plan worker for tests/test_preemption.py and tests/test_preemption_tiered.py."""
