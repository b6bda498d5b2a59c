"""Preemption: notice sources, the agreed notice, the emergency save."""
