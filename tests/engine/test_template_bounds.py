"""A chat template is part of the model file, so it is bounded (engine.template_bounds): a render that loops,
recurses or asks for gigabytes ends in a clear error, in both renderers (the engine's own environment and
transformers'), and the engine, the load's probe and the thread that rendered keep working."""

from __future__ import annotations

import re
import threading
import time

import jinja2
import pytest
from tiny_models import CHATML, make_tokenizer

from engine import template_bounds
from engine.errors import GenerationError
from engine.fast_tokenizer import FastTokenizer, compile_chat_template, tokenizer_facts
from engine.prompt import build_prompt
from engine.prompt_stop import PromptStopped, stopped_by
from engine.template_bounds import TemplateBoundError, bounded_render

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
RECURSES = "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"
DOUBLES = (
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
)
HI = [{"role": "user", "content": "hi"}]


def _render(source: str, **kw):
    template = compile_chat_template(source)
    return bounded_render(lambda: template.render(messages=HI, add_generation_prompt=True), **kw)


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    tok = make_tokenizer()
    folder = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(folder))
    return tok, folder


def _tokenizers(saved_tokenizer, template: str):
    """The same template in transformers' tokenizer and in the engine's FastTokenizer."""
    tok, folder = saved_tokenizer
    ref = make_tokenizer()
    ref.chat_template = template
    facts = tokenizer_facts(ref)
    assert facts is not None
    return {"transformers": ref, "fast": FastTokenizer(folder / "tokenizer.json", facts)}


@pytest.mark.parametrize("renderer", ["transformers", "fast"])
def test_a_template_that_loops_without_end_fails_the_answer_at_the_deadline(saved_tokenizer, renderer, monkeypatch):
    monkeypatch.setattr(template_bounds.bounded_render, "__defaults__", (0.3, template_bounds.TEMPLATE_MEMORY))
    tok = _tokenizers(saved_tokenizer, LOOP)[renderer]
    with pytest.raises(GenerationError, match=r"chat template failed: it took more than 0.3 s to render"):
        build_prompt(tok, HI, 256, 8)  # 10^10 iterations: stopped, not run to its end


@pytest.mark.parametrize("renderer", ["transformers", "fast"])
def test_a_template_that_recurses_fails_the_answer_with_its_reason(saved_tokenizer, renderer):
    tok = _tokenizers(saved_tokenizer, RECURSES)[renderer]
    with pytest.raises(GenerationError, match="chat template failed: it recursed too deeply"):
        build_prompt(tok, HI, 256, 8)


@pytest.mark.parametrize("renderer", ["transformers", "fast"])
def test_a_template_raising_a_python_error_fails_the_answer_with_its_reason(saved_tokenizer, renderer):
    tok = _tokenizers(saved_tokenizer, "{{ messages[0]['content'] + 1 }}")[renderer]
    with pytest.raises(GenerationError, match="chat template failed: TypeError: "):
        build_prompt(tok, HI, 256, 8)


def test_a_template_growing_a_text_past_the_memory_bound_is_stopped():
    with pytest.raises(TemplateBoundError, match="it used more than 64 MiB of memory to render"):
        _render(DOUBLES, memory=64 << 20)


@pytest.mark.parametrize(
    "source, said",
    [
        ("{{ 'x' * 10**10 }}", "length 1 repeated 10,000,000,000 times"),
        ("{{ [1, 2] * 3000000 }}", "length 2 repeated 3,000,000 times"),
        ("{{ 10 ** 100000 }}", "10 ** 100000"),
        ("{{ 'x'|center(3000000000) }}", "width or count of 3,000,000,000"),
        ("{{ 'x'|indent(3000000000, true) }}", "width or count of 3,000,000,000"),
        ("{{ 'x'.ljust(3000000000) }}", "width or count of 3,000,000,000"),
        ("{{ '{:>3000000000}'.format(1) }}", "width or count of 3,000,000,000"),
        ("{{ '{:>{}}'.format(1, 3000000000) }}", "width or count of 3,000,000,000"),
        ("{{ '{:>{w}}'.format_map({'w': 3000000000}) }}", "width or count of 3,000,000,000"),
        ("{{ '%3000000000d' % 1 }}", "width or count of 3,000,000,000"),
        ("{{ '%*d' % (3000000000, 1) }}", "width or count of 3,000,000,000"),
        ("{{ '%3000000000d'|format(1) }}", "width or count of 3,000,000,000"),
    ],
)
def test_one_operation_asking_for_gigabytes_is_refused_before_it_runs(source, said):
    with pytest.raises(TemplateBoundError, match=re.escape(said)):
        _render(source)


def test_the_sizes_templates_use_render_as_before():
    source = (
        "{{ '=' * 20 }}|{{ 2 ** 10 }}|{{ '%05d' % 42 }}|{{ '{:>6}'.format('ab') }}|{{ 'ab'|center(6) }}|"
        "{{ 'a b c'|wordwrap(3) }}|{{ ['x'] * 3 }}|{{ 'x'|indent(2, true) }}|{{ '%s-%s'|format(1, 2) }}"
    )
    reference = jinja2.Environment().from_string(source).render()
    assert _render(source) == reference
    assert reference.startswith("=" * 20 + "|1024|00042|    ab|  ab  |")


