"""Bad and unusual inputs through the engine and the `gapless generate` command line.

Text in any script reaches the tokenizer exactly as typed (only NUL characters are removed, with a notice);
an empty prompt, a prompt longer than the context and out-of-range sampling values each give a clear answer:
a notice when the answer can still come, one line on stderr and exit 2 when it cannot.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_runner import gapless, generate_json

from engine.decode import StaticRunner
from engine.engine import Engine
from engine.errors import GenerationError
from engine.stream import RowText
from engine.types import MAX_CANDIDATES, MAX_NEW_TOKENS_LIMIT, PRESETS, EngineOptions, SamplingParams, TextDelta

ROOT = Path(__file__).resolve().parents[2]
CPU = EngineOptions(device="cpu", prefix_reuse=False)  # the tests read the prompt the runner prefills whole
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, seed=0)
# Chinese, Japanese, Korean, emoji (one with a skin tone and a zero-width joiner), Hebrew and Arabic (RTL),
# with an explicit right-to-left mark between the RTL words.
WORLD = "漢字と仮名 한국어 🙂👩🏽‍💻 שלום \u200fمرحبا بالعالم end"
WITH_NUL = "abc\x00 " + WORLD.replace(" end", "\x00 end")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = Engine.load(str(tiny_llama), CPU)
    yield eng
    eng.close()


@pytest.fixture
def prefill_ids(monkeypatch) -> list[list[int]]:
    """The prompt ids each generation actually prefilled (the runner's input), recorded on the way through."""
    seen: list[list[int]] = []
    real = StaticRunner.prefill

    def recording(self, prompt, kind):
        seen.append(prompt.tolist())
        return real(self, prompt, kind)

    monkeypatch.setattr(StaticRunner, "prefill", recording)
    return seen


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gapless: error: ")
    return lines[0]


# ---- text in any script, through the engine --------------------------------------------------------------


def test_the_tokenizer_round_trips_every_script(engine):
    ids = engine.tokenizer(WORLD, add_special_tokens=False)["input_ids"]
    assert engine.tokenizer.decode(ids) == WORLD


def test_chat_prompt_reaches_the_tokenizer_intact_and_nul_is_removed(engine, prefill_ids):
    messages = [{"role": "system", "content": "Réponds en 中文 🙂"}, {"role": "user", "content": WITH_NUL}]
    cleaned = [messages[0], {"role": "user", "content": WITH_NUL.replace("\x00", "")}]
    want = template_ids(engine.tokenizer, cleaned)
    assert WORLD in engine.tokenizer.decode(want)

    result = engine.generate(messages, GREEDY)
    assert prefill_ids == [want]
    assert result.notices == ["removed 2 NUL characters from the prompt"]
    assert result.metrics.prompt_tokens == len(want)
    assert result.token_ids[0] and result.finish_reasons[0] in ("length", "eos")
    # the same prompt without the NULs: the same ids in, the same answer out, and nothing to report
    clean = engine.generate(cleaned, GREEDY)
    assert prefill_ids[-1] == want
    assert clean.notices == [] and clean.token_ids == result.token_ids and clean.texts == result.texts


def test_raw_prompt_reaches_the_tokenizer_intact(engine, prefill_ids):
    result = engine.generate([{"role": "user", "content": WITH_NUL}], GREEDY, raw=True)
    assert prefill_ids == [list(engine.tokenizer(WITH_NUL.replace("\x00", ""))["input_ids"])]
    assert result.notices == ["removed 2 NUL characters from the prompt"]
    assert result.token_ids[0]


def test_streamed_text_equals_the_decoded_tokens(engine):
    deltas: list[str] = []
    result = engine.generate(
        [{"role": "user", "content": WORLD}],
        SamplingParams(temperature=0, max_new_tokens=40),
        on_event=lambda e: deltas.append(e.text) if isinstance(e, TextDelta) else None,
    )
    ids = result.token_ids[0]
    if result.finish_reasons[0] == "eos":
        ids = ids[:-1]
    assert "".join(deltas) == result.texts[0] == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_characters_split_over_tokens_stream_whole(engine):
    """Byte-level tokens carry an emoji or a CJK character in pieces: no piece may leave as U+FFFD."""
    ids = engine.tokenizer(WORLD, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(WORLD.split()), "the tiny tokenizer should split these characters into several tokens"
    row = RowText(engine.tokenizer, set(), ())
    deltas = []
    for t in ids:
        row.feed([t])
        deltas.append(row.take_delta())
    row.finish = "length"
    deltas.append(row.take_delta(final=True))
    assert "".join(deltas) == WORLD
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("content", ["", "   ", " \t\n\u3000 ", "\x00\x00"])
def test_empty_prompt_is_refused_by_the_engine(engine, content):
    with pytest.raises(GenerationError, match="^empty prompt$"):
        engine.generate([{"role": "user", "content": content}], GREEDY)


@pytest.mark.parametrize("raw", [False, True])
def test_one_message_longer_than_the_context_keeps_its_tail(engine, prefill_ids, raw):
    words = " ".join(f"w{i}" for i in range(600))  # about 1,200 tokens against a 256-token context
    result = engine.generate([{"role": "user", "content": words}], GREEDY, raw=raw)
    assert len(prefill_ids[0]) + 12 <= engine.context_length
    cut = "kept its last" if raw else "the last message was cut to its last"
    assert any(n.startswith("prompt cut to fit the 256-token context") and cut in n for n in result.notices), (
        result.notices
    )
    assert result.token_ids[0]
    prompt_text = engine.tokenizer.decode(prefill_ids[0])
    assert "w599" in prompt_text and "w0 " not in prompt_text  # the newest words stay, the oldest go


def test_max_new_tokens_beyond_the_context_is_capped_with_a_notice(engine):
    result = engine.generate(
        [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_new_tokens=100_000)
    )
    room = engine.context_length - result.metrics.prompt_tokens
    assert f"answer limited to {room} tokens by the 256-token context" in result.notices
    assert 1 <= len(result.token_ids[0]) <= room


# ---- the same through `gapless generate` ----------------------------------------------------------------


def test_cli_any_script_prompt(tiny_llama):
    from transformers import AutoTokenizer

    out = generate_json(tiny_llama, WORLD, "--raw", "--max-new-tokens", "6", "--temperature", "0")
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert out["metrics"]["prompt_tokens"] == len(tok(WORLD)["input_ids"])
    assert out["notices"] == [] and len(out["token_ids"][0]) >= 1


def test_cli_prompt_with_nul_gets_a_notice(tiny_llama, capsys):
    """A NUL cannot travel in a process argument, so this runs the command line in this process."""
    from app.cli import main

    code = main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--prompt",
            "hello\x00 world",
            "--max-new-tokens",
            "4",
            "--device",
            "cpu",
            "--temperature",
            "0",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "note: removed 1 NUL character from the prompt" in err.splitlines()
    assert out.strip()


@pytest.mark.parametrize("prompt", ["", "   \t\n  "])
def test_cli_empty_prompt_is_one_line(tiny_llama, prompt):
    r = gapless("generate", "--model", str(tiny_llama), "--prompt", prompt, "--device", "cpu")
    assert one_error_line(r) == "gapless: error: empty prompt"
    assert r.stdout == ""


def test_cli_prompt_longer_than_the_context_still_answers(tiny_llama):
    r = gapless(
        "generate",
        "--model",
        str(tiny_llama),
        "--prompt",
        "the quick brown fox " * 200,
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--temperature",
        "0",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "the answer still comes"
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: prompt cut")]
    assert notes and "256-token context" in notes[0] and "the last message was cut to its last" in notes[0]
    assert "Traceback" not in r.stderr


def test_cli_max_new_tokens_beyond_the_context_is_capped(tiny_llama):
    out = generate_json(tiny_llama, "hello", "--max-new-tokens", "100000", "--temperature", "0")
    room = 256 - out["metrics"]["prompt_tokens"]
    assert out["notices"] == [f"answer limited to {room} tokens by the 256-token context"]
    assert 1 <= len(out["token_ids"][0]) <= room


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--max-new-tokens", str(10**9)),
            f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {10**9}",
        ),
        (("--max-new-tokens", "0"), f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got 0"),
        (("--temperature", "-1"), "--temperature must be >= 0, got -1.0"),
        (("--top-p", "1.5"), "--top-p must be in (0, 1], got 1.5"),
        (("--candidates", "0"), f"--candidates must be between 1 and {MAX_CANDIDATES}, got 0"),
        (("--candidates", "1000"), f"--candidates must be between 1 and {MAX_CANDIDATES}, got 1000"),
        (("--preset", "warp-speed"), f"unknown preset 'warp-speed'; choose from {', '.join(PRESETS)}"),
        (("--temperature", "nan"), "--temperature must be a finite number, got nan"),
        (("--temperature", "inf"), "--temperature must be a finite number, got inf"),
        (("--top-p", "nan"), "--top-p must be a finite number, got nan"),
        (("--top-p", "0"), "--top-p must be in (0, 1], got 0.0"),
        (("--repetition-penalty=-inf",), "--repetition-penalty must be a finite number, got -inf"),
        (("--repetition-penalty", "1e-39"), "--repetition-penalty must be in [0.01, 10], got 1e-39"),
        (("--top-k", "-3"), "--top-k must be an integer >= 0, got -3"),
        # a byte that is not UTF-8 (read as a lone surrogate) can never be in the answer's text
        (("--stop", "ok", "--stop", "\udcff"), "--stop string '\\udcff' holds an invalid character (a lone surrogate)"),
        (("--seed", "-1"), "--seed must be an integer in [0, 2**63), got -1"),
        (("--stop", ""), "--stop must be non-empty strings, got ''"),
        # read only when sampling: with greedy decoding they were taken and the answer was the same
        *(
            (
                (flag, value),
                f"{flag} is read only when sampling, and --temperature 0 is greedy (below 1e-05; 0 is the default "
                f"here): give a --temperature of 1e-05 or more, or leave {flag} out",
            )
            for flag, value in (("--top-k", "3"), ("--top-p", "0.5"), ("--seed", "7"))
        ),
        # a temperature the engine samples greedily at: the seed was taken and the answer did not change with it
        (
            ("--temperature", "1e-6", "--seed", "2"),
            "--seed is read only when sampling, and --temperature 1e-06 is greedy (below 1e-05; 0 is the default "
            "here): give a --temperature of 1e-05 or more, or leave --seed out",
        ),
    ],
)
def test_cli_bad_values_are_one_line(tiny_llama, args, message):
    r = gapless("generate", "--model", str(tiny_llama), "--prompt", "hi", "--device", "cpu", *args)
    assert one_error_line(r) == f"gapless: error: {message}"
    assert r.stdout == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (("--temperature", "warm"), "argument --temperature: invalid float value: 'warm'"),
        (("--max-new-tokens", "1e9"), "argument --max-new-tokens: invalid int value: '1e9'"),
        (("--candidates", "two"), "argument --candidates: invalid int value: 'two'"),
        (("--kv", "paged"), "argument --kv: invalid choice: 'paged' (choose from 'static', 'dynamic', 'none')"),
    ],
)
def test_cli_values_of_the_wrong_kind_are_one_line(args, message):
    """Refused while the arguments are read, before any model is opened."""
    r = gapless("generate", "--model", "/nonexistent", "--prompt", "hi", *args)
    assert one_error_line(r) == f"gapless: error: {message} (see gapless generate --help)"


