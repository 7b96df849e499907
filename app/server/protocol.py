"""The OpenAI wire format: request bodies checked field by field into a `Request`, results into response objects.

Every refusal is an `ApiError` carrying the HTTP status and OpenAI's error object ({"error": {message, type,
param, code}}), so a client library raises its usual exception with a message that names the field.
"""

from __future__ import annotations

import difflib
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from engine import figures
from engine.types import (
    MAX_CANDIDATES,
    MAX_NEW_TOKENS_LIMIT,
    REPETITION_PENALTY_MIN,
    TOP_K_LIMIT,
    GenerationMetrics,
    GenerationResult,
)

MAX_STOP_STRINGS = 16
SERVED_FIGURES = ("ttft_ms", "decode_tok_s", "kernel_gap_pct")
# The engine's finish reasons as OpenAI's API names them; a remote model's (served through this server) are its
# server's: held back by its content filter, or another of its own (passed on as the end of the answer).
FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "cancelled": "stop",
    "filtered": "content_filter",
    "server": "stop",
}
# Fields whose meaning this server cannot honour: refused rather than silently ignored.
UNSUPPORTED = {
    "tools": "tool calls are not supported",
    "functions": "function calls are not supported",
    "logprobs": "logprobs are not supported",
    "top_logprobs": "logprobs are not supported",
    "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported",
    "logit_bias": "logit_bias is not supported",
    "min_p": "min_p is not supported (only 0)",
    # other servers' extensions (vLLM, llama.cpp): an answer without them would look right and not be
    "json_schema": "constrained output (a JSON schema) is not supported",
    "grammar": "constrained output (a grammar) is not supported",
    "guided_json": "constrained output (guided decoding) is not supported",
    "guided_regex": "constrained output (guided decoding) is not supported",
    "guided_choice": "constrained output (guided decoding) is not supported",
    "guided_grammar": "constrained output (guided decoding) is not supported",
    "structured_outputs": "constrained output is not supported",
    "ignore_eos": "ignore_eos is not supported",
    "min_tokens": "min_tokens is not supported",
    "stop_token_ids": "stop_token_ids is not supported: give 'stop' strings",
    "n_probs": "logprobs are not supported",
    "use_beam_search": "beam search is not supported",
    "reasoning_effort": "reasoning effort is not supported",
    # the chat template's own arguments (vLLM's, SGLang's): the model's template is rendered with its defaults, so
    # enable_thinking false, a request's own template or documents changed nothing
    "chat_template_kwargs": "chat template arguments are not supported: the model's template renders with its defaults",
    "chat_template": "a request's own chat template is not supported: the model's is used",
    "documents": "documents for the chat template are not supported",
    "continue_final_message": "continuing the last message is not supported: the answer is a new assistant turn",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported: a stop string is left out",
    # other servers' names for the length limit: ignored, an answer would run to the end of the context
    "n_predict": "this server takes the length limit as 'max_tokens'",
    "num_predict": "this server takes the length limit as 'max_tokens'",
    "max_new_tokens": "this server takes the length limit as 'max_tokens'",
    "max_length": "this server takes the length limit as 'max_tokens'",
}
# Fields refused unless they ask for what the server does anyway: plain text, no tool calls.
PLAIN_ONLY = {
    "response_format": (
        lambda v: isinstance(v, dict) and v.get("type") == "text",
        "only {'type': 'text'} is supported (no JSON mode or schema)",
    ),
    "tool_choice": (lambda v: v in ("none", "auto"), "tool calls are not supported"),
    "modalities": (lambda v: isinstance(v, list) and all(m == "text" for m in v), "only text output is supported"),
    "function_call": (lambda v: v in ("none", "auto"), "function calls are not supported"),
    "best_of": (lambda v: v == 1, "best_of is not supported (only 1)"),
    "typical_p": (lambda v: v == 1, "typical_p is not supported (only 1)"),
    "mirostat": (lambda v: v == 0, "mirostat is not supported (only 0)"),
    "repeat_penalty": (lambda v: v == 1, "this server takes the repetition penalty as 'repetition_penalty'"),
    "dry_multiplier": (lambda v: v == 0, "DRY sampling is not supported (only 0)"),
    "xtc_probability": (lambda v: v == 0, "XTC sampling is not supported (only 0)"),
    "top_a": (lambda v: v == 0, "top_a is not supported (only 0)"),
    "skip_special_tokens": (lambda v: v is True, "only true is supported: special tokens are left out of the text"),
}
# vLLM's fields whose one value the server does depends on the endpoint: (the chat endpoint's, the completions
# endpoint's, with the why of each). A chat's special tokens and its assistant turn come from its template alone;
# a completion's prompt is read as given, no template, with the tokenizer's own special tokens (vLLM's defaults)
BY_ENDPOINT = {
    "add_special_tokens": (
        (False, "false: the chat template writes the special tokens"),
        (True, "true: the tokenizer's are added"),
    ),
    "add_generation_prompt": (
        (True, "true: the answer is a new assistant turn"),
        (False, "false: a completion's prompt is read as given, without a chat template"),
    ),
}
# The fields a request's answer depends on, as this server reads them: a field named like one of them but not
# one (a misspelling such as 'temprature') is refused, where it would be ignored and the answer look right.
READ_FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    *BY_ENDPOINT,
    *UNSUPPORTED,
    *PLAIN_ONLY,
)
# Fields of OpenAI's requests that change nothing in the answer, and other servers' fields named like one read
# here that change nothing while what they tune is off: taken, not read.
PASSED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prediction",
        "web_search_options",
        "mirostat_tau",
        "mirostat_eta",
        "repetition_penalty_range",
        "temperature_last",
    }
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Request:
    """One completion request as the engine will run it."""

    chat: bool
    model: str
    messages: list[dict]
    raw: bool
    n: int = 1
    max_tokens: Optional[int] = None  # None: up to the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # an extension, as vLLM's and llama.cpp's servers take it (0 = off)
    repetition_penalty: float = 1.0  # likewise (1 = off)
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# ---- parsing -----------------------------------------------------------------------------------------------