def test_a_render_within_its_bounds_leaves_its_thread_as_it_was():
    """The watch stops only renders in progress: after a stopped one and after many that finish, the thread
    runs on without a stray exception."""
    with pytest.raises(TemplateBoundError):
        _render(LOOP, seconds=0.1)
    template = compile_chat_template(CHATML)
    for _ in range(200):
        assert bounded_render(lambda: template.render(messages=HI, add_generation_prompt=True), seconds=0.05)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # a pending exception would be raised in this loop
        sum(range(1000))


def test_renders_in_two_threads_are_each_stopped_on_their_own():
    """A looping render in one thread is stopped while another thread's renders finish untouched."""
    out: dict[str, object] = {}

    def loop():
        try:
            _render(LOOP, seconds=0.5)
        except TemplateBoundError as exc:
            out["loop"] = str(exc)

    t = threading.Thread(target=loop)
    t.start()
    template = compile_chat_template(CHATML)
    texts = {bounded_render(lambda: template.render(messages=HI, add_generation_prompt=True)) for _ in range(300)}
    t.join(30)
    assert out["loop"].startswith("it took more than 0.5 s") and len(texts) == 1


def test_the_load_probe_spends_the_bound_once(saved_tokenizer, monkeypatch):
    """The probe that decides whether the fast tokenizer stands in stops at the first render past a bound
    (each of its twelve renders would have spent the deadline)."""
    from engine import fast_tokenizer

    monkeypatch.setattr(template_bounds.bounded_render, "__defaults__", (0.2, template_bounds.TEMPLATE_MEMORY))
    stopped = []
    real = template_bounds.bounded_render

    def counted(render, *a, **kw):
        try:
            return real(render, *a, **kw)
        except TemplateBoundError:
            stopped.append(1)
            raise

    monkeypatch.setattr(template_bounds, "bounded_render", counted)
    both = _tokenizers(saved_tokenizer, LOOP)
    assert fast_tokenizer.disagreement(both["fast"], both["transformers"]) is None
    assert stopped == [1]


@pytest.mark.parametrize("renderer", ["transformers", "fast"])
def test_a_stop_ends_a_looping_render_before_its_deadline(saved_tokenizer, renderer):
    """Within stopped_by, a render stops as soon as its event is set (the user's Stop), as PromptStopped, not
    as a template error at the deadline; an event set before the render stops it before it starts."""
    tok = _tokenizers(saved_tokenizer, LOOP)[renderer]
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    with pytest.raises(PromptStopped, match="stopped while the chat template rendered"), stopped_by(cancel):
        build_prompt(tok, HI, 256, 8)
    with pytest.raises(PromptStopped, match="stopped before the chat template rendered"), stopped_by(cancel):
        build_prompt(tok, HI, 256, 8)
    fine = _tokenizers(saved_tokenizer, CHATML)[renderer]
    assert build_prompt(fine, HI, 256, 8).ids  # outside stopped_by the set event stops nothing


def test_stop_while_the_template_renders_ends_the_answer_as_stopped(tmp_path):
    """The engine's answer to a Stop during a looping template: an empty stopped answer that says so, its prompt
    figures n/a with the reason. It was the error "took more than 10 s to render" once the deadline came."""
    from tiny_models import make_tiny_model

    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    engine = Engine.load(str(make_tiny_model(tmp_path / "m", chat_template=LOOP)), EngineOptions(device="cpu"))
    try:
        cancel = threading.Event()
        threading.Timer(0.2, cancel.set).start()
        result = engine.generate(HI, SamplingParams(max_new_tokens=4), cancel=cancel)
        assert result.texts == [""] and result.finish_reasons == ["cancelled"]
        assert result.notices == ["stopped while the chat template rendered the conversation"]
        for key in ("prompt_tokens", "prompt_computed_tokens", "compile_seconds"):
            assert result.metrics.unavailable[key] == "stopped before the prompt was made"
        assert result.metrics.prompt_tokens is None
        cancel.clear()
        engine.tokenizer.chat_template = CHATML  # the engine answers the next question as before
        assert (
            engine.generate(HI, SamplingParams(max_new_tokens=2, seed=1), cancel=cancel).finish_reasons[0]
            != "cancelled"
        )
    finally:
        engine.close()


def test_a_stop_while_a_long_conversation_is_tokenized_ends_at_the_next_pass(saved_tokenizer):
    """A 4 MB paste is tokenized several times while it is fitted to the context (44 s on two cores), and a Stop
    waited for all of them; it ends the prompt at the next pass."""
    tok = _tokenizers(saved_tokenizer, CHATML)["transformers"]
    cancel = threading.Event()
    passes: list[int] = []
    real = type(tok).__call__

    def tokenize(self, text, *a, **kw):
        passes.append(len(text))
        cancel.set()  # the user pressed Stop during the first pass
        return real(self, text, *a, **kw)

    long = [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok"}, *HI]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(tok), "__call__", tokenize)
        with pytest.raises(PromptStopped, match="stopped before the conversation was tokenized"), stopped_by(cancel):
            build_prompt(tok, long, 256, 8)
        assert len(passes) == 1
        passes.clear()
        assert build_prompt(tok, long, 256, 8).ids and len(passes) > 1  # without a stop: every pass it takes
