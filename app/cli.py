"""`gapless`: the GUI by default, and headless subcommands for generation, benchmarks and models."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from app import __version__
from engine.types import (
    DEVICES,
    DTYPES,
    KERNELS,
    KV_MODES,
    MAX_DRAFT_TOKENS,
    PRESETS,
    SAMPLING_MODES,
    SPECULATION_MODES,
    WEIGHT_FORMATS,
)

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line on stderr like every other error of the command line (the full usage is in
    --help), so scripts can show it as it is."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"gapless: error: {message} (see {self.prog} --help)\n")


def _draft_tokens(value: str) -> int:
    """'auto' is 0, the adaptive draft length; a number is 1..MAX_DRAFT_TOKENS (0 was taken as 'auto')."""
    if value == "auto":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {value!r}") from None
    if not 1 <= n <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_DRAFT_TOKENS} tokens or 'auto', got {value!r}")
    return n


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _folder(value: str) -> Path:
    if not value.strip():
        raise argparse.ArgumentTypeError("empty: name a folder")
    return Path(value)


def _chat_id(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a chat's number (gapless chats list), got {value!r}") from None
    if not -(2**63) <= n < 2**63:  # what the chat store can hold: any other number names no chat
        raise argparse.ArgumentTypeError(f"no chat has the number {n}")
    return n


MIN_PX, MAX_PX = 200, 8192  # a window size that Qt lays out and paints, and whose screenshot fits in memory


def _pixels(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if not MIN_PX <= n <= MAX_PX:
        raise argparse.ArgumentTypeError(f"must be between {MIN_PX} and {MAX_PX} pixels, got {n}")
    return n


def _add_speculation_options(p: argparse.ArgumentParser, modes: tuple[str, ...] = SPECULATION_MODES) -> None:
    p.add_argument(
        "--speculation",
        choices=modes,
        default=None,
        help="speculative decoding: drafts from the prompt and answer (ngram) or a smaller model (draft)",
    )
    p.add_argument(
        "--draft-tokens",
        type=_draft_tokens,
        default=None,
        metavar="K",
        help="drafts verified per step, 1..15, or 'auto' (adaptive, the default)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="the draft model for --speculation draft (a GGUF file or a folder, same tokenizer)",
    )


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a GGUF file, or a Hugging Face folder")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--kv", choices=KV_MODES, default=None, help="KV cache mode")
    p.add_argument("--sampling", choices=SAMPLING_MODES, default=None)
    _switch(p, "--compile", None)
    _switch(p, "--cuda-graph", None)
    p.add_argument("--candidates", type=int, default=None)
    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="decode step kernels: torch modules, or fused Triton kernels (implies the static KV cache)",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="weight format of the linears: native (the dtype), int8 per channel, int4 in groups",
    )
    p.add_argument(
        "--preset",
        default=None,
        help=f"start from a preset ({', '.join(PRESETS)})",
    )
    _add_speculation_options(p)
    _switch(p, "--profile-window", None, "trace a short window of decode steps for the kernel/op gap (default on)")
    _switch(
        p,
        "--prefix-reuse",
        None,
        "keep the KV cache between generations and compute only past the common prefix (default on)",
    )


def _switch(p: argparse.ArgumentParser, flag: str, default: Optional[bool], help: Optional[str] = None) -> None:
    """--flag and --no-flag: on, off, or `default` when neither is given."""
    p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="gapless",
        description="Chat with local language models and see where the GPU's time goes.",
    )
    parser.add_argument("--version", action="version", version=f"gapless {__version__}")
    _add_global_options(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gui = sub.add_parser("gui", help="open the desktop app (the default)")
    gui.add_argument("--model", default=None, help="model to open at start ('default', a GGUF file or a folder)")
    gui.add_argument(
        "--smoke-test", action="store_true", help="open offscreen, load the model, answer one prompt, exit"
    )
    gui.add_argument(
        "--screenshot",
        type=Path,
        default=None,
        help="with --smoke-test: save the main window as PNG (folder must exist)",
    )
    gui.add_argument(
        "--report", type=Path, default=None, help="with --smoke-test: write a JSON report (folder must exist)"
    )
    gui.add_argument(
        "--prompt", default=None, help=f"with --smoke-test: the prompt to send (default: {SMOKE_PROMPT!r})"
    )
    gui.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help=f"with --smoke-test: answer length (default: {SMOKE_TOKENS})",
    )
    gui.add_argument("--theme", choices=["system", "light", "dark"], default=None)
    gui.set_defaults(subparser=gui)  # its errors name `gapless gui`

    gen = sub.add_parser("generate", help="generate an answer headless (streams text, or --json)")
    _add_engine_options(gen)
    gen.add_argument(
        "text",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt (or --prompt PROMPT); - reads it from standard input",
    )
    gen.add_argument(
        "--prompt",
        default=None,
        help="the prompt as an option (--prompt=TEXT for one that starts with a dash; - reads standard input)",
    )
    gen.set_defaults(subparser=gen)  # its errors name `gapless generate`
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="the longest answer (default: %(default)s)")
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy, the default here, as is any below 1e-5 (the app's new chats sample at 0.7)",
    )
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1 discourages repeats (default: 1.0)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument(
        "--telemetry-out",
        type=Path,
        default=None,
        help="also save the generation's telemetry (steps, samples, figures) here, for `gapless replay`",
    )

    bench = sub.add_parser("bench", help="run the optimization ladder and the transformers baseline")
    bench.add_argument("--model", default="default")
    bench.add_argument("--device", choices=DEVICES, default="auto")
    bench.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per answer (default: 128; with --quality 64, at most)"
    )
    bench.add_argument("--repeats", type=int, default=3, help="timed answers per rung (default: %(default)s)")
    bench.add_argument("--presets", default=None, help="comma-separated preset names (default: the whole ladder)")
    bench.add_argument("--candidates", type=int, default=None, help="N for the candidates rung")
    bench.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="kernels of the candidates rung (fused: the fused Triton kernels in a CUDA graph)",
    )
    _switch(bench, "--baseline", True, "also time transformers generate() on the same model")
    _switch(
        bench,
        "--compile",
        None,
        "include the compiled rungs (default: on with CUDA, off on CPU where a cold compile takes minutes)",
    )
    bench.add_argument("--prompt", default=None, help="the prompt (a fixed one by default)")
    bench.set_defaults(subparser=bench, given=frozenset())  # its errors name `gapless bench`
    modes = bench.add_mutually_exclusive_group()  # the ladder when none is given
    modes.add_argument(
        "--conversation",
        action="store_true",
        help="instead of the ladder: TTFT along a growing conversation, prefix reuse on against off",
    )
    bench.add_argument("--turns", type=int, default=10, help="with --conversation: the conversation's turns")
    _switch(
        bench,
        "--prefix-reuse",
        None,
        "let a timed run reuse the prompt's KV cache a run before it left (default off: every run reads the "
        "whole prompt, so TTFT compares rungs)",
    )
    bench.add_argument("--json", type=Path, default=None, help="write the results here")
    modes.add_argument(
        "--quality",
        action="store_true",
        help="instead of the ladder: perplexity, top-1 agreement with fp32 and decode tok/s per weight "
        "format (fp32, bf16, int8, int4) on a fixed text",
    )
    # the bench's speculation rung and workloads draft one way or the other: "off" was offered, then refused
    _add_speculation_options(bench, tuple(m for m in SPECULATION_MODES if m != "off"))
    modes.add_argument(
        "--speculation-workloads",
        action="store_true",
        help="instead of the ladder: decode speed with and without speculation on rewrite, summary "
        "and free-chat prompts",
    )
    bench.add_argument(
        "--dtypes",
        default=None,
        help="with --speculation-workloads: comma-separated dtypes (default fp32 on the CPU, fp16 on CUDA)",
    )
    bench.add_argument("--cuda-graph", action="store_true", help="with --speculation-workloads: capture the steps")
    bench.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch intra-op threads for the bench (at most the logical cores)",
    )
    _note_given(bench)  # a flag of another kind of bench is refused even at its default value

    replay = sub.add_parser("replay", help="show a saved telemetry file (generate --telemetry-out) in the HUD")
    replay.add_argument("file", type=Path)
    replay.add_argument("--screenshot", type=Path, default=None, help="save the HUD as PNG and exit")
    replay.add_argument("--width", type=_pixels, default=520, help=f"the HUD's width in pixels ({MIN_PX}-{MAX_PX})")
    replay.add_argument("--height", type=_pixels, default=860, help=f"its height in pixels ({MIN_PX}-{MAX_PX})")
    replay.add_argument("--theme", choices=["system", "light", "dark"], default=None)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the model (until Ctrl+C)")
    _add_engine_options(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (other than loopback needs --api-key or GAPLESS_SERVE_API_KEY)",
    )
    serve.add_argument("--port", type=int, default=8080, help="(default: %(default)s)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (or set GAPLESS_SERVE_API_KEY, which other users of "
        "this machine cannot read in the process list)",
    )
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    serve.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait for the engine; 503 past it (default: %(default)s)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body accepted")
    serve.add_argument(
        "--cors-origin", action="append", default=[], help="allow browser requests from ORIGIN (repeatable)"
    )

    models = sub.add_parser("models", help="the default model and known models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION")
    models.set_defaults(subparser=models)
    msub.add_parser("fetch-default", help="download the default model (if needed) and print its path")
    msub.add_parser("list", help="list the default, recent and scanned models")

    chats = sub.add_parser("chats", help="list, export and import chats")
    csub = chats.add_subparsers(dest="chats_command", metavar="ACTION")
    chats.set_defaults(subparser=chats)
    csub.add_parser("list", help="id, last change, message count and title of every chat")
    export = csub.add_parser("export", help="a chat with all its branches and figures, as JSON (or --markdown)")
    export.add_argument("chat_id", type=_chat_id)
    export.add_argument("-o", "--output", type=Path, default=None, help="write here (default: standard output)")
    export.add_argument("--markdown", action="store_true", help="Markdown for reading instead of JSON")
    imp = csub.add_parser("import", help="add a chat exported as JSON (validated whole; a bad file changes nothing)")
    imp.add_argument("path", type=Path, help="the chat file, or - for standard input")
    _global_options_after_the_command(parser)
    return parser


def _add_global_options(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if default is None else default,
        help="debug logging to stderr; tracebacks on errors",
    )
    p.add_argument("--data-dir", type=_folder, default=default, help="keep chats, settings and logs under this folder")


def _global_options_after_the_command(parser: argparse.ArgumentParser) -> None:
    """`gapless gui --data-dir DIR` as well as `gapless --data-dir DIR gui`: every subcommand (and its actions)
    takes the global options too. Their default there is SUPPRESS, so a value given before the command stands
    unless it is given again after it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_global_options(sub, argparse.SUPPRESS)
                _global_options_after_the_command(sub)


