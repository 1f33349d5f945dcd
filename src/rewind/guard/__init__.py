"""The guard: classify an agent's command and run it with the cheapest undo that covers it."""

from rewind.guard.classify import Decision, Kind, classify

__all__ = ["Decision", "Kind", "classify"]
