"""Doors into the frameworks people train with. Each module imports its framework, so nothing here is
imported by ``import safepoint``: import the one you use, e.g.
``from safepoint.integrations.lightning import SafepointCallback`` (``lightning``) or
``from safepoint.integrations.lightning_pl import SafepointCallback`` (``pytorch_lightning``)."""
