"""PyInstaller runtime hook, run before the app starts: the bundled app never asks the Hugging Face Hub for
anything. Everything it needs (the default model, tokenizer data, package metadata) is inside the bundle, and
the only download Gapless ever makes, the default model fetch, does not go through the Hub."""

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# torch.compile's parallel compile workers are started as `sys.executable <worker script>`; in the bundle that is the
# app itself, not a Python interpreter, so compiling stays in the app's own process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The Linux launcher puts the bundle's own libraries (an older libstdc++, glib, OpenSSL, ...) first on
# LD_LIBRARY_PATH for this process; programs the app starts (the compiler of the CPU kernels and torch.compile,
# xdg-open for an answer's link) would load them too and fail on a newer system. This process read it at its
# start and keeps it; what it hands on is the user's own (PyInstaller keeps it as LD_LIBRARY_PATH_ORIG).
if sys.platform.startswith("linux") and getattr(sys, "frozen", False):
    _theirs = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if _theirs is None:
        os.environ.pop("LD_LIBRARY_PATH", None)
    else:
        os.environ["LD_LIBRARY_PATH"] = _theirs
