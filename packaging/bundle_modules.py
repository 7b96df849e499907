"""Which Python modules the bundle leaves out: read by gapless.spec, and by the tests without a build.

Gapless has no terminal prompt and no text UI: the modules that exist for one (GNU readline's line editing,
curses, transformers' own command-line tools with their chat prompt) stay out, and with them the GPL-3
libreadline and the ncurses libraries they load."""

from __future__ import annotations

# Not used by Gapless; some are optional imports of torch, transformers or pyqtgraph and would pull in a lot.
EXCLUDES = [
    "tkinter", "matplotlib", "tensorboard", "torch.utils.tensorboard", "IPython", "jupyter_client", "notebook",
    "pytest", "_pytest", "pytestqt", "scipy", "pandas", "sklearn", "PIL", "cv2", "torchvision", "torchaudio",
    "onnx", "onnxruntime", "tensorflow", "keras", "jax", "flax", "sentencepiece",
    "PySide6.QtWebEngineCore", "PySide6.QtQuick", "PySide6.QtQml", "PySide6.Qt3DCore", "PySide6.QtMultimedia",
    # An interactive prompt's line editing (libreadline, GPL-3) and terminal UIs (libncursesw): pdb, code and
    # cmd import readline only where it is there, and nothing of Gapless's starts a prompt.
    "readline", "rlcompleter", "curses", "_curses", "_curses_panel",
    # transformers' command-line tools (`transformers chat`, `serve`, ...): their prompt imports readline.
    "transformers.cli", "transformers.commands",
    # Optional imports that are not the bundle's requirements (their licences are not collected): the OS keyring
    # (the bundle keeps keys in its config folder's file; pip installs take gapless[keyring]) and llama.cpp's
    # Python binding (the quality bench's comparison). Present in the build's environment, they went in.
    "keyring", "llama_cpp",
]  # fmt: skip

# transformers' packages of command-line tools: `transformers.cli` from transformers 5, `transformers.commands`
# before it.
TRANSFORMERS_TOOLS = ("transformers.cli", "transformers.commands")


def transformers_module_wanted(name: str) -> bool:
    """Whether a transformers module goes in: all of them (their model classes are imported by name at run
    time) but its command-line tools."""
    return not any(name == tools or name.startswith(tools + ".") for tools in TRANSFORMERS_TOOLS)
