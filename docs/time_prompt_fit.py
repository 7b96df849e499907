"""How long fitting a long conversation into the context takes (engine.prompt.build_prompt, both cutting policies),
as the reviewer measured it: the tests' tiny BPE tokenizer with a ChatML template, a 4,096-token context and about
100 tokens a message.

    python docs/time_prompt_fit.py [--messages 500 2000 8000] [--context 4096] [--max-new-tokens 512] [--repeat 3]

Prints one line per size and policy: the best of --repeat runs, and what was cut.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WORDS = "hello world the quick brown fox jumps over lazy dog Paris is capital of France tokens per second".split()


def conversation(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "You are brief."}]
    for i in range(n - 1):
        words = rng.randint(20, 50)  # about 100 tokens with the tiny 320-token vocabulary
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(rng.choices(WORDS, k=words))})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "and so?"})
    return msgs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, nargs="+", default=[500, 2000, 8000])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    from tiny_models import CHATML, make_tokenizer

    from engine.prompt import build_prompt

    tok = make_tokenizer()
    tok.chat_template = CHATML
    for n in args.messages:
        msgs = conversation(n)
        tokens = sum(len(tok(m["content"], add_special_tokens=False)["input_ids"]) for m in msgs)
        for policy in ("rolling", "truncate-middle"):
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                prompt = build_prompt(tok, msgs, args.context, args.max_new_tokens, overflow=policy)
                best = min(best, time.perf_counter() - t0)
            print(
                f"{len(msgs):>6} messages ({tokens:,} content tokens)  {policy:<16} {best:7.3f} s  "
                f"{len(prompt.ids)} prompt tokens; {prompt.cut}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
