"""`gapless bench`: the optimization ladder and the transformers baseline, as a table and as JSON."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from app.cmd_generate import EXIT_INTERRUPTED, check_draft_model, in_flag_words
from engine import figures
from engine.errors import OptionsError, OutputPathError
from engine.ladder import DEFAULT_PROMPT, BenchConfig
from engine.paths import output_file, write_whole
from engine.types import DTYPES, MAX_NEW_TOKENS_LIMIT, PRESETS, EngineOptions, describe_options, is_remote

NA = "n/a"


# The flags each kind of bench reads besides --model, --device, --max-new-tokens, --repeats, --json and --threads;
# one given to a kind that does not read it is refused, not ignored.
MODE_FLAGS: dict[str, tuple[str, ...]] = {
    "ladder": (
        "presets",
        "candidates",
        "kernels",
        "baseline",
        "compile",
        "prompt",
        "prefix_reuse",
        "speculation",
        "draft_tokens",
        "draft_model",
    ),
    "conversation": ("turns",),
    "quality": (),
    "speculation_workloads": ("compile", "speculation", "draft_tokens", "draft_model", "dtypes", "cuda_graph"),
}
QUALITY_DECODE_TOKENS = 64  # the quality bench's decode runs, at most: its figure of interest is the perplexity
BENCH_TOKENS = 128  # every other kind's answers
# The comma-separated flags: what each item names, and what an empty flag is refused with (it ran the default
# before, as if left out).
LIST_FLAGS = {
    "presets": ("preset", "no preset to run (leave the flag out to run them all)"),
    "dtypes": ("dtype", "no dtype to run (leave the flag out for the default: fp32 on the CPU, fp16 on CUDA)"),
}
# The ladder's flags that only one rung reads.
RUNG_FLAGS = {"candidates": ("candidates", "kernels"), "speculation": ("speculation", "draft_tokens", "draft_model")}


def bench_mode(args: argparse.Namespace) -> str:
    return next((m for m in MODE_FLAGS if m != "ladder" and getattr(args, m, False)), "ladder")


def _kind(mode: str) -> str:
    return "the ladder" if mode == "ladder" else f"--{mode.replace('_', '-')}"


def list_flag(args: argparse.Namespace, flag: str) -> Optional[tuple[str, ...]]:
    """The items of the comma-separated flag `flag` in the order given, None where it was left out. The same rule
    for every list flag: an empty flag, an empty item or an item given twice is refused (an empty item was
    dropped, and a dtype given twice ran twice)."""
    given = getattr(args, flag, None)
    if given is None:
        return None
    noun, empty = LIST_FLAGS[flag]
    items = tuple(item.strip() for item in given.split(","))
    name = f"--{flag.replace('_', '-')}"
    if not any(items):  # "" is not "the default": refused
        raise OptionsError(f"{name}: {empty}")
    if "" in items:
        raise OptionsError(f"{name}: {given!r} has an empty item; name each {noun} once, between commas")
    twice = next((item for i, item in enumerate(items) if item in items[:i]), None)
    if twice is not None:
        raise OptionsError(f"{name}: {noun} {twice} is given twice; name each {noun} once")
    return items


def check_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen kind of bench would not read (argparse already refuses two kinds at once), and
    counts no bench can run with, before any model loads."""
    mode = bench_mode(args)
    if args.max_new_tokens is None:  # each kind's own default; one the user gave is kept or refused, never changed
        args.max_new_tokens = QUALITY_DECODE_TOKENS if mode == "quality" else BENCH_TOKENS
    parser = getattr(args, "subparser", None)
    given = getattr(args, "given", None)  # the flags on the command line (app.cli), else told by their values
    for flag in sorted({f for flags in MODE_FLAGS.values() for f in flags} - set(MODE_FLAGS[mode])):
        if (
            flag in given
            if given is not None
            else parser is not None and getattr(args, flag) != parser.get_default(flag)
        ):
            readers = " and ".join(_kind(m) for m, flags in MODE_FLAGS.items() if flag in flags)
            raise OptionsError(f"--{flag.replace('_', '-')} is for {readers}, not {_kind(mode)}")
    if getattr(args, "draft_model", None) and getattr(args, "speculation", None) != "draft":
        raise OptionsError(
            "--draft-model is the model --speculation draft drafts with; give --speculation draft too "
            f"(the speculation runs {getattr(args, 'speculation', None) or 'ngram'} without it)"
        )
    for flag in LIST_FLAGS:
        list_flag(args, flag)
    chosen = list_flag(args, "presets")
    if mode == "ladder" and chosen:  # a flag of a rung left out would change nothing that runs
        for rung, flags in RUNG_FLAGS.items():
            given = [f for f in flags if getattr(args, f, None) is not None]
            if given and rung not in chosen:
                raise OptionsError(f"--{given[0].replace('_', '-')} is for the {rung} rung, which --presets leaves out")
    if getattr(args, "device", None) == "cuda":  # every figure would be skipped, or another device's
        import torch

        if not torch.cuda.is_available():
            raise OptionsError("--device cuda: CUDA is not available on this machine")
    least = 1 if mode == "conversation" else 2  # a decode figure needs a second token; a TTFT only the first
    if args.repeats < 1 or args.max_new_tokens < least:
        raise OptionsError(
            f"--repeats must be at least 1 and --max-new-tokens at least {least}, got {args.repeats} and "
            f"{args.max_new_tokens}"
        )
    # what every answer of the bench is then refused with, after the model loaded (the ladder printed a table of
    # failed rungs and exited 1)
    if args.max_new_tokens > MAX_NEW_TOKENS_LIMIT:
        raise OptionsError(f"--max-new-tokens is at most {MAX_NEW_TOKENS_LIMIT}, got {args.max_new_tokens}")
    with in_flag_words():
        if getattr(args, "draft_tokens", None) is not None:
            EngineOptions(speculation="ngram", draft_tokens=args.draft_tokens).validate()
        if getattr(args, "candidates", None) is not None:
            EngineOptions(candidates=args.candidates).validate()
    cores = os.cpu_count()
    threads = getattr(args, "threads", None)
    if threads is not None and cores is not None and threads > cores:  # 100000 crashed the process in torch
        raise OptionsError(
            f"--threads is at most this machine's {cores} logical cores (more threads only wait for each other), "
            f"got {threads}"
        )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The bench's flags that were given, by their BenchConfig names; the rest keep BenchConfig's defaults."""
    if getattr(args, "draft_model", None):
        check_draft_model("draft", args.draft_model)
    given = {f.name: getattr(args, f.name, None) for f in fields(BenchConfig)}
    presets = list_flag(args, "presets") or tuple(PRESETS)
    given.update(presets=presets, prompt=args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    return BenchConfig(**{k: v for k, v in given.items() if v is not None})


def _num(v: Optional[float], digits: int = 1, top: Optional[float] = None) -> str:
    """A table cell: never rounded to 0, nor under `top` (100 for a share) to `top` (figures.rounded)."""
    return NA if v is None else figures.rounded(v, digits, top)


def _tok_s(m: dict[str, Any]) -> str:
    """Median, and the range over the repeats when there was more than one distinct figure."""
    v, lo, hi = m.get("decode_tok_s"), m.get("decode_tok_s_min"), m.get("decode_tok_s_max")
    if v is None:
        return NA
    if lo is None or hi is None or lo == hi:
        return f"{v:.1f}"
    return f"{v:.1f} ({lo:.1f}–{hi:.1f})"


def _times(v: Optional[float]) -> str:
    return NA if v is None else f"{v:.2f}×"


def _bytes(v: Optional[float]) -> str:
    if v is None:
        return NA
    return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.0f} MiB"


def options_text(o: Optional[dict[str, Any]]) -> str:
    return describe_options(o, sep=", ")


def _by_rung(texts: Iterable[tuple[str, Optional[str]]]) -> dict[str, list[str]]:
    """Each text the rungs give (a source, a reason), with the labels of the rungs that give it, from (label, text)."""
    found: dict[str, list[str]] = {}
    for label, text in texts:
        if text:
            found.setdefault(text, []).append(label)
    return found


def _per_rung(found: dict[str, list[str]]) -> str:
    return "; ".join(f"{', '.join(labels)}: {text}" for text, labels in found.items())


def _partial_notes(label: str, median: dict[str, Any], notes: list[str]) -> str:
    """Adds a note for each figure of `median` measured in some of its runs only (their median); the marks of the
    notes, for the row's options cell."""
    marks = ""
    for key, text in (median.get("partial") or {}).items():
        name = figures.BY_KEY[key].label if key in figures.BY_KEY else key
        notes.append(f"{label}: {name} {text}")
        marks += f" ({len(notes)})"
    return marks


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table of the rungs and baselines, with notes that name every figure's source."""
    rungs, baselines = report["rungs"], report["baselines"]
    compiled = any(b["name"] == "transformers-static-compile" and b["status"] == "ok" for b in baselines)
    head = ["rung", "options", "tokens", "decode tok/s (range)", "× Naive", "× transformers"]
    if compiled:
        head.append("× transformers compiled")
    head += [
        "TTFT ms",
        "gap %",
        "launches/step",
        "SM activity %",
        "GPU util %",
        "peak memory",
        "tok/step",
        "accepted %",
    ]
    rows: list[list[str]] = []
    notes: list[str] = []
    for r in rungs:
        label = r["label"]
        if r["status"] != "ok":
            notes.append(f"{label}: {r['status']}: {r['reason']}")
            rows.append([label, f"{r['status']} ({len(notes)})"] + [""] * (len(head) - 2))
            continue
        m = r["median"]
        opts = options_text({**r["options"], "prefix_reuse": True})  # the same for every rung: said below
        for note in r.get("notes") or []:
            notes.append(f"{label}: {note}")
            opts += f" ({len(notes)})"
        opts += _partial_notes(label, m, notes)
        row = [
            label,
            opts,
            _num(m.get("new_tokens_total"), 0),
            _tok_s(m),
            _times(r.get("speedup_vs_naive")),
            _times(r.get("speedup_vs_transformers")),
        ]
        if compiled:
            row.append(_times(r.get("speedup_vs_transformers_compiled")))
        rate = m.get("acceptance_rate")
        row += [
            _num(m.get("ttft_ms")),
            _num(m.get("kernel_gap_pct"), top=100.0),
            _num(m.get("launches_per_step"), 0),
            _num(m.get("sm_activity_pct"), top=100.0),
            _num(m.get("gpu_util_pct"), top=100.0),
            _bytes(m.get("peak_memory_bytes")),
            _num(m.get("tokens_per_step"), 2),
            _num(None if rate is None else 100 * rate, top=100.0),
        ]
        rows.append(row)
    naive = report["ratios"].get("naive_decode_tok_s")
    for b in baselines:
        if b["status"] != "ok":
            notes.append(f"{b['label']}: {b['status']}: {b['reason']}")
            rows.append([b["label"], f"{b['status']} ({len(notes)})"] + [""] * (len(head) - 2))
            continue
        m, s = b["median"], b["settings"]
        tok_s = m.get("decode_tok_s")
        settings = f"{s['dtype']}, {s['cache_implementation']} cache"
        if b.get("reason"):  # ran, but not every timed run (a Ctrl+C)
            notes.append(f"{b['label']}: {b['reason']}")
            settings += f" ({len(notes)})"
        settings += _partial_notes(b["label"], m, notes)
        row = [
            b["label"],
            settings,
            _num(m.get("new_tokens_total"), 0),
            _tok_s(m),
            _times(None if tok_s is None or not naive else tok_s / naive),
            "1.00×" if b["name"] == "transformers" else "",
        ]
        if compiled:
            row.append("1.00×" if b["name"] == "transformers-static-compile" else "")
        row += [
            _num(m.get("ttft_ms")),
            NA,
            NA,
            _num(m.get("sm_activity_pct"), top=100.0),
            _num(m.get("gpu_util_pct"), top=100.0),
            _bytes(m.get("peak_memory_bytes")),
            NA,
            NA,
        ]
        rows.append(row)

    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)]

    everything = rungs + baselines
    cfg = report["config"]
    out.append("")
    out.append(
        f"Model {report['model']['name']} ({report['model']['parameters'] / 1e6:.1f}M parameters) on "
        f"{report['device']}; {cfg['max_new_tokens']} new tokens, greedy, median of {figures.counted(cfg['repeats'], 'run')} "
        f"after {figures.counted(cfg['warmup'], 'warm-up')}."
    )
    if report.get("interrupted"):
        out.append("Interrupted (Ctrl+C): the rows hold the runs measured before it; the notes say what did not run.")
    machine = report.get("machine") or {}
    if machine:
        start, end = machine.get("load_average_at_start"), machine.get("load_average_1_5_15min")
        load = f"; load average (1 min) {start[0]:.1f} at the start, {end[0]:.1f} at the end" if start and end else ""
        out.append(  # the load only where the OS tells it (not on Windows)
            f"Machine: {machine.get('cpu_model') or 'unknown CPU'}, {machine.get('cpu_cores_logical')} logical "
            f"cores, {machine.get('gpu_name') or 'no GPU'}{load}."
        )
    out.append(report["dtype_note"] + ".")
    out.append("decode tok/s, TTFT: " + report["method"] + ".")
    reused = [
        f"{r['label']} {_num(r['median'].get('prompt_reused_tokens'), 0)} of {_num(r['median'].get('prompt_tokens'), 0)}"
        for r in rungs
        if r.get("median") and r["median"].get("prompt_reused_tokens")
    ]
    if reused:  # a TTFT that read the prompt from the cache is not a prefill's
        out.append(
            "TTFT with the prompt's cache reused (--prefix-reuse; median prompt tokens reused): "
            + ", ".join(reused)
            + "."
        )
    elif not cfg.get("prefix_reuse"):
        out.append("Prefix reuse off in every rung: each timed run reads the whole prompt.")
    # Each machine-dependent figure of the table, with the source its rungs named or why it is n/a.
    out.append(f"tok/step: {figures.spec('tokens_per_step').source} (above 1 only where drafts were accepted).")
    sources = [
        (figures.spec(k).label, k, figures.source_field_of(k))
        for k in (
            "kernel_gap_pct",
            "launches_per_step",
            "sm_activity_pct",
            "gpu_util_pct",
            "peak_memory_bytes",
            "acceptance_rate",
        )
    ]
    medians = [(r["label"], r.get("median") or {}) for r in everything]
    for name, metric, source in sources:
        said = _by_rung((label, m.get(source)) for label, m in medians)  # each source, with the rungs that named it
        whys = _by_rung((label, m.get("unavailable", {}).get(metric)) for label, m in medians)
        if said:  # one source, or several: measured differently in different rungs (eager, inside a CUDA graph)
            text = next(iter(said)) if len(said) == 1 else _per_rung(said)
            # the rows where it is n/a all the same (an answer that ended before the traced window), each with why
            out.append(f"{name}: {text}" + (f"; n/a in {_per_rung(whys)}." if whys else "."))
        elif len(whys) > 1:
            out.append(f"{name}: n/a: {_per_rung(whys)}.")
        else:
            out.append(f"{name}: n/a" + (f" ({next(iter(whys))})." if whys else "."))
    unavailable = report["ratios"].get("unavailable") or {}  # why a base of the speed-ups is missing (add_ratios)
    columns = [("× Naive", "naive_decode_tok_s"), ("× transformers", "transformers_decode_tok_s")]
    if compiled:
        columns.append(("× transformers compiled", "transformers_static_compile_decode_tok_s"))
    for title, key in columns:
        if unavailable.get(key):
            out.append(f"{title}: n/a ({unavailable[key]}).")
    warm = [f"{r['label']} {sum(r['warmup_seconds']):.1f}" for r in everything if r.get("warmup_seconds")]
    if warm:
        out.append(
            "Warm-up seconds, not timed (compile and graph capture happen there; a warm compile cache "
            "shortens them): " + ", ".join(warm) + "."
        )
    match = report.get("greedy_match_naive_vs_transformers")
    if match:
        out.append(
            f"Greedy tokens, Naive vs transformers: the first {match['matching_prefix']} of "
            f"{match['naive_tokens']} / {match['transformers_tokens']} agree."
        )
    for i, note in enumerate(notes, 1):
        out.append(f"({i}) {note}")
    return "\n".join(out)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Written whole or not at all; a file system that refuses it (a full disk) is an OutputPathError."""
    text = figures.strict_json(report, indent=1, ensure_ascii=False) + "\n"
    try:
        write_whole(output_file(path, "the bench's JSON"), text)
    except OSError as exc:
        raise OutputPathError(f"cannot write the bench's JSON to {path}: {exc.strerror or exc}") from exc


def spec_config_from_args(args: argparse.Namespace):
    from engine.bench_spec import SpecBenchConfig

    dtypes = list_flag(args, "dtypes") or ()
    wrong = [d for d in dtypes if d not in DTYPES]
    if wrong:
        raise OptionsError(f"--dtypes: unknown dtype {wrong[0]!r}; choose from {', '.join(DTYPES)}")
    check_draft_model(args.speculation or "ngram", args.draft_model or "")
    return SpecBenchConfig(
        model=args.model,
        device=args.device,
        dtypes=dtypes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        speculation=args.speculation or "ngram",
        draft_tokens=args.draft_tokens or 0,
        draft_model=args.draft_model or "",
        compile=bool(args.compile),
        cuda_graph=args.cuda_graph,
        threads=args.threads,
    )


def run_conversation_bench(args: argparse.Namespace) -> int:
    from engine.conversation_bench import MAX_TURNS, ConversationConfig, format_conversation, run_conversation

    if args.turns < 1 or args.repeats < 1:
        raise OptionsError("--turns and --repeats must be at least 1")
    if args.turns > MAX_TURNS:
        raise OptionsError(f"--turns is at most {MAX_TURNS:,} (each turn adds about 250 tokens), got {args.turns:,}")
    config = ConversationConfig(
        model=args.model, device=args.device, turns=args.turns, max_new_tokens=args.max_new_tokens, repeats=args.repeats
    )
    return _exit_code(_report(args, run_conversation, config, format_conversation))


def run_bench(args: argparse.Namespace) -> int:
    if is_remote(args.model):
        raise OptionsError(
            "bench times this machine's engine under its own options, which a remote server decides for itself; "
            "a remote model's figures come with each answer (gapless generate --model remote:... --json)"
        )
    check_flags(args)
    if args.json is not None:  # refused before the bench runs, not after it
        output_file(args.json, "the bench's JSON")
    # the speculation bench's options checked before any model loads
    spec = spec_config_from_args(args) if getattr(args, "speculation_workloads", False) else None
    if getattr(args, "threads", None):  # every kind of bench runs on the threads it was given
        import torch

        torch.set_num_threads(args.threads)
    if getattr(args, "conversation", False):
        return run_conversation_bench(args)
    from engine.bench import run_suite

    if getattr(args, "quality", False):
        return run_quality_bench(args)
    if spec is not None:
        from engine.bench_spec import format_workloads, run_speculation_workloads

        return _exit_code(_report(args, run_speculation_workloads, spec, format_workloads))
    report = _report(args, run_suite, config_from_args(args), format_table)
    if report.get("interrupted"):
        return _exit_code(report)
    if not any(r["status"] == "ok" for r in report["rungs"]):  # a script must not read the table as a measurement
        print("gapless: error: no rung ran (each one's reason is in the table above)", file=sys.stderr)
        return 1
    return 0


def _exit_code(report: dict[str, Any]) -> int:
    """0, or after a Ctrl+C (every kind of bench keeps what it measured) EXIT_INTERRUPTED, saying so."""
    if not report.get("interrupted"):
        return 0
    print("gapless: interrupted: the table and JSON hold the runs measured before it", file=sys.stderr)
    return EXIT_INTERRUPTED


def run_quality_bench(args: argparse.Namespace) -> int:
    from engine.quality import QualityConfig, format_quality_table, run_quality

    tokens = args.max_new_tokens
    if tokens > QUALITY_DECODE_TOKENS:
        raise OptionsError(f"with --quality, --max-new-tokens is at most {QUALITY_DECODE_TOKENS}, got {tokens}")
    config = QualityConfig(model=args.model, device=args.device, decode_tokens=tokens, repeats=args.repeats)
    return _exit_code(_report(args, run_quality, config, format_quality_table))


def _report(args: argparse.Namespace, run: Callable[..., Any], config: Any, table: Callable[[Any], str]) -> Any:
    """Run one benchmark with its progress on stderr, print its table, and write its JSON where --json says; the
    report."""
    report = run(config, progress=lambda msg: print(msg, file=sys.stderr, flush=True), command=list(sys.argv))
    report = figures.finite(report)  # the table as the JSON: a figure that came out NaN is n/a with why
    unwritten: Optional[OutputPathError] = None
    if args.json is not None:  # first: a closed pipe on stdout (| head) must not lose what the run measured
        try:
            write_json(args.json, report)
        except OutputPathError as exc:  # a full disk: the table still shows what the run measured
            unwritten = exc
    print(table(report))
    if unwritten is not None:
        raise unwritten
    if args.json is not None:
        print(f"\nwritten: {args.json}")
    return report
