"""Doors into the frameworks users train with (Lightning, Accelerate, the Transformers Trainer).

Each module here imports its framework only when it is itself imported: ``import safepoint`` never imports
a framework, and a framework is an optional extra (``pip install safepoint[lightning]``). Import the one you
use, e.g. ``from safepoint.integrations.lightning import SafepointCallback`` (``lightning``) or
``from safepoint.integrations.lightning_pl import SafepointCallback`` (``pytorch_lightning``)."""
