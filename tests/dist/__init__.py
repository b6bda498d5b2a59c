"""torchrun plan workers for tests/dist/test_distributed.py and the helpers shared with other launchers."""
