"""Gapless application: CLI, worker thread, chat store, settings, model registry."""

__version__ = "0.1.0"
