"""A tokenizer read straight from a saved tokenizer.json with the `tokenizers` library, and its chat template
rendered with jinja2 as transformers renders it, for the cached GGUF path: importing transformers' tokenizer
classes costs seconds at every start, this costs milliseconds.

It covers what the engine asks of a tokenizer (encode, decode, the chat template without tokenizing, the
special ids, the vocabulary), nothing more. It stands in for transformers' own class only where the conversion
checked that both give the same results on a fixed probe (engine.gguf_native records the verdict in the cache);
elsewhere transformers' class is used.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

# What the probe compares: plain text, whitespace, digits, non-ASCII, and special tokens inside user text.
PROBE_TEXTS = (
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "1234567890 3.14159 e=mc^2",
    "naïve café — 日本語のテキスト 🙂",
    "def f(x):\n    return x ** 2  # code",
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them


def probe_conversations(specials: list[str]) -> list[list[dict[str, str]]]:
    """Conversations the chat template is rendered on, with and without a system message, with the model's
    special tokens typed into a user message."""
    inside = " ".join(specials[:4])
    return [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROBE_TEXTS[3]}],
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": f"and {inside} then?"},
        ],
    ]


class FastTokenizer:
    """The engine's view of a tokenizer, over `tokenizers.Tokenizer` and a sandboxed jinja2 chat template."""

    def __init__(self, tokenizer_json: Path, facts: dict[str, Any]):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))
        self.chat_template: Optional[str] = facts.get("chat_template")
        self.special_tokens_map: dict[str, str] = dict(facts.get("special_tokens_map") or {})
        self.all_special_ids: list[int] = [int(i) for i in facts.get("all_special_ids") or []]
        eos = facts.get("eos_token_id")
        self.eos_token_id: Optional[int] = int(eos) if eos is not None else None
        self._template: Any = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it): a long pasted text counted for the
        # context meter, or a server's long prompt, no longer stalls the window's thread. Same ids, same speed.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self, conversation: list[dict], add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any
    ):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        text = self._template.render(
            messages=[_plain_message(m) for m in conversation],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _plain_message(message: dict) -> dict:
    """A message as transformers hands it to the template: keys with None dropped, reasoning under its names."""
    out = {str(k): v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def compile_chat_template(source: str):
    """The template in the environment transformers compiles chat templates in: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, its tojson (no HTML escaping), raise_exception, strftime_now, and a dict and
    namespace that refuse underscore names. `{% generation %}` blocks render their body. Repeats, powers and
    widths that would make a huge value are refused before they run (engine.template_bounds)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from engine.template_bounds import checked_arguments, checked_filters, checked_operands

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class Environment(ImmutableSandboxedEnvironment):
        """transformers' environment, with the operations that make a huge value in one step checked first."""

        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            checked_operands(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            checked_arguments(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    checked_filters(env.filters)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def tokenizer_facts(tokenizer) -> Optional[dict[str, Any]]:
    """What FastTokenizer needs of transformers' tokenizer, or None where it could not stand in for it: not a
    `tokenizers`-backed class, or one that cleans up spaces when decoding."""
    if getattr(tokenizer, "backend_tokenizer", None) is None or getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return None
    template = getattr(tokenizer, "chat_template", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {
        "chat_template": template if isinstance(template, str) else None,
        "special_tokens_map": {str(k): str(v) for k, v in dict(tokenizer.special_tokens_map).items()},
        "all_special_ids": [int(i) for i in tokenizer.all_special_ids],
        "eos_token_id": int(eos) if isinstance(eos, int) else None,
    }


def disagreement(fast: FastTokenizer, reference) -> Optional[str]:
    """The first probe on which `fast` and transformers' `reference` differ, or None when they agree on all."""
    if fast.special_tokens_map != dict(reference.special_tokens_map):
        return "the special tokens"
    if fast.all_special_ids != list(reference.all_special_ids) or fast.eos_token_id != reference.eos_token_id:
        return "the special ids"
    specials = sorted(set(fast.special_tokens_map.values()))
    texts = list(PROBE_TEXTS) + [f"{s} text {s}" for s in specials]
    for text in texts:
        for add in (True, False):
            ids = fast(text, add_special_tokens=add)["input_ids"]
            if ids != list(reference(text, add_special_tokens=add)["input_ids"]):
                return f"encoding {text!r} (add_special_tokens={add})"
            for skip in (True, False):
                if fast.decode(ids, skip_special_tokens=skip) != reference.decode(ids, skip_special_tokens=skip):
                    return f"decoding {text!r} (skip_special_tokens={skip})"
    if fast.get_vocab() != reference.get_vocab():
        return "the vocabulary"
    if fast.chat_template:
        for conv in probe_conversations(specials):
            for gen in (True, False):
                mine = _rendered(fast, conv, gen)
                if mine == BOUNDED:  # it fails every answer either way: no need to spend the bound again
                    return None
                theirs = _rendered(reference, conv, gen)
                if mine != theirs:  # a refusal (e.g. of a system message) must be the same refusal
                    return f"the chat template on {len(conv)} messages (add_generation_prompt={gen})"
    return None


BOUNDED = "<TemplateBoundError>"


def _rendered(tokenizer, conv: list[dict], gen: bool) -> str:
    """The rendered conversation, or the kind of error rendering it raised (BOUNDED where it ran past a bound of
    engine.template_bounds)."""
    from engine.template_bounds import bounded_render

    try:
        return str(
            bounded_render(lambda: tokenizer.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False))
        )
    except Exception as exc:  # templates raise what they like (TemplateError, TypeError, ...)
        return f"<{type(exc).__name__}>"
