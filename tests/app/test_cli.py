"""The `gapless` command line: help, version, generate --json on a tiny model, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import gapless, generate_json


def test_help_lists_the_subcommands():
    r = gapless("--help")
    assert r.returncode == 0
    for sub in ("gui", "generate", "bench", "models"):
        assert sub in r.stdout


def test_version():
    from app import __version__

    r = gapless("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gapless {__version__}"


def test_generate_json_on_a_tiny_model(tiny_llama):
    flags = "--max-new-tokens 12 --kv dynamic --sampling host --candidates 2 --seed 3 --temperature 0.7"
    out = generate_json(tiny_llama, "hello world", *flags.split())
    assert len(out["texts"]) == 2 and len(out["token_ids"]) == 2
    assert all(1 <= len(t) <= 12 for t in out["token_ids"])
    assert out["options"]["kv_cache"] == "dynamic" and out["options"]["sampling"] == "host"
    assert out["options"]["candidates"] == 2 and "unavailable" in out["options"]
    assert out["model"]["family"] == "llama" and out["model"]["source"] == str(tiny_llama.resolve())
    m = out["metrics"]
    assert m["prompt_tokens"] > 0 and m["new_tokens_total"] == sum(len(t) for t in out["token_ids"])
    assert m["ttft_ms"] > 0
    assert m["gpu_util_pct"] is None and m["unavailable"]["gpu_util_pct"]
    from engine.diagnosis import diagnose

    d = out["diagnosis"]  # what limited this answer, from the figures printed beside it
    assert d == diagnose(m, out["options"], "cpu").to_dict()
    if m["kernel_gap_pct"] is not None:
        from engine.figures import rounded

        shown = f"{rounded(m['kernel_gap_pct'], 1, top=100.0)} %"  # with the HUD's one decimal
        assert d["verdict"].startswith("CPU") and f"{shown}" in d["line"] and d["next_step"]


def _refuse_nan(constant: str) -> None:
    raise AssertionError(f"not strict JSON: {constant}")


def test_a_figure_that_is_not_finite_is_null_with_why_in_generate_json(tiny_llama, tmp_path, monkeypatch, capsys):
    """`generate --json` printed a NaN figure as NaN, which strict JSON readers refuse (the telemetry file wrote
    it as null, with no reason)."""
    from app.cli import main
    from engine.types import GenerationMetrics

    real = GenerationMetrics.to_dict

    def not_finite(self):
        d = real(self)
        d["decode_tok_s"], d["ttft_ms"] = float("nan"), float("inf")
        return d

    monkeypatch.setattr(GenerationMetrics, "to_dict", not_finite)
    telemetry = tmp_path / "t.json"
    argv = ["generate", "--model", str(tiny_llama), "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "3"]
    assert main([*argv, "--json", "--telemetry-out", str(telemetry)]) == 0
    printed = json.loads(capsys.readouterr().out, parse_constant=_refuse_nan)["metrics"]
    saved = json.loads(telemetry.read_text(encoding="utf-8"), parse_constant=_refuse_nan)["metrics"]
    for m in (printed, saved):
        assert m["decode_tok_s"] is None and m["ttft_ms"] is None
        assert m["unavailable"]["decode_tok_s"] == "came out as nan, not a finite number"
        assert m["unavailable"]["ttft_ms"] == "came out as inf, not a finite number"
        assert "decode_tok_s" not in m["sources"] and "ttft_ms" not in m["sources"]
        assert m["prefill_tok_s"] > 0 and m["sources"]["prefill_tok_s"] == "engine timing, device-synchronised"


def test_generate_json_names_the_machine_it_ran_on(tiny_llama, tmp_path):
    """The bench's JSON and the telemetry file described the machine; `generate --json` had no word of it, so its
    figures could not be told apart from another machine's or another torch's."""
    import os

    import torch

    telemetry = tmp_path / "t.json"
    out = generate_json(tiny_llama, "hello", "--max-new-tokens", "3", "--telemetry-out", str(telemetry))
    machine = out["machine"]
    assert machine["libraries"]["torch"] == torch.__version__ and machine["cpu_cores_logical"] == os.cpu_count()
    assert machine["torch_threads"] >= 1 and machine["cuda_available"] == torch.cuda.is_available()
    assert json.loads(telemetry.read_text(encoding="utf-8"))["machine"] == machine  # the same description


def test_generate_streams_text_and_matches_json(tiny_llama):
    """The prompt as the positional argument, as other command-line chat tools take it, or as --prompt."""
    args = ("generate", "--model", str(tiny_llama), "--max-new-tokens", "16", "--device", "cpu", "--temperature", "0")
    streamed = gapless(*args, "the quick brown fox")
    as_json = gapless(*args, "--prompt", "the quick brown fox", "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["texts"][0].rstrip("\n")


def test_raw_completion_skips_the_template(tiny_llama):
    out = generate_json(tiny_llama, "hello world", "--raw", "--max-new-tokens", "4", "--temperature", "0")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert out["metrics"]["prompt_tokens"] == len(tok("hello world")["input_ids"])


def test_missing_model_is_one_line(tmp_path):
    r = gapless("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "nope.gguf" in r.stderr


def test_verbose_shows_the_traceback(tmp_path):
    r = gapless("--verbose", "generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_top_level_smoke_test_means_gui_smoke_test():
    from app.cli import _gui_alias

    argv = ["--data-dir", "/d", "--smoke-test", "--report", "r.json"]
    assert _gui_alias(argv) == ["gui", *argv]
    assert _gui_alias(["gui", "--smoke-test"]) == ["gui", "--smoke-test"]
    assert _gui_alias(["generate", "--prompt", "x"]) == ["generate", "--prompt", "x"]
    assert _gui_alias(["--data-dir", "/d", "chats", "list"]) == ["--data-dir", "/d", "chats", "list"]
    assert _gui_alias(["--help"]) == ["--help"] and _gui_alias(["--version"]) == ["--version"]
    # a global option's value that reads like a command is its value, and the app's own options go to it
    assert _gui_alias(["--data-dir", "gui"]) == ["gui", "--data-dir", "gui"]
    assert _gui_alias(["--model", "x.gguf", "-v"]) == ["gui", "--model", "x.gguf", "-v"]
    assert _gui_alias(["--theme", "dark", "--model", "chats"]) == ["gui", "--theme", "dark", "--model", "chats"]


def test_a_mistyped_command_or_a_smoke_test_flag_without_it_is_said(tmp_path):
    """`gapless genrate hi` read as the app's options ("unrecognized arguments: genrate hi"); `gapless --prompt
    hi` opened the app and dropped the prompt."""
    common = ["--data-dir", str(tmp_path)]
    _one_line_error(gapless(*common, "genrate", "hi"), "invalid choice: 'genrate' (choose from 'gui', 'generate'")
    _one_line_error(gapless(*common, "--prompt", "hi"), "--prompt is for --smoke-test only")
    r = gapless(*common, "gui", "--report", "r.json", "--max-new-tokens", "5")
    _one_line_error(r, "--report, --max-new-tokens are for --smoke-test only (an answer without the window: gapless")


def test_without_a_display_the_app_says_so_instead_of_qt_aborting(tmp_path, monkeypatch, capsys):
    from app.cli import run
    from app.gui import no_display_reason

    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    assert run(["--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("gapless: error: no display to open the app on (neither DISPLAY nor")
    answers = lambda display: True  # noqa: E731  # an X server runs there
    assert no_display_reason({"DISPLAY": ":0"}, "linux", answers) == no_display_reason({}, "win32") == ""
    assert no_display_reason({"WAYLAND_DISPLAY": "wayland-0"}, "linux") == ""


def test_a_display_that_does_not_answer_is_said_instead_of_qt_aborting(tmp_path, monkeypatch, capsys):
    """A DISPLAY left from another session (":99", no X server there): Qt said xcb-cursor0 was needed (it was
    installed) and aborted the process (SIGABRT)."""
    from app.cli import run
    from app.gui import _x_answers, no_display_reason

    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    monkeypatch.setenv("DISPLAY", ":87")
    if _x_answers(":87") is not False:
        pytest.skip("libxcb cannot be loaded here, or an X server answers at :87")
    assert run(["--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("gapless: error: the display :87 does not answer (no X server")
    silent = lambda display: False  # noqa: E731
    wayland = {"DISPLAY": ":87", "WAYLAND_DISPLAY": "wayland-0"}  # Qt opens the Wayland one
    assert no_display_reason(wayland, "linux", silent) == ""
    assert no_display_reason({"DISPLAY": ":87", "QT_QPA_PLATFORM": "offscreen"}, "linux", silent) == ""
    assert no_display_reason({"DISPLAY": ":87", "QT_QPA_PLATFORM": "xcb"}, "linux", silent).startswith("the display")


def test_gapless_without_a_command_opens_the_app_with_the_gui_defaults(tmp_path, monkeypatch):
    """`gapless` alone (or with global options) is `gapless gui`: its options have their defaults."""
    import app.gui
    from app.cli import run

    seen = []
    monkeypatch.setattr(app.gui, "run_gui", lambda args, paths: seen.append((args, paths)) or 0)
    assert run(["--data-dir", str(tmp_path)]) == 0
    (args, paths), *_ = seen
    assert args.command == "gui" and args.model is None and args.smoke_test is False
    assert paths.database.is_relative_to(tmp_path)
    assert run(["--data-dir", str(tmp_path / "gui"), "--model", "x.gguf"]) == 0
    args, paths = seen[-1]
    assert args.command == "gui" and args.model == "x.gguf" and paths.database.is_relative_to(tmp_path / "gui")


@pytest.mark.parametrize("before", [True, False])
def test_global_options_are_accepted_before_or_after_the_command(tmp_path, before):
    data = tmp_path / "data"
    opts = ["--data-dir", str(data), "--verbose"]
    r = gapless(*(opts + ["models", "list"] if before else ["models", "list"] + opts))
    assert r.returncode == 0, r.stderr
    logs = list(data.rglob("gapless.log"))  # the log went under the data dir, at debug level
    assert logs, sorted(p.name for p in data.rglob("*"))
    assert "DEBUG" in logs[0].read_text(encoding="utf-8")


def test_a_global_option_given_after_the_command_wins():
    from app.cli import build_parser

    args = build_parser().parse_args(["--data-dir", "/first", "gui", "--data-dir", "/second"])
    assert args.data_dir == Path("/second")
    assert build_parser().parse_args(["--data-dir", "/first", "gui"]).data_dir == Path("/first")
    assert build_parser().parse_args(["gui"]).verbose is False


@pytest.mark.parametrize(
    "given, error",
    [
        ((), "the following arguments are required: PROMPT (or --prompt PROMPT)"),
        (("hi", "--prompt", "hello"), "the prompt is given twice: as PROMPT and as --prompt"),
    ],
)
def test_generate_wants_the_prompt_once(tmp_path, given, error):
    r = gapless("generate", "--model", str(tmp_path / "nope.gguf"), *given)
    assert r.returncode == 2 and r.stderr == f"gapless: error: {error} (see gapless generate --help)\n"


def _one_line_error(r, words: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert words in r.stderr, r.stderr


def test_output_files_are_checked_before_the_work(tmp_path):
    """A file the user asked for that cannot be written is refused at once, before a model loads or a bench runs
    (the model named here does not exist: a check after loading would say so instead)."""
    (tmp_path / "folder").mkdir()
    nowhere = str(tmp_path / "nope.gguf")
    common = ["--data-dir", str(tmp_path / "d")]
    cases = [
        (["generate", "--model", nowhere, "--telemetry-out", str(tmp_path / "folder"), "hi"], "it is a folder"),
        (["generate", "--model", nowhere, "--telemetry-out", "/dev/null", "hi"], "it is not a regular file"),
        (["generate", "--model", nowhere, "--telemetry-out", str(tmp_path / "no" / "t.json"), "hi"], "does not exist"),
        (["bench", "--model", nowhere, "--json", str(tmp_path / "folder")], "cannot write the bench's JSON"),
        (["bench", "--model", nowhere, "--speculation-workloads", "--dtypes", "fp64"], "unknown dtype 'fp64'"),
        (["bench", "--model", nowhere, "--threads", "0"], "--threads: must be at least 1"),
        (["bench", "--model", "remote:http://127.0.0.1:9/v1#m"], "a remote server decides for itself"),
        (["replay", str(tmp_path / "folder")], "cannot read the telemetry file"),
        (["replay", "t.json", "--width", "100000"], "--width: must be between 200 and 8192"),
        (["replay", "t.json", "--height", "0"], "--height: must be between 200 and 8192 pixels, got 0"),
        (["generate", "--model", nowhere, "--raw", "--system", "Be brief.", "hi"], "--system has no place in a --raw"),
        (["generate", "--model", nowhere, "--telemetry-out", str(tmp_path / ("t" * 300)), "hi"], "File name too long"),
    ]
    for argv, words in cases:
        _one_line_error(gapless(*common, *argv), words)
    assert not (tmp_path / "no").exists()  # no folder made on the way


def test_telemetry_written_through_a_link_keeps_the_link(tiny_llama, tmp_path):
    target = tmp_path / "target.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    generate_json(tiny_llama, "hello", "--max-new-tokens", "3", "--telemetry-out", str(link))
    assert link.is_symlink() and json.loads(target.read_text())["format"] == "gapless-telemetry"


def test_a_telemetry_file_the_disk_cannot_take_loses_no_answer(tiny_llama, tmp_path, monkeypatch, capsys):
    """A full disk at the save ended `generate --json` with "internal error: OSError" before the answer was printed."""
    import errno

    from app.cli import main

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("engine.paths.os.replace", full)
    target = tmp_path / "t.json"
    argv = ["generate", "--model", str(tiny_llama), "--prompt", "hello", "--max-new-tokens", "3", "--device", "cpu"]
    code = main([*argv, "--json", "--telemetry-out", str(target)])
    out, err = capsys.readouterr()
    assert code == 2 and len(json.loads(out)["token_ids"][0]) == 3  # the answer, whole
    assert f"cannot write the telemetry to {target}: No space left on device" in err
    assert "internal error" not in err and "Traceback" not in err and not target.exists()


def test_a_data_folder_that_cannot_be_one_is_one_line(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("hi")
    r = gapless("--data-dir", str(file), "chats", "list")
    _one_line_error(r, "cannot use")
    assert "unexpected error" not in r.stderr
    _one_line_error(gapless("--data-dir", "", "chats", "list"), "--data-dir: empty")


def test_a_path_of_an_unknown_user_s_home_or_a_loop_of_links_is_one_line(tmp_path):
    """ "~nosuchuser/m.gguf" (Path.expanduser raised RuntimeError) and a data or cache folder on a loop of links
    were internal errors, the latter with a whole traceback, as logging was not set up yet; a models folder of
    "~nosuchuser/models" in the settings stopped `models list` (and the app at each start)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    data = tmp_path / "data"
    r = gapless("--data-dir", str(data), "generate", "--model", "~nosuchuser/m.gguf", "hi")
    _one_line_error(r, "model not found: ~nosuchuser/m.gguf")
    r = gapless("--data-dir", str(data), "generate", "--speculation", "draft", "--draft-model", "~nosuchuser/d", "hi")
    _one_line_error(r, "--draft-model ~nosuchuser/d: no such file or folder")
    r = gapless("--data-dir", str(loop), "chats", "list")
    _one_line_error(r, f"the data folder (--data-dir, GAPLESS_DATA_DIR) '{loop}' cannot be used: ")
    r = gapless("--data-dir", str(data), "chats", "list", extra_env={"GAPLESS_CACHE_DIR": str(loop)})
    _one_line_error(r, f"GAPLESS_CACHE_DIR '{loop}' cannot be used: ")
    (data / "config").mkdir(parents=True, exist_ok=True)
    (data / "config" / "settings.json").write_text(json.dumps({"version": 1, "models_folder": "~nosuchuser/m"}))
    r = gapless("--data-dir", str(data), "models", "list")
    assert r.returncode == 0 and "the models folder is not there (a drive not plugged in?): ~nosuchuser/m" in r.stderr


def test_no_home_folder_is_said_with_what_to_set(monkeypatch):
    """HOME unset for a user the password database does not know: platformdirs' RuntimeError was an internal
    error with a traceback; it is one line saying what to set."""
    import platformdirs

    from app.paths import AppPaths
    from engine.errors import OutputPathError

    def no_home(*_a, **_k):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("GAPLESS_DATA_DIR", raising=False)
    monkeypatch.setattr(platformdirs, "user_data_dir", no_home)
    with pytest.raises(OutputPathError, match="set HOME, or GAPLESS_DATA_DIR and GAPLESS_CACHE_DIR"):
        AppPaths.resolve()


def test_chats_need_no_log_folder_nor_cache(tmp_path):
    """An unwritable cache (or logs) folder stopped `gapless chats` and the app with "cannot use ... as a folder of
    the app's", though neither keeps anything there."""
    (tmp_path / "logs").write_text("a file where the logs folder would be")
    r = gapless(
        "--data-dir", str(tmp_path), "chats", "list", extra_env={"GAPLESS_CACHE_DIR": str(tmp_path / "logs" / "cache")}
    )
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert "gapless: error" not in r.stderr and (tmp_path / "data" / "chats.sqlite3").is_file()


def test_every_figure_in_the_json_names_its_source_or_why_it_is_na(tiny_llama):
    """The project's rule for every number shown, held by the JSON of a local answer: each registered figure is a
    number whose source is under metrics.sources, or null with its reason under metrics.unavailable."""
    from engine import figures

    out = generate_json(tiny_llama, "hello world", "--max-new-tokens", "12", "--temperature", "0")
    m = out["metrics"]
    for spec in figures.GENERATION_FIGURES:
        if m[spec.key] is None:
            assert m["unavailable"].get(spec.key), f"{spec.key} is null without a reason"
        else:
            assert m["sources"].get(spec.key), f"{spec.key} = {m[spec.key]} without a source"
    assert m["unavailable"]["http_ttft_ms"] == "a local model: measured only on a remote server's answers"


def test_a_command_without_its_action_or_with_an_impossible_chat_is_one_line(tmp_path):
    data = ["--data-dir", str(tmp_path)]
    _one_line_error(gapless(*data, "models"), "choose an action: fetch-default or list")
    _one_line_error(gapless(*data, "chats"), "choose an action: list, export or import")
    _one_line_error(gapless(*data, "chats", "export", str(2**70)), f"no chat has the number {2**70}")
    _one_line_error(gapless(*data, "chats", "export", "7"), "no chat with id 7")


def test_a_command_run_with_no_output_streams_ends_well(tmp_path, monkeypatch):
    """Under pythonw (the Windows app's start) there is no stdout: the flush at the end turned every session into
    "internal error", exit 1, with a traceback in the log."""
    from app.cli import main

    monkeypatch.setattr("sys.stdout", None)
    monkeypatch.setattr("sys.stderr", None)
    assert main(["--data-dir", str(tmp_path), "chats", "list"]) == 0


def test_a_file_name_that_is_not_utf8_is_named_in_the_error_not_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    from cli_runner import ROOT

    name = os.fsdecode(b"rec\xff.json")  # as Linux hands over a name in another encoding
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "app", "replay", str(tmp_path / name)], capture_output=True, env=env, timeout=120
    )
    err = r.stderr.decode("utf-8")
    assert r.returncode == 2 and "Traceback" not in err and "internal error" not in err
    assert "cannot read the telemetry file" in err and "rec\\udcff.json" in err


def test_ctrl_c_stops_the_answer_and_prints_what_was_made(tiny_llama, monkeypatch, capsys):
    """Ctrl+C during `generate --json` printed nothing but "interrupted": the tokens made and their figures were
    lost (and with --telemetry-out, the telemetry)."""
    import os
    import signal

    from app.cli import main
    from engine.engine import Engine
    from engine.types import TextDelta

    real = Engine.generate
    deltas = []

    def ctrl_c_after_two_tokens(self, messages, sampling, on_event=None, **kwargs):
        def watch(event):
            if isinstance(event, TextDelta):
                deltas.append(event)
                if len(deltas) == 2:
                    os.kill(os.getpid(), signal.SIGINT)
            on_event(event)

        return real(self, messages, sampling, on_event=watch, **kwargs)

    monkeypatch.setattr(Engine, "generate", ctrl_c_after_two_tokens)
    monkeypatch.setattr("engine.observers.FLUSH_INTERVAL_S", 0.0)  # text at each step, however fast the machine
    argv = ["generate", "--model", str(tiny_llama), "--prompt", "hello", "--device", "cpu", "--max-new-tokens", "50"]
    # as Python sets it up at a terminal: a test run started in the background begins with Ctrl+C ignored
    started = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main([*argv, "--json"])
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, started)
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == 130 and doc["finish_reasons"] == ["cancelled"] and 2 <= len(doc["token_ids"][0]) < 50
    assert doc["metrics"]["new_tokens_total"] == len(doc["token_ids"][0])
    assert "interrupted" in err and "Traceback" not in err
    assert after is signal.default_int_handler  # Ctrl+C interrupts again after it


def test_ctrl_c_is_still_ignored_where_the_command_was_started_to_ignore_it(tiny_llama, monkeypatch, capsys):
    """A shell starts a script's background job with SIGINT ignored: Ctrl+C at the terminal must leave it running,
    as it did before Ctrl+C stopped the answer (the job's answer was cut short and it exited 130)."""
    import os
    import signal

    from app.cli import main
    from engine.engine import Engine
    from engine.types import TextDelta

    real = Engine.generate
    sent = []

    def ctrl_c_after_two_tokens(self, messages, sampling, on_event=None, **kwargs):
        def watch(event):
            if isinstance(event, TextDelta) and not sent:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGINT)
            on_event(event)

        return real(self, messages, sampling, on_event=watch, **kwargs)

    monkeypatch.setattr(Engine, "generate", ctrl_c_after_two_tokens)
    monkeypatch.setattr("engine.observers.FLUSH_INTERVAL_S", 0.0)  # the signal comes mid-answer on any machine
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        argv = ["generate", "--model", str(tiny_llama), "--prompt", "hello", "--device", "cpu", "--max-new-tokens", "8"]
        code = main([*argv, "--json"])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    doc = json.loads(capsys.readouterr().out)
    assert sent and code == 0 and doc["finish_reasons"] != ["cancelled"]


def test_a_ctrl_c_once_the_work_is_done_neither_prints_a_traceback_nor_changes_the_exit(tmp_path):
    """The interpreter's shutdown after the answer takes about a second (torch's finalizers): a Ctrl-C then
    printed a KeyboardInterrupt traceback and exited 0, or killed the process without a word."""
    import os
    import signal
    import subprocess
    import sys

    from cli_runner import ROOT

    script = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it (nohup ignores it)\n"
        f"sys.argv = ['gapless', '--data-dir', {str(tmp_path)!r}, 'chats', 'list']\n"
        "from app.cli import main\n"
        "code = main()\n"
        "os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C during the shutdown\n"
        "print('after', code)\n"
        "sys.exit(code)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert (r.returncode, r.stdout.splitlines()[-1], r.stderr) == (0, "after 0", "")
    from app.cli import main

    before = signal.getsignal(signal.SIGINT)
    assert main(["--data-dir", str(tmp_path), "chats", "list"]) == 0
    assert signal.getsignal(signal.SIGINT) is before  # main(argv), as tests call it, leaves Ctrl-C as it was


def test_standard_output_on_a_full_disk_is_one_line(tmp_path):
    """`gapless models list > /dev/full` (a full disk behind the redirect) was "internal error: OSError"."""
    import subprocess
    import sys

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "app", "--data-dir", str(tmp_path), "models", "list"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    assert r.returncode == 2 and r.stderr == "gapless: error: cannot write the output: No space left on device\n"


def test_a_cache_or_log_folder_that_cannot_be_made_is_said_as_the_app_s_other_lines(tmp_path):
    """The warnings came on stderr bare ("cannot make the cache folder ...: Not a directory"), through logging's
    last resort before logging was set up; the log file's was emitted as its handler was being replaced."""
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folders would be")
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(blocked), "XDG_STATE_HOME": str(blocked)}
    env |= {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    r = gapless("chats", "list", extra_env={**env, "GAPLESS_CACHE_DIR": "", "GAPLESS_DATA_DIR": ""})
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert any(f"cannot make the cache folder {blocked}" in line for line in lines), lines
    assert any(f"cannot write the log file {blocked}" in line for line in lines), lines
    assert all(line.startswith("gapless: ") for line in lines), lines
