"""Gapless inference engine: model, decode paths, telemetry. Never imports Qt."""
