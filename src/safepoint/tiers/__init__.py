"""Where saves commit and what is durable: one tier, or local-first with background uploads."""
