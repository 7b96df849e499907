"""Gapless widgets. Talks to app/ through signals; never reaches into engine internals."""
