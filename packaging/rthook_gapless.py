"""PyInstaller runtime hook, run before the app starts: the bundled app never asks the Hugging Face Hub for
anything. Everything it needs (the default model, tokenizer data, package metadata) is inside the bundle, and
the only download Gapless ever makes, the default model fetch, does not go through the Hub."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# torch.compile's parallel compile workers are started as `sys.executable <worker script>`; in the bundle that is the
# app itself, not a Python interpreter, so compiling stays in the app's own process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