def _int(body: dict, name: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, got {_shown(v)}", name, "invalid_value")
    return v


def _shown(v: float) -> str:
    """A number as an error names it: an integer of hundreds of digits by its length."""
    return str(v) if isinstance(v, float) or abs(v) < 10**20 else f"an integer of {len(str(abs(v))):,} digits"


def _num(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise bad(f"'{name}' must be a finite number, got {v!r}", name, "invalid_type")
    if not lo <= v <= hi:  # an int past what a float holds is compared exactly (float(v) was a 500)
        raise bad(f"'{name}' must be in [{lo}, {hi}], got {_shown(v)}", name, "invalid_value")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {type(v).__name__}", name, "invalid_type")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop", "invalid_value")
    if any(not s for s in items):
        raise bad("'stop' strings must not be empty", "stop", "invalid_value")
    for s in items:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            why = f"'stop' string {s!r} holds an invalid character (a lone surrogate)"
            raise bad(why, "stop", "invalid_value") from None
    return tuple(items)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(
                    f"messages[{i}].content: only text parts are supported", f"messages[{i}].content", "invalid_value"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise bad(
        f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content", "invalid_type"
    )


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise bad(
                f"messages[{i}].role must be system, developer, user or assistant, got {m.get('role')!r}",
                f"messages[{i}].role",
                "invalid_value",
            )
        out.append({"role": role, "content": _content(m, i)})
    if out[-1]["role"] != "user":
        raise bad("the last message must be from the user", f"messages[{len(out) - 1}].role", "invalid_value")
    return out


def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise bad(
            "'prompt' must be a string (token-id prompts and lists of prompts are not supported)",
            "prompt",
            "invalid_type",
        )
    if not p:
        raise bad("'prompt' is empty", "prompt", "invalid_value")
    return p


def _refuse_misspelt(body: dict) -> None:
    """A field not read here whose name is close to one that is: refused with the name it is near."""
    for name in body:
        if not isinstance(name, str) or name in READ_FIELDS or name in PASSED_FIELDS:
            continue
        near = difflib.get_close_matches(name.lower(), READ_FIELDS, n=1, cutoff=0.8)
        if near:
            raise bad(f"unknown field {name!r}: did you mean {near[0]!r}?", name, "unknown_parameter")


def parse_request(body: Any, chat: bool, model_id: str) -> Request:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    if model != model_id:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {model_id!r}",
            param="model",
            code="model_not_found",
        )
    _refuse_misspelt(body)
    for name, why in UNSUPPORTED.items():
        v = body.get(name)
        # the completions endpoint's logprobs is a count, and 0 asks for the chosen tokens' own
        asked = v is not None if (name == "logprobs" and not chat) else v not in (None, False, [], {}, 0)
        if asked:
            raise bad(f"'{name}': {why}", name, "unsupported_parameter")
    for name, (plain, why) in PLAIN_ONLY.items():
        v = body.get(name)
        if v is not None and not plain(v):
            raise bad(f"'{name}': {why}", name, "unsupported_parameter")
    for name, ways in BY_ENDPOINT.items():
        v = body.get(name)
        done, how = ways[0] if chat else ways[1]
        if v is not None and v is not done:  # the other value is refused, not ignored
            raise bad(f"'{name}': only {how}", name, "unsupported_parameter")
    for name in ("frequency_penalty", "presence_penalty"):
        if _num(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise bad(f"'{name}' is not supported (only 0)", name, "unsupported_parameter")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    # the chat endpoint's newer name, read on both: taken and not read, an answer ran to the end of the context
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_NEW_TOKENS_LIMIT)
    older = _int(body, "max_tokens", 1, MAX_NEW_TOKENS_LIMIT)  # checked beside it too: "abc" was taken
    if max_tokens is None:
        max_tokens = older
    elif older is not None and older != max_tokens:  # one would be ignored
        why = f"'max_tokens' ({older}) and 'max_completion_tokens' ({max_tokens}) differ: give one of them"
        raise bad(why, "max_tokens", "invalid_value")
    # the engine's seeds are [0, 2**63); -1 asks for a random one, as llama.cpp's server reads it (folding other
    # values onto that range made different seeds give the same text)
    seed = _int(body, "seed", -1, 2**63 - 1)
    temperature = _num(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _num(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:  # only the most likely token is left: greedy
        temperature, top_p = 0.0, 1.0
    req = Request(
        chat=chat,
        model=model,
        messages=_messages(body) if chat else [{"role": "user", "content": _prompt(body)}],
        raw=not chat,
        n=_int(body, "n", 1, MAX_CANDIDATES) or 1,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_int(body, "top_k", 0, TOP_K_LIMIT) or 0,
        repetition_penalty=_num(body, "repetition_penalty", REPETITION_PENALTY_MIN, 10.0, 1.0),
        seed=None if seed is None or seed == -1 else seed,
        stop=_stop(body),
        stream=_bool(body, "stream"),
        include_usage=_bool(stream_options or {}, "include_usage"),
    )
    return req


# ---- responses ---------------------------------------------------------------------------------------------


def _figure(m: GenerationMetrics, key: str) -> dict[str, Any]:
    """A value with its source, or null with the reason (a value that is not a finite number is null: strict JSON
    has no NaN)."""
    f = m.figure(key)
    why = figures.not_finite(f.value)
    if f.available and why is None:
        return {"value": f.value, "source": f.source}
    return {"value": None, "reason": why or f.reason or "not measured on this run"}


def gapless_figures(m: GenerationMetrics, queue_ms: float) -> dict[str, Any]:
    """The HUD's headline figures, each with its source or the reason it is n/a (an extension field)."""
    out = {key: _figure(m, key) for key in SERVED_FIGURES}
    out["queue_wait_ms"] = {"value": queue_ms, "source": "server clock: request accepted -> generation started"}
    return out


def usage(result: GenerationResult) -> Optional[dict[str, int]]:
    """The token counts, or None (usage: null) where they are not known: a remote model behind this server that
    did not report them. Zeros there were passed on as counts (an app in front showed "0 new tokens" for an
    answer); x_gapless says why they are n/a."""
    m = result.metrics
    counted = any(result.token_ids)
    if "prompt_tokens" in m.unavailable or (not counted and "new_tokens_total" in m.unavailable):
        return None
    prompt = m.prompt_tokens
    completion = sum(len(t) for t in result.token_ids) if counted else m.new_tokens_total
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_object(req: Request, result: GenerationResult, queue_ms: float) -> dict[str, Any]:
    choices = []
    for i, (text, finish) in enumerate(zip(result.texts, result.finish_reasons)):
        if req.chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": FINISH[finish],
                    "logprobs": None,
                }
            )
        else:
            choices.append({"index": i, "text": text, "finish_reason": FINISH[finish], "logprobs": None})
    return _response(
        req, "chat.completion", choices, usage=usage(result), x_gapless=gapless_figures(result.metrics, queue_ms)
    )


def response_id(req: Request) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{req.id}"


def chunk(req: Request, choices: list[dict], **extra: Any) -> dict[str, Any]:
    return _response(req, "chat.completion.chunk", choices, **extra)


def _response(req: Request, chat_object: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
    """A response or stream chunk: `chat_object` is its type for the chat endpoint (the text endpoint's is
    always text_completion)."""
    return {
        "id": response_id(req),
        "object": chat_object if req.chat else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": choices,
        **extra,
    }


def delta_choice(
    req: Request, index: int, text: str, finish: Optional[str] = None, first: bool = False
) -> dict[str, Any]:
    if req.chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
