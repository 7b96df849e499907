"""Telemetry files (engine/recording.py): a generation's events and figures saved and read back exactly, and
every kind of bad file refused with where and why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.recording import FORMAT, VERSION, Recorder, RecordingError, load, save
from engine.types import EngineOptions, MonitorSample, SamplingParams, StepRecord

CPU = EngineOptions(device="cpu", cuda_graph=True)  # a CUDA graph on a CPU: refused, and the reason recorded


@pytest.fixture(scope="module")
def recorded(tiny_llama, tmp_path_factory):
    eng = Engine.load(str(tiny_llama), CPU)
    try:
        seen = []
        rec = Recorder(seen.append)
        result = eng.generate(
            [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_new_tokens=12), on_event=rec
        )
        # samples as the monitor passes them on (a 12-token answer may end before its first): the generation's
        # first says why the monitor leaves series empty, the next does not repeat it
        cpu = {"cpu_util_pct": "CPU util — process CPU time"}
        # 190 %: a process on two cores (the monitor counts every core)
        rec(MonitorSample(t=result_t(seen), cpu_util_pct=190.0, sources=cpu, unavailable={"power_w": "no GPU here"}))
        rec(MonitorSample(t=result_t(seen) + 0.1, cpu_util_pct=95.0, sources=cpu))
        recording = rec.finish(result, "tiny", eng.info.to_dict(), {"cpu_model": "test"})
    finally:
        eng.close()
    path = tmp_path_factory.mktemp("rec") / "t.json"
    save(recording, path)
    return recording, path, seen, result


def test_the_recorder_passes_every_event_on_and_keeps_steps_and_samples(recorded):
    recording, _, seen, result = recorded
    assert recording.steps == [e for e in seen if isinstance(e, StepRecord)] and recording.steps
    assert recording.samples == [e for e in seen if isinstance(e, MonitorSample)]
    assert recording.metrics == result.metrics and recording.options == result.options
    assert recording.unavailable == result.unavailable and "cuda_graph" in recording.unavailable
    assert recording.t_start <= recording.steps[0].t <= recording.steps[-1].t <= recording.t_end


def test_a_sample_s_reasons_are_written_where_it_has_any(recorded):
    recording, path, _, _ = recorded
    saved = _doc(path)["samples"]
    told = [s["unavailable"] for s in saved if "unavailable" in s]
    assert told == [s.unavailable for s in recording.samples if s.unavailable] and len(saved) == len(recording.samples)
    assert {"power_w": "no GPU here"} in told and any("unavailable" not in s for s in saved)


def test_a_saved_recording_reads_back_equal(recorded):
    recording, path, _, _ = recorded
    back = load(path)
    assert back.steps == recording.steps and back.samples == recording.samples
    assert back.metrics == recording.metrics and back.options == recording.options
    assert (back.label, back.model, back.machine) == (recording.label, recording.model, recording.machine)
    assert back.metrics.figure("kernel_gap_pct") == recording.metrics.figure("kernel_gap_pct")
    assert back.unavailable == recording.unavailable
    assert back.limits == recording.limits == recorded[3].limits and ("cuda_graph", True) in back.limits


def test_a_recording_saved_again_with_a_byte_order_mark_reads_back_equal(recorded, tmp_path):
    """An editor that saves UTF-8 with a BOM (Notepad) made the file "not a telemetry file"."""
    recording, path, _, _ = recorded
    again = tmp_path / "bom.json"
    again.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    back = load(again)
    assert back.steps == recording.steps and back.samples == recording.samples


def test_a_recording_with_surrogate_pairs_escaped_reads_back_equal(recorded, tmp_path):
    """An emoji written as a pair of \\u escapes (json.dumps' default) is valid text, not a lone surrogate."""
    _, path, _, _ = recorded
    again = tmp_path / "ascii.json"
    again.write_text(json.dumps(dict(_doc(path), label="answer \U0001f600")), encoding="utf-8")
    assert "\\ud83d\\ude00" in again.read_text(encoding="utf-8")
    assert load(again).label == "answer \U0001f600"


def test_a_recording_from_before_the_refusals_were_kept_reads_with_none(recorded, tmp_path):
    _, path, _, _ = recorded
    doc = _doc(path)
    del doc["unavailable"], doc["limits"]
    (tmp_path / "old.json").write_text(json.dumps(doc), encoding="utf-8")
    old = load(tmp_path / "old.json")
    assert old.unavailable == {} and old.limits == {}


def test_figures_that_are_not_finite_are_written_as_na(recorded, tmp_path):
    recording, _, _, _ = recorded
    recording.metrics.decode_tok_s = math.nan
    try:
        save(recording, tmp_path / "nan.json")
    finally:
        recording.metrics.decode_tok_s = load(recorded[1]).metrics.decode_tok_s
    assert json.loads((tmp_path / "nan.json").read_text())["metrics"]["decode_tok_s"] is None
    assert load(tmp_path / "nan.json").metrics.decode_tok_s is None


def result_t(seen) -> float:
    return max(e.t for e in seen if isinstance(e, StepRecord))


def _doc(path):
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: "[1, 2", "not valid JSON"),
        (lambda d: {"hello": 1}, "not a Gapless telemetry file"),
        (lambda d: dict(d, version=VERSION + 1), f"telemetry version {VERSION + 1}"),
        (lambda d: {k: v for k, v in d.items() if k != "metrics"}, '"metrics" is missing'),
        (lambda d: dict(d, steps={"0": 1}), '"steps" is dict, not list'),
        (lambda d: dict(d, options=dict(d["options"], dtype="fp8")), "options: dtype must be one of"),
        (
            lambda d: dict(d, metrics=dict(d["metrics"], ttft_ms="fast")),
            'metrics: its figure ttft_ms is "fast", not a number',
        ),
        (lambda d: dict(d, steps=[dict(d["steps"][0], t=None)]), "steps[0]: t is None"),
        (lambda d: dict(d, samples=[{"t": 1.0, "sources": {"gpu": 3}}]), "samples[0]: sources"),
        (lambda d: dict(d, unavailable={"compile": 3}), "unavailable is not a map of option names to reasons"),
        (lambda d: dict(d, limits=[{"option": "compile"}]), "limits: limits[0] is not an object of option, value"),
        (lambda d: "[" * 100000 + "]" * 100000, "nested too deep"),
        (lambda d: dict(d, version=True), "telemetry version True"),
        (lambda d: dict(d, metrics=dict(d["metrics"], kernel_gap_source=42)), "kernel_gap_source is not text"),
        (lambda d: dict(d, metrics=dict(d["metrics"], decode_tok_s=-5)), "decode_tok_s is -5, not a count or a time"),
        (lambda d: dict(d, metrics=dict(d["metrics"], kernel_gap_pct=1e300)), "more than all of it"),
        (lambda d: dict(d, metrics=dict(d["metrics"], acceptance_rate=5.0)), "acceptance_rate is 5.0, more than all"),
        (lambda d: dict(d, steps=[dict(d["steps"][0], step_ms=-3.0)]), "steps[0]: step_ms is -3.0, not a count"),
        (lambda d: dict(d, samples=[{"t": 1.0, "cpu_util_pct": -1}]), "samples[0]: cpu_util_pct is -1.0, not a"),
        (lambda d: dict(d, samples=[{"t": 1.0, "gpu_util_pct": 101}]), "samples[0]: gpu_util_pct is 101.0, more than"),
        (lambda d: dict(d, version=1.0), "telemetry version 1.0"),
        (lambda d: dict(d, machine=dict(d["machine"], gpus=["H200"])), 'machine "gpus" is not a list of objects'),
        # a damaged step record replayed absurd rates: -522 tok/s, or every step "traced" from "false"
        (lambda d: dict(d, steps=[dict(d["steps"][0], tokens_total=-500)]), "steps[0]: tokens_total is -500, not a"),
        (lambda d: dict(d, steps=[dict(d["steps"][0], tokens_total=3.9)]), "steps[0]: tokens_total is 3.9, not a"),
        (lambda d: dict(d, steps=[dict(d["steps"][0], step=-7)]), "steps[0]: step is -7, not a count"),
        (lambda d: dict(d, steps=[dict(d["steps"][0], profiled="false")]), 'profiled is "false", not true or false'),
        (lambda d: dict(d, steps=d["steps"][1::-1]), "steps[1] goes back in t"),
        (lambda d: dict(d, metrics=dict(d["metrics"], new_tokens=[-4, 46])), "new_tokens is not a list of whole"),
        # numbers past a float's range ended the command with "internal error: OverflowError" / "ValueError"
        (lambda d: dict(d, t_start=10**400), "t_start is too large a number"),
        (lambda d: dict(d, steps=[dict(d["steps"][0], t=10**400)]), "steps[0]: t is too large a number"),
        (lambda d: dict(d, metrics=dict(d["metrics"], ttft_ms=10**400)), "ttft_ms"),
        (lambda d: dict(d, samples=[{"t": 1.0, "cpu_util_pct": 10**400}]), "cpu_util_pct"),
        (lambda d: json.dumps(d).replace('"t_start": ', '"t_start": ' + "9" * 5000 + " + 0 * ", 1), "not valid JSON"),
        # times from no clock of one answer replayed blank plots, and the plots' export failed on an infinite range
        (lambda d: dict(d, steps=[dict(d["steps"][0], t=1e308)]), "steps[0] is at t = 1e+308, outside the answer"),
        (lambda d: dict(d, t_start=-1e308), "one answer's recording spans at most 7 days"),
        (lambda d: dict(d, t_end=d["t_start"] - 1), "is before t_start"),
        (lambda d: dict(d, samples=[{"t": d["t_start"] + 1}, {"t": d["t_start"]}]), "samples[1] goes back in t"),
        # lone surrogates read, and then the compare table's CSV export failed on them
        (lambda d: dict(d, label="a\udcffb"), "bad.json: label is text that is not valid Unicode (a lone surrogate)"),
        (lambda d: dict(d, machine=dict(d["machine"], gpus=[{"name": "\ud800"}])), "machine.gpus[0].name is text"),
        (lambda d: dict(d, unavailable={"\udfff": "x"}), "the key 'unavailable.\\udfff' is text that is not valid"),
    ],
)
def test_bad_files_are_refused_with_where_and_why(recorded, tmp_path, change, words):
    _, path, _, _ = recorded
    bad = change(_doc(path))
    target = tmp_path / "bad.json"
    target.write_text(bad if isinstance(bad, str) else json.dumps(bad), encoding="utf-8")
    with pytest.raises(RecordingError) as info:
        load(target)
    assert words in str(info.value)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(RecordingError, match="cannot read the telemetry file"):
        load(tmp_path / "none.json")


def test_a_write_that_fails_leaves_no_partial_file(recorded, tmp_path, monkeypatch):
    recording, _, _, _ = recorded
    target = tmp_path / "out.json"
    target.write_text('{"format": "%s", "kept": true}' % FORMAT, encoding="utf-8")

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("engine.paths.os.replace", broken)
    with pytest.raises(RecordingError, match=f"cannot write the telemetry to {target}: disk full"):
        save(recording, target)
    assert json.loads(target.read_text())["kept"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """A FIFO as the recording waited forever; /dev/zero grew until the memory ran out."""
    import os

    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    with pytest.raises(RecordingError, match="it is not a regular file"):
        load(path)
