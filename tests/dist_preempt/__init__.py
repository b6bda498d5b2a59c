"""torchrun plan worker for tests/preempt/test_preemption.py and tests/preempt/test_preemption_tiered.py."""
