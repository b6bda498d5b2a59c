"""The ``safepoint`` command line: its commands and the tools behind them."""