def _quiet_and_offline() -> None:
    """Nothing but the explicit default-model fetch reaches the network; libraries draw no progress bars of
    their own on stderr (the app reports progress itself)."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TQDM_DISABLE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


SUBCOMMANDS = ("gui", "generate", "bench", "serve", "replay", "models", "chats")
SMOKE_PROMPT = "What is the capital of France? Answer in one sentence."


def _prompt_from_stdin(parser: argparse.ArgumentParser) -> str:
    """The prompt as standard input gives it, UTF-8 (a byte-order mark dropped); an argparse error where it is not
    text or there is none."""
    if sys.stdin is None:
        parser.error("PROMPT - reads the prompt from standard input, and there is none")
    data = sys.stdin.buffer.read()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start  # counted in what was read, the mark included
        parser.error(f"the prompt on standard input is not UTF-8 text (byte {at} is {data[at]:#04x})")
    if not text.strip():
        parser.error("the prompt on standard input is empty")
    return text


SMOKE_TOKENS = 48
SMOKE_ONLY = ("prompt", "report", "screenshot", "max_new_tokens")  # the desktop app's flags for --smoke-test
# the desktop app's options that take the next word as their value (`gapless --model x.gguf` is the app)
GUI_VALUE_OPTIONS = ("--model", "--screenshot", "--report", "--prompt", "--max-new-tokens", "--theme")


GLOBAL_VALUE_OPTIONS = ("--data-dir",)  # global options that take the next word as their value


def _gui_alias(argv: list[str]) -> list[str]:
    """`gapless [options]` without a command is the desktop app, `gapless gui [options]` (every command takes
    the global options after it too): `gapless --data-dir D`, `gapless --model x.gguf`, and `gapless --smoke-test
    ...` as the installed bundle is checked. The command is the first word that is neither an option nor a
    global option's value, so `gapless --data-dir gui` is the app with its data in ./gui."""
    if any(a in ("-h", "--help", "--version") for a in argv):
        return argv
    words = iter(argv)
    for word in words:
        if word in GLOBAL_VALUE_OPTIONS or word in GUI_VALUE_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return argv  # a command, or a mistyped one, which the parser names with the commands there are
    return ["gui", *argv]


