"""`gapless bench --conversation`: time to first token along a growing conversation, prefix reuse on against off.

Two engines on the same model, one with prefix reuse and one without, answer the same scripted conversation
turn by turn (greedy, so the answers must be the same token for token; the next turn carries the answer). The
two are interleaved per turn so that both see the same machine load. Each repeat starts both from an empty
cache; the report gives each turn's median TTFT over the repeats, for each engine, and their ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from engine.bench import INTERRUPTED
from engine.figures import rounded
from engine.telemetry.machine import describe_machine, load_average
from engine.types import EngineOptions, SamplingParams

TARGET_RATIO = 0.2  # turn-10 TTFT with reuse at most this share of TTFT without
TARGET_PROMPT_TOKENS = 2000  # the last turn's prompt must be at least this long for the ratio to count
MAX_TURNS = 1000  # each turn adds ~250 tokens: far past any context; the rows are made before the first turn

# Each user turn is a request with pasted notes, as in a real working session, so the conversation grows by about
# 220 tokens a turn (prompt and template) plus the answer: past 2,000 tokens at turn 10 even with short answers.
TOPICS = [
    "the water cycle",
    "how a bicycle gear works",
    "why bread rises",
    "the phases of the moon",
    "how vaccines train the immune system",
    "what a compiler does",
    "how bees make honey",
    "why the sky is blue",
    "how a refrigerator moves heat",
    "what causes the seasons",
    "how a lock and key work",
    "why leaves change colour",
]
NOTES = (
    "Here are my notes so far, which may contain mistakes: {topic} is something people often explain with "
    "a simple picture, but the details matter. First there is a starting state, then something changes it, "
    "and finally the result feeds back into the start. Each step has a cause, a mechanism and an effect, "
    "and the effect of one step is often the cause of the next. I have read that the energy comes from "
    "outside the system, that the process repeats on its own once started, and that small changes at one "
    "step can have large effects later. I would like to understand which of these claims are true, which "
    "are half true, and what the usual misconceptions are. A friend told me that the whole thing is simpler "
    "than it looks and that the textbooks overcomplicate it, but another friend said the opposite, so I am "
    "not sure whom to believe. "
)


def user_turn(turn: int) -> str:
    topic = TOPICS[turn % len(TOPICS)]
    return (
        f"Question {turn + 1}: explain {topic} in a few sentences. "
        + NOTES.format(topic=topic)
        + "Please answer briefly and say which of my notes is wrong."
    )


@dataclass
class ConversationConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    turns: int = 10
    max_new_tokens: int = 48
    repeats: int = 3
    system: str = "You are a concise, careful tutor."


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_conversation(
    config: ConversationConfig, progress: Callable[[str], None] = print, command: Optional[list[str]] = None
) -> dict[str, Any]:
    from engine.engine import Engine

    started = time.time()
    load_at_start = load_average()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens, seed=0)
    base = EngineOptions(device=config.device, dtype=config.dtype, profile_window=False)
    engines = {
        "reuse": Engine.load(
            config.model, base.with_(prefix_reuse=True), lambda p: progress(f"{p.stage}: {p.message}")
        ),
        "no_reuse": Engine.load(config.model, base.with_(prefix_reuse=False)),
    }
    turns: list[dict[str, list]] = [
        {
            "ttft_reuse": [],
            "ttft_no_reuse": [],
            "prompt_tokens": [],
            "reused": [],
            "computed": [],
            "identical": [],
            "cut": [],
        }
        for _ in range(config.turns)
    ]
    interrupted = False
    try:
        why = engines["reuse"].unavailable().get("device")
        if why:  # the figures would be another device's under this one's name
            from engine.errors import OptionsError

            raise OptionsError(f"--device {config.device}: {why}")
        info = engines["reuse"].info.to_dict()
        try:
            for eng in engines.values():  # allocator and first-call costs stay out of the figures
                eng.generate([{"role": "user", "content": "Say hello."}], sampling)
            for rep in range(config.repeats):
                for eng in engines.values():
                    eng.forget_prefix()
                msgs: list[dict] = [{"role": "system", "content": config.system}]
                for t in range(config.turns):
                    msgs.append({"role": "user", "content": user_turn(t)})
                    a = engines["reuse"].generate(msgs, sampling)
                    b = engines["no_reuse"].generate(msgs, sampling)
                    row = turns[t]
                    row["ttft_reuse"].append(a.metrics.ttft_ms)
                    row["ttft_no_reuse"].append(b.metrics.ttft_ms)
                    row["prompt_tokens"].append(a.metrics.prompt_tokens)
                    row["reused"].append(a.metrics.prompt_reused_tokens)
                    row["computed"].append(a.metrics.prompt_computed_tokens)
                    row["identical"].append(a.token_ids == b.token_ids)
                    row["cut"].append(a.metrics.prompt_cut)
                    progress(
                        f"repeat {rep + 1}/{config.repeats} turn {t + 1}: {a.metrics.prompt_tokens} prompt tokens "
                        f"({a.metrics.prompt_reused_tokens} reused), TTFT {_ms(a.metrics.ttft_ms)} with reuse, "
                        f"{_ms(b.metrics.ttft_ms)} without"
                    )
                    msgs.append({"role": "assistant", "content": a.texts[0]})
        except KeyboardInterrupt:  # Ctrl+C: the turns measured are kept, the report says what did not run
            interrupted = True
    finally:
        for eng in engines.values():
            eng.close()
    not_run: dict[str, str] = {}
    for t, row in enumerate(turns):
        if interrupted and len(row["ttft_reuse"]) < config.repeats:
            n = len(row["ttft_reuse"])
            not_run[f"turn {t + 1}"] = (
                f"{INTERRUPTED} after {n} of {config.repeats} repeats: the medians are of those"
                if n
                else f"{INTERRUPTED} before its first repeat"
            )
    rows = []
    for t, row in enumerate(turns):
        if not row["ttft_reuse"]:  # not reached before a Ctrl+C
            continue
        with_, without = _median(row["ttft_reuse"]), _median(row["ttft_no_reuse"])
        rows.append(
            {
                "turn": t + 1,
                "prompt_tokens": row["prompt_tokens"][0],
                "prompt_reused_tokens": row["reused"][0],
                "prompt_computed_tokens": row["computed"][0],
                "ttft_ms_reuse_median": with_,
                "ttft_ms_no_reuse_median": without,
                "ttft_ms_reuse_runs": row["ttft_reuse"],
                "ttft_ms_no_reuse_runs": row["ttft_no_reuse"],
                "ttft_ratio": with_ / without if with_ is not None and without else None,
                "answers_identical": all(row["identical"]),
                # what the model's context could not hold: such a turn does not time the whole conversation
                "prompt_cut": row["cut"][0] or "",
            }
        )
    unavailable: dict[str, str] = {}
    last_turn: Optional[dict[str, Any]] = None
    if rows and rows[-1]["turn"] == config.turns:
        last = rows[-1]
        long_enough = last["prompt_tokens"] >= TARGET_PROMPT_TOKENS
        last_turn = {
            "turn": last["turn"],
            "prompt_tokens": last["prompt_tokens"],
            "ttft_ratio": last["ttft_ratio"],
            "target_ratio": TARGET_RATIO,
            "target_met": last["ttft_ratio"] is not None and last["ttft_ratio"] <= TARGET_RATIO,
            "target_prompt_tokens": TARGET_PROMPT_TOKENS,
            "prompt_target_met": long_enough,
        }
        # A short or cut prompt does not time a long conversation (a cut one is the same tail each turn, all of
        # it reused): the ratio is shown, the target is not judged on it.
        if last["prompt_cut"]:
            unavailable["target_met"] = f"turn {last['turn']}'s prompt was cut to fit the model's context"
        elif not long_enough:
            unavailable["target_met"] = (
                f"turn {last['turn']}'s prompt is {last['prompt_tokens']} tokens, under the {TARGET_PROMPT_TOKENS} "
                "the ratio counts at"
            )
        elif last["ttft_ratio"] is None:
            unavailable["target_met"] = f"turn {last['turn']} has no TTFT without reuse to compare with"
        if "target_met" in unavailable:
            last_turn["target_met"] = None
    else:
        unavailable["last_turn"] = not_run[f"turn {config.turns}"]
    if not rows:
        unavailable["answers_identical"] = f"{INTERRUPTED} before the first turn was answered"
    machine = describe_machine(load_average_at_start=load_at_start, load_average_at_end=load_average())
    return {
        "benchmark": "conversation",
        "command": command,
        "created_unix": started,
        "wall_seconds": time.time() - started,
        "config": asdict(config),
        "machine": machine,
        "model": info,
        "method": (
            "two engines on the same model, prefix reuse on and off, answer the same conversation turn by "
            "turn, interleaved; greedy; the conversation carries the reuse engine's answers; TTFT is the "
            "engine's own (prompt in -> first token on the host), median over the repeats, each repeat "
            "from an empty cache; one warm-up generation per engine first"
        ),
        "turns": rows,
        "last_turn": last_turn,
        "answers_identical": all(r["answers_identical"] for r in rows) if rows else None,
        "turns_cut": [r["turn"] for r in rows if r["prompt_cut"]],
        "unavailable": unavailable,  # why last_turn, its target_met or answers_identical is null
        # Ctrl+C: the turns measured before it; not_run: each turn not run in every repeat, and why
        "interrupted": interrupted,
        "not_run": not_run,
    }


def _ms(v: Optional[float]) -> str:
    """A TTFT: whole milliseconds, with a decimal under 10 ms (a short prompt reused reads in under one)."""
    return "n/a" if v is None else f"{rounded(v, 0 if v >= 10 else 1)} ms"


def _ratio(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{rounded(v, 2)}×"


def format_conversation(report: dict[str, Any]) -> str:
    lines = [f"{'turn':>4}  {'prompt':>6}  {'reused':>6}  {'TTFT reuse':>11}  {'TTFT without':>12}  {'ratio':>6}  same"]
    for r in report["turns"]:
        lines.append(
            f"{r['turn']:>4}  {r['prompt_tokens']:>6}  {r['prompt_reused_tokens']:>6}  "
            f"{_ms(r['ttft_ms_reuse_median']):>11}  {_ms(r['ttft_ms_no_reuse_median']):>12}  "
            f"{_ratio(r['ttft_ratio']):>6}  "
            f"{'yes' if r['answers_identical'] else 'NO'}"
        )
    last = report["last_turn"]
    unavailable = report.get("unavailable") or {}
    same = report["answers_identical"]
    same_text = f"n/a ({unavailable['answers_identical']})" if same is None else str(same)
    if last is None:
        turns = report["config"]["turns"]
        lines.append(f"turn {turns}: TTFT with reuse n/a ({unavailable['last_turn']}); answers identical: {same_text}")
    else:
        verdict = "met" if last["target_met"] else "missed"
        if last["target_met"] is None:
            verdict = f"n/a, {unavailable.get('target_met', 'not judged')}"
        lines.append(
            f"turn {last['turn']}: TTFT with reuse {_ratio(last['ttft_ratio'])} of without (target <= {last['target_ratio']}×: "
            f"{verdict}); answers identical: {same_text}"
        )
    if report.get("turns_cut"):
        lines.append(
            f"turns {', '.join(map(str, report['turns_cut']))}: the prompt was cut to fit the model's context "
            f"({report['turns'][report['turns_cut'][0] - 1]['prompt_cut']}), so they do not time the whole "
            "conversation"
        )
    if last is not None:
        length = "met" if last["prompt_target_met"] else "missed"
        lines.append(
            f"turn {last['turn']}: {last['prompt_tokens']} prompt tokens (target >= {last['target_prompt_tokens']}: "
            f"{length})"
        )
    if report.get("interrupted"):
        lines.append("Interrupted (Ctrl+C): the rows hold the turns measured before it.")
        lines.extend(f"{name}: {why}" for name, why in report["not_run"].items())
    return "\n".join(lines)