def test_a_prompt_of_a_dash_is_read_from_standard_input(tiny_llama, tmp_path):
    """`gapless generate -` answered the one-character prompt "-"; it reads the prompt from standard input, as
    `chats import -` reads a chat, to the same tokens as the text given as an argument."""
    import json

    text = "Paris is the capital of France.\nTokens per second — kernel gap"
    (tmp_path / "prompt.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())  # a byte-order mark, as editors write
    flags = ("--model", str(tiny_llama), "--device", "cpu", "--max-new-tokens", "6", "--json")
    with open(tmp_path / "prompt.txt", "rb") as f:
        piped = gapless("generate", *flags, "-", stdin=f)
    assert piped.returncode == 0, piped.stderr
    given = generate_json(tiny_llama, text, "--max-new-tokens", "6")
    assert json.loads(piped.stdout)["token_ids"] == given["token_ids"]
    (tmp_path / "latin1.txt").write_bytes(b"\xef\xbb\xbf" + "café".encode("latin-1"))  # counted with the mark
    with open(tmp_path / "latin1.txt", "rb") as f:
        r = gapless("generate", *flags, "--prompt", "-", stdin=f)
    assert one_error_line(r) == (
        "gapless: error: the prompt on standard input is not UTF-8 text (byte 6 is 0xe9) (see gapless generate --help)"
    )
    r = gapless("generate", *flags, "-")  # nothing on standard input
    assert one_error_line(r) == ("gapless: error: the prompt on standard input is empty (see gapless generate --help)")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ("generate", "--prompt", "hi", "--speculation", "ngram", "--draft-tokens", "0"),
            "argument --draft-tokens: expected 1..15 tokens or 'auto', got '0' (see gapless generate --help)",
        ),
        (
            ("bench", "--speculation", "off"),
            "argument --speculation: invalid choice: 'off' (choose from 'ngram', 'draft') (see gapless bench --help)",
        ),
        (
            ("bench", "--presets", "candidates", "--candidates", "1"),
            "--candidates for the candidates rung must be 2 or more, got 1",
        ),
        # the flag by its name on the command line, not the option's field name (candidates, top_p)
        (("bench", "--presets", "candidates", "--candidates", "50"), "--candidates must be between 1 and 32, got 50"),
        (("serve", "--candidates", "0"), "--candidates must be between 1 and 32, got 0"),
    ],
)
def test_values_the_help_does_not_offer_are_refused_before_a_model_opens(argv, message):
    """--draft-tokens 0 was taken as 'auto' (the help says 1..15); the bench offered --speculation off, then
    refused it; --candidates 1 ran the static-KV rung again under the label "+ N candidates"."""
    r = gapless(*argv, "--model", "/nonexistent")
    assert one_error_line(r) == f"gapless: error: {message}"