def run(argv: Optional[Sequence[str]] = None) -> int:
    _quiet_and_offline()
    parser = build_parser()
    args = parser.parse_args(_gui_alias(list(sys.argv[1:] if argv is None else argv)))
    from app.logs import early_logging, setup_logging
    from app.paths import AppPaths

    early_logging()
    paths = AppPaths.resolve(args.data_dir)
    setup_logging(paths.log_file, args.verbose)
    import app.engines

    app.engines.keys_dir = paths.config  # a remote model's saved key is the data folder's (--data-dir)
    try:
        return _command(parser, args, paths)
    finally:
        app.engines.keys_dir = None


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace, paths) -> int:
    command = args.command or "gui"
    log.debug("gapless %s: %s", __version__, command)
    if command == "gui":
        from app.gui import run_gui

        if not args.smoke_test:
            given = [f"--{name.replace('_', '-')}" for name in SMOKE_ONLY if getattr(args, name) is not None]
            if given:
                args.subparser.error(
                    f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --smoke-test only (an answer "
                    "without the window: gapless generate)"
                )
        args.prompt = SMOKE_PROMPT if args.prompt is None else args.prompt
        args.max_new_tokens = SMOKE_TOKENS if args.max_new_tokens is None else args.max_new_tokens
        return run_gui(args, paths)
    if command == "generate":
        from app.cmd_generate import run_generate

        if args.text is not None and args.prompt is not None:
            args.subparser.error("the prompt is given twice: as PROMPT and as --prompt")
        args.prompt = args.prompt if args.prompt is not None else args.text
        if args.prompt is None:
            args.subparser.error("the following arguments are required: PROMPT (or --prompt PROMPT)")
        if args.prompt == "-":  # `cat notes.txt | gapless generate -` (the one-character prompt "-" was answered)
            args.prompt = _prompt_from_stdin(args.subparser)
        return run_generate(args)
    if command == "bench":
        from app.cmd_bench import run_bench

        return run_bench(args)
    if command == "replay":
        from app.replay import run_replay

        return run_replay(args)
    if command == "serve":
        from app.cmd_serve import run_serve

        return run_serve(args)
    if command == "models":
        from app.cmd_models import run_models

        if not args.models_command:
            args.subparser.error("choose an action: fetch-default or list")
        return run_models(args, paths)
    if command == "chats":
        from app.cmd_chats import run_chats

        if not args.chats_command:
            args.subparser.error("choose an action: list, export or import")
        return run_chats(args, paths)
    parser.error(f"unknown command {command!r}")
    return EXIT_USER_ERROR


EXIT_BROKEN_PIPE = 141  # as a shell reports a command ended by SIGPIPE


def _utf8_output() -> None:
    """What goes to a file or a pipe (JSON, a chat's export, lists) is UTF-8 whatever the locale's code page says
    (Windows' cp1252 could not write a check mark, and wrote "Café" in bytes our own import refuses); a terminal
    keeps its encoding, writing what it cannot show as "?" rather than failing."""
    for stream in (sys.stdout, sys.stderr):
        # absent where a test or an embedder swapped the stream, or where there is none (pythonw)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None:
            continue
        try:
            if stream.isatty():
                reconfigure(errors="replace")
            else:  # a name that is not UTF-8 on disk (surrogate escapes) is written escaped, not a crash
                reconfigure(encoding="utf-8", errors="backslashreplace")
        except (OSError, ValueError):  # a closed or detached stream: left as it is
            pass


def _stdout_is_a_pipe() -> bool:
    import stat

    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


NO_ROOM_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name)
)  # a full disk, a quota, a file past its largest size


