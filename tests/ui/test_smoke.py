"""`gapless gui --smoke-test` on the real default model, as a user (or the installer's check) runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import figures

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen"}
    env.pop("GAPLESS_DATA_DIR", None)  # --data-dir decides
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "--data-dir",
            str(tmp_path / "data"),
            "gui",
            "--smoke-test",
            "--screenshot",
            str(tmp_path / "shot.png"),
            "--report",
            str(tmp_path / "report.json"),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )


@pytest.mark.slow
def test_smoke_test_answers_on_the_default_model(tmp_path, default_model_path):
    proc = run_smoke(tmp_path, "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # a slot run on a window being deleted
    report = json.loads((tmp_path / "report.json").read_text())

    assert report["model"]["source_kind"] == "default"
    assert report["answer"].strip()
    assert "Paris" in report["answer"]  # the fixed prompt asks for the capital of France; greedy-ish, seed 0
    assert report["messages_in_store"] == 2 and report["messages_in_chat"] == 2
    metrics = report["metrics"]
    assert 0 < metrics["new_tokens_total"] <= 24
    assert f"{metrics['new_tokens_total']} tokens" in report["stats_line"]
    tok_s = metrics["decode_tok_s"]
    assert (f"{figures.rounded(tok_s, 1)} tok/s" if tok_s is not None else "n/a tok/s") in report["stats_line"]
    assert report["options"]["device"] in ("cpu", "cuda")
    lengths = report["hud"]["series_lengths"]
    assert lengths and sum(lengths.values()) > 0
    last = report["hud"]["last_values"]
    assert any(last.get(name) is not None for name, n in lengths.items() if n > 0)
    shot = tmp_path / "shot.png"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The data dir given on the command line holds the chat, nothing else was touched.
    from app.store import ChatStore

    with ChatStore(tmp_path / "data" / "data" / "chats.sqlite3") as store:
        chats = store.list_chats()
        assert len(chats) == 1
        assert [m.role for m in store.thread(chats[0].id)] == ["user", "assistant"]
        assert store.thread(chats[0].id)[1].content == report["answer"]


def test_smoke_test_fails_with_a_message_on_a_bad_model(tmp_path):
    bad = tmp_path / "empty-model"
    bad.mkdir()
    proc = run_smoke(tmp_path, "--model", str(bad))
    assert proc.returncode == 2  # what the user gave, as every command exits on bad input
    assert "smoke test failed: cannot load" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "report.json").exists()


def test_smoke_test_refuses_a_report_it_could_not_write_before_loading_the_model(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen"}
    report = tmp_path / "no-such-folder" / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "app", "--data-dir", str(tmp_path / "data"), "gui", "--smoke-test"]
        + ["--model", str(tmp_path / "not-loaded"), "--report", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"smoke test failed: cannot write the report to {report}: the folder" in proc.stderr
    assert "cannot load" not in proc.stderr and not report.parent.exists()


def test_a_smoke_answer_length_no_answer_can_have_is_refused_before_the_window_opens(tmp_path):
    """--max-new-tokens 0 opened the window and loaded the model, then failed the answer with exit 1."""
    proc = run_smoke(tmp_path, "--model", str(tmp_path / "never-loaded"), "--max-new-tokens", "0")
    assert proc.returncode == 2 and "argument --max-new-tokens: must be at least 1, got 0" in proc.stderr
    assert "cannot load" not in proc.stderr


def test_a_smoke_screenshot_or_report_the_disk_cannot_take_says_why_and_leaves_the_earlier_file(
    qtbot, tmp_path, monkeypatch, capsys
):
    """Qt wrote the smoke test's screenshot straight to the name given: a disk that filled on the way left the
    earlier image truncated, said as "cannot save the screenshot to <path>" with no reason; a report the disk
    could not take was an internal error, its OSError naming no file."""
    from types import SimpleNamespace

    from full_disk import fill_the_disk
    from PySide6.QtWidgets import QLabel

    from app.smoke import SmokeFailed, SmokeTest

    window = QLabel("the answer")
    qtbot.addWidget(window)
    window.resize(320, 200)
    shot, report = tmp_path / "shot.png", tmp_path / "report.json"
    shot.write_bytes(b"the earlier image\n")
    report.write_text("the earlier report\n")
    args = SimpleNamespace(screenshot=str(shot), report=str(report))
    smoke = SmokeTest(None, SimpleNamespace(window=window), args)
    with monkeypatch.context() as m:
        fill_the_disk(m)
        with pytest.raises(SmokeFailed) as caught:
            smoke._screenshot()
        assert str(caught.value) == f"cannot write the screenshot to {shot}: No space left on device"
        m.setattr(SmokeTest, "_run", lambda self, t0: {"ok": True, "answer": "Paris", "seconds": {}})
        assert smoke.run() == 1
    said = capsys.readouterr()
    assert said.err == f"gapless: smoke test failed: cannot write the report to {report}: No space left on device\n"
    assert said.out == ""
    assert shot.read_bytes() == b"the earlier image\n" and report.read_text() == "the earlier report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "shot.png"]

    assert smoke._screenshot() == shot  # written whole, as the window shows
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
