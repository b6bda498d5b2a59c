"""torchrun plan workers for tests/test_distributed.py and the helpers shared with other launchers."""
