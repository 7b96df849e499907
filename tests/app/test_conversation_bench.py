"""The conversation benchmark on a tiny model: the report's shape, reuse along the turns, identical answers,
and the command line writing it as JSON."""

from __future__ import annotations

import json

from cli_runner import bench_argv, gapless

from engine.conversation_bench import ConversationConfig, format_conversation, run_conversation


def test_the_report_compares_reuse_with_none_turn_by_turn(tiny_factory):
    path = tiny_factory("llama", max_position_embeddings=4096)
    report = run_conversation(
        ConversationConfig(model=str(path), device="cpu", turns=3, max_new_tokens=8, repeats=2), progress=lambda m: None
    )
    rows = report["turns"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and report["answers_identical"] is True
    assert rows[0]["prompt_reused_tokens"] == 0
    for before, row in zip(rows, rows[1:]):
        assert row["prompt_tokens"] > before["prompt_tokens"]
        assert row["prompt_reused_tokens"] >= before["prompt_tokens"] - 1  # the whole previous turn, at least
        assert row["prompt_reused_tokens"] + row["prompt_computed_tokens"] == row["prompt_tokens"]
    for r in rows:
        assert len(r["ttft_ms_reuse_runs"]) == len(r["ttft_ms_no_reuse_runs"]) == 2
        assert r["ttft_ratio"] == r["ttft_ms_reuse_median"] / r["ttft_ms_no_reuse_median"]
    last = report["last_turn"]
    assert last["turn"] == 3 and last["target_ratio"] == 0.2
    assert last["prompt_tokens"] == rows[-1]["prompt_tokens"]
    assert last["prompt_target_met"] is (rows[-1]["prompt_tokens"] >= last["target_prompt_tokens"] == 2000)
    text = format_conversation(report)
    assert "turn 3: TTFT with reuse" in text
    assert report["turns_cut"] == [] and all(r["prompt_cut"] == "" for r in rows) and "was cut" not in text
    assert rows[-1]["prompt_tokens"] >= 2000  # this tokenizer's tokens are short: long enough to judge
    assert f"turn 3: {rows[-1]['prompt_tokens']} prompt tokens (target >= 2000: met)" in text
    assert last["target_met"] is (last["ttft_ratio"] <= 0.2) and report["unavailable"] == {}


def test_the_command_writes_json(tiny_factory, tmp_path):
    path = tiny_factory("llama", max_position_embeddings=4096)
    out = tmp_path / "conv.json"
    r = gapless(*bench_argv("--conversation", path, out, "--turns", "2"))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "conversation" and len(report["turns"]) == 2
    assert "turn 2: TTFT with reuse" in r.stdout
    # a conversation too short to judge the target on: the ratio is shown, the target not judged
    tokens = report["turns"][-1]["prompt_tokens"]
    assert tokens < 2000 and report["last_turn"]["target_met"] is None
    why = f"turn 2's prompt is {tokens} tokens, under the 2000 the ratio counts at"
    assert report["unavailable"] == {"target_met": why}
    assert f"of without (target <= 0.2×: n/a, {why}); answers identical: True" in r.stdout


def test_turns_cut_to_fit_a_short_context_are_named(tiny_factory):
    """A context too short for the conversation: the turns whose prompt was cut say so, in the JSON and the
    text, since they do not time the whole conversation."""
    path = tiny_factory("llama", max_position_embeddings=256)
    report = run_conversation(
        ConversationConfig(model=str(path), device="cpu", turns=2, max_new_tokens=4, repeats=1), progress=lambda m: None
    )
    assert report["turns_cut"] == [1, 2]
    assert all(r["prompt_cut"] for r in report["turns"]) and all(r["prompt_tokens"] <= 256 for r in report["turns"])
    assert "turns 1, 2: the prompt was cut to fit the model's context (" in format_conversation(report)
    # each turn's prompt is the same tail, nearly all reused: the ratio says nothing about a long conversation
    assert report["last_turn"]["target_met"] is None
    assert report["unavailable"]["target_met"] == "turn 2's prompt was cut to fit the model's context"


def test_times_under_a_millisecond_and_small_ratios_are_not_shown_as_zero():
    row = {
        "turn": 1,
        "prompt_tokens": 2100,
        "prompt_reused_tokens": 2090,
        "ttft_ms_reuse_median": 0.434,
        "ttft_ms_no_reuse_median": 108.6,
        "ttft_ratio": 0.004,
        "answers_identical": True,
    }
    last = {
        "turn": 1,
        "prompt_tokens": 2100,
        "ttft_ratio": 0.004,
        "target_ratio": 0.2,
        "target_met": True,
        "target_prompt_tokens": 2000,
        "prompt_target_met": True,
    }
    report = {"turns": [row], "last_turn": last, "answers_identical": True, "config": {"turns": 1}}
    lines = format_conversation(report).splitlines()
    assert lines[1].split() == ["1", "2100", "2090", "0.4", "ms", "109", "ms", "<0.01×", "yes"]
    assert lines[2] == "turn 1: TTFT with reuse <0.01× of without (target <= 0.2×: met); answers identical: True"


def test_more_turns_than_any_context_holds_are_refused_before_a_model_loads(tmp_path):
    r = gapless("bench", "--conversation", "--model", str(tmp_path / "nowhere"), "--turns", "100000000")
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == "gapless: error: --turns is at most 1,000 (each turn adds about 250 tokens), got 100,000,000"
    )


