"""Gapless inference engine: model, decode paths, telemetry. Never imports Qt."""

import os as _os

# Triton decides at its import whether it interprets; something (transformers, inductor) may import it before the
# fused kernels do, so the switch is set as soon as the engine is.
if _os.environ.get("GAPLESS_TRITON_INTERPRET") == "1":
    _os.environ["TRITON_INTERPRET"] = "1"
