"""discover -> verify -> read -> apply: the restore pipeline."""