def test_a_device_this_machine_lacks_is_refused_not_measured_on_another(tiny_factory, monkeypatch):
    import pytest
    import torch

    from engine.errors import OptionsError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = ConversationConfig(model=str(tiny_factory("llama")), device="cuda", turns=1, max_new_tokens=2, repeats=1)
    with pytest.raises(OptionsError, match="--device cuda: CUDA is not available"):
        run_conversation(config, progress=lambda m: None)


def test_ctrl_c_during_a_conversation_bench_keeps_the_turns_measured_before_it(
    tiny_factory, tmp_path, monkeypatch, capsys
):
    """Ctrl+C during `gapless bench --conversation` printed no table and wrote no JSON: every turn measured was
    lost."""
    from app.cli import main
    from engine.engine import Engine

    path = tiny_factory("llama", max_position_embeddings=4096)
    real, calls = Engine.generate, []

    def ctrl_c_at_the_second_turn(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # two warm-ups, both engines' turn 1, then the engine with reuse at turn 2
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", ctrl_c_at_the_second_turn)
    out = tmp_path / "conv.json"
    argv = ["bench", "--conversation", "--model", str(path), "--device", "cpu", "--turns", "3", "--repeats", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--json", str(out)]) == 130
    stdout, err = capsys.readouterr()
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["interrupted"] is True and [p.name for p in tmp_path.iterdir()] == ["conv.json"]
    [turn] = report["turns"]
    assert turn["turn"] == 1 and len(turn["ttft_ms_reuse_runs"]) == len(turn["ttft_ms_no_reuse_runs"]) == 1
    assert turn["ttft_ms_reuse_median"] == turn["ttft_ms_reuse_runs"][0] > 0
    before = "the bench was interrupted (Ctrl+C) before its first repeat"
    assert report["not_run"] == {
        "turn 1": "the bench was interrupted (Ctrl+C) after 1 of 2 repeats: the medians are of those",
        "turn 2": before,
        "turn 3": before,
    }
    assert report["last_turn"] is None and report["unavailable"] == {"last_turn": before}
    assert report["answers_identical"] is True
    lines = stdout.splitlines()
    assert lines[1].split()[0] == "1" and f"turn 3: TTFT with reuse n/a ({before}); answers identical: True" in lines
    assert "Interrupted (Ctrl+C): the rows hold the turns measured before it." in lines and f"turn 2: {before}" in lines
    assert err.splitlines()[-1] == "gapless: interrupted: the table and JSON hold the runs measured before it"
