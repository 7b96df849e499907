"""`gapless generate`: one answer, streamed to stdout or printed as one JSON object."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from dataclasses import fields, replace
from typing import Iterator

from engine import figures
from engine.diagnosis import diagnose
from engine.errors import OptionsError
from engine.paths import output_file, user_path
from engine.recording import Recorder, save
from engine.types import GREEDY_BELOW, PRESETS, EngineOptions, Progress, SamplingParams, TextDelta, preset_options

# The options' own errors name their fields (top_p), as a request to the server or a chat file spells them; on the
# command line they name the flag that was given: the field's name with dashes, but for the KV cache's.
OPTION_FIELDS = frozenset(f.name for cls in (EngineOptions, SamplingParams) for f in fields(cls))
FLAG_OF = {"kv_cache": "--kv"}


@contextlib.contextmanager
def in_flag_words() -> Iterator[None]:
    """An OptionsError raised inside names the flag (--top-p) where it named the field (top_p)."""
    try:
        yield
    except OptionsError as exc:
        name, _, rest = str(exc).partition(" ")
        if name not in OPTION_FIELDS:
            raise
        raise OptionsError(f"{FLAG_OF.get(name, '--' + name.replace('_', '-'))} {rest}") from None


def options_from_args(args) -> EngineOptions:
    """EngineOptions from --preset (if any) overridden by the explicit flags."""
    base = EngineOptions(device=args.device)
    if args.preset:
        if args.preset not in PRESETS:
            raise OptionsError(f"unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}")
        base = preset_options(args.preset, base)
    changes = {
        "dtype": args.dtype,
        "kv_cache": args.kv,
        "sampling": args.sampling,
        "compile": args.compile,
        "cuda_graph": args.cuda_graph,
        "candidates": args.candidates,
        "profile_window": args.profile_window,
        "kernels": getattr(args, "kernels", None),
        "speculation": getattr(args, "speculation", None),
        "draft_tokens": getattr(args, "draft_tokens", None),
        "draft_model": getattr(args, "draft_model", None),
        "weights": getattr(args, "weights", None),
        "prefix_reuse": getattr(args, "prefix_reuse", None),
    }
    with in_flag_words():
        options = replace(base, **{k: v for k, v in changes.items() if v is not None}).validate()
    if changes["draft_tokens"] is not None and options.speculation == "off":  # read by nothing: refused
        raise OptionsError("--draft-tokens sets how far speculation drafts, and speculation is off: add --speculation")
    if changes["draft_model"] and options.speculation != "draft":
        raise OptionsError(
            f"--draft-model is the model --speculation draft drafts with, and speculation is {options.speculation}"
        )
    check_draft_model(options.speculation, options.draft_model)
    return options


def check_draft_model(speculation: str, draft_model: str) -> None:
    """Refuse, before any model loads, a draft speculation without a draft model or one that is not there (the
    engine would answer without speculation and say so only after the answer)."""
    if speculation == "draft" and not draft_model:
        raise OptionsError("--speculation draft needs --draft-model PATH")
    if draft_model and draft_model != "default":
        try:
            user_path(draft_model).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise OptionsError(f"--draft-model {draft_model}: no such file or folder") from None
        except OSError as exc:  # a folder on the way the user may not open, a name too long
            raise OptionsError(f"--draft-model {draft_model}: cannot read: {exc.strerror or exc}") from None


def sampling_from_args(args) -> SamplingParams:
    with in_flag_words():
        sampling = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            stop=tuple(args.stop),
        ).validate()
    # greedy (the default here, and any temperature below GREEDY_BELOW) reads none of these: refused, not ignored
    if sampling.temperature < GREEDY_BELOW:
        for flag, given in (
            ("--top-k", args.top_k != 0),
            ("--top-p", args.top_p != 1.0),
            ("--seed", args.seed is not None),
        ):
            if given:
                raise OptionsError(
                    f"{flag} is read only when sampling, and --temperature {args.temperature:g} is greedy (below "
                    f"{GREEDY_BELOW:g}; 0 is the default here): give a --temperature of {GREEDY_BELOW:g} or more, or "
                    f"leave {flag} out"
                )
    return sampling


EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl+C (SIGINT)


@contextlib.contextmanager
def ctrl_c_stops(cancel: threading.Event) -> Iterator[None]:
    """While inside: the first Ctrl+C sets `cancel`, so the answer stops at the next step and what was made is still
    printed (with --json, its figures too); a second one interrupts at once."""
    # only the main thread may take signals; a process started to ignore Ctrl+C (a script's background job) still does
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return

    def stop(_signum, _frame) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_generate(args) -> int:
    from app.engines import load_engine

    if args.raw and args.system:  # a raw prompt is sent as it is: the system prompt would be read by nothing
        raise OptionsError("--system has no place in a --raw prompt, which is sent as it is: put it in the prompt")
    options = options_from_args(args)
    sampling = sampling_from_args(args)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    stream = not args.json
    if args.telemetry_out is not None:  # refused before the model loads, not after the answer
        output_file(args.telemetry_out, "the telemetry")

    def progress(p: Progress) -> None:
        if stream and sys.stderr.isatty():
            frac = f" {p.fraction:.0%}" if p.fraction is not None else ""
            print(f"\r[{p.stage}{frac}] {p.message}\033[K", end="", file=sys.stderr, flush=True)

    engine = load_engine(args.model, options, progress)
    try:
        many = options.candidates > 1

        def on_event(event) -> None:
            if isinstance(event, Progress):
                progress(event)
            elif stream and isinstance(event, TextDelta) and (not many or event.candidate == 0):
                sys.stdout.write(event.text)
                sys.stdout.flush()

        recorder = Recorder(on_event) if args.telemetry_out is not None else None
        cancel = threading.Event()
        with ctrl_c_stops(cancel):
            result = engine.generate(messages, sampling, on_event=recorder or on_event, cancel=cancel, raw=args.raw)
        from engine.telemetry.machine import describe_machine

        machine = describe_machine()  # after the answer: the load average and threads it ran under
        if args.json:
            out = figures.finite(result.to_dict())  # NaN or infinity: null, with why (strict JSON has neither)
            out["model"] = engine.info.to_dict()
            out["machine"] = machine  # as the bench's and the telemetry's: the figures' CPU, GPU, threads, libraries
            out["diagnosis"] = diagnose(out["metrics"], out["options"], engine.info.device).to_dict()
            print(figures.strict_json(out, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            for i, text in enumerate(result.texts[1:], start=1):
                sys.stdout.write(f"\n--- candidate {i + 1} ---\n{text}\n")
            for notice in result.notices:
                print(f"note: {notice}", file=sys.stderr)
            for option, reason in result.unavailable.items():
                print(f"note: {option} unavailable: {reason}", file=sys.stderr)
        if recorder is not None:  # after the answer is out: a full disk loses the file, not the answer
            label = engine.info.name  # the HUD writes the options beside it
            save(recorder.finish(result, label, engine.info.to_dict(), machine), args.telemetry_out)
    finally:
        engine.close()
    if cancel.is_set():
        print("gapless: interrupted: the answer stopped where it was", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