def _quiet_stdout() -> None:
    """After the reader of stdout went away: what Python would still flush at exit goes nowhere, not into a second
    BrokenPipeError on stderr."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _note_given(parser: argparse.ArgumentParser) -> None:
    """Each option of `parser` given on the command line is named in `args.given`, a value equal to its default
    too (told apart by value, `--turns 10` with --quality was taken as left out)."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            cls = type(action)
            if cls not in _GIVEN_CLASSES:
                _GIVEN_CLASSES[cls] = _given_class(cls)
            action.__class__ = _GIVEN_CLASSES[cls]


_GIVEN_CLASSES: dict[type, type] = {}  # an argparse action's class -> the same, noting that its option was given


def _given_class(cls: type) -> type:
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: N807
        namespace.given = (getattr(namespace, "given", None) or frozenset()) | {self.dest}
        cls.__call__(self, parser, namespace, values, option_string)

    return type(f"Given{cls.__name__}", (cls,), {"__call__": __call__})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: user errors become one line on stderr and a non-zero exit (a traceback with --verbose).
    Run as the program (no `argv`), a Ctrl-C once the work is done is ignored: the interpreter's shutdown (about
    a second of torch's finalizers) printed a KeyboardInterrupt traceback and exited 0, or died silently."""
    code = _main(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to change
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _main(argv: list[str]) -> int:
    from engine.errors import GaplessError

    verbose = "-v" in argv or "--verbose" in argv
    _utf8_output()
    try:
        code = run(argv)
        if sys.stdout is not None:  # None under pythonw (the Windows app's start): nothing to flush
            sys.stdout.flush()  # here, not at exit: a short output is written now, and a closed pipe is seen below
        return code
    except BrokenPipeError:
        if not _stdout_is_a_pipe():  # a socket's or a child's: an internal error like any other
            log.exception("unexpected error")
            print("gapless: internal error: BrokenPipeError (run with --verbose for details)", file=sys.stderr)
            return EXIT_INTERNAL_ERROR
        _quiet_stdout()  # `gapless ... | head`: the reader has all it wanted
        return EXIT_BROKEN_PIPE
    except GaplessError as exc:
        if verbose:
            log.exception("error")
        print(f"gapless: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("gapless: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in NO_ROOM_ERRNOS:
            return _internal_error(exc)
        # the output (stdout sent to a full disk: `chats export 1 > /dev/full`), or a file no handler knew of
        if verbose:
            log.exception("error")
        where = f" to {exc.filename}" if exc.filename else " the output"
        print(f"gapless: error: cannot write{where}: {exc.strerror or exc}", file=sys.stderr)
        _quiet_stdout()  # what is left in its buffer would fail again at exit
        return EXIT_USER_ERROR
    except Exception as exc:
        return _internal_error(exc)


def _internal_error(exc: BaseException) -> int:
    """An unexpected failure: logged whole (on stderr too with --verbose), and said in one line."""
    log.exception("unexpected error")
    print(f"gapless: internal error: {type(exc).__name__}: {exc} (run with --verbose for details)", file=sys.stderr)
    return EXIT_INTERNAL_ERROR


def gui_main() -> int:
    return main(["gui", *sys.argv[1:]])
