"""Host side of a generation: tokens read back from the device become text, per candidate, with EOS and stop
strings decided here, and device→host copies that never make the device wait."""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from engine.prompt import backend_of, special_ids, special_token_ids


class RowText:
    """One candidate's tokens and text. Text is decoded whole at each flush (cheap at ~30 Hz) so multi-token
    characters and merged spaces come out right; trailing U+FFFDs (an incomplete character) are held back."""

    def __init__(self, tokenizer, eos_ids: set[int], stop: tuple[str, ...], lead: tuple[int, ...] = ()):
        """`lead`: the prompt's last tokens, where the answer continues the prompt's text (a plain completion):
        the answer's text is what they and it decode to past what they decode to alone. Decoded alone, the answer
        of a SentencePiece model (Llama 2, Mistral) lost the space its first token begins with ("The capital of
        France is" + "Paris")."""
        self.tokenizer = tokenizer
        self.lead = list(lead)
        self.lead_text = tokenizer.decode(self.lead, skip_special_tokens=True) if lead else ""
        # a lead that begins inside a character (a byte token of SentencePiece's byte fallback) decodes as U+FFFDs,
        # and so did every character after it, the answer's too: it begins at a character
        while self.lead and self.lead_text.startswith("\ufffd"):
            del self.lead[0]
            self.lead_text = tokenizer.decode(self.lead, skip_special_tokens=True)
        self.eos_ids = eos_ids
        self.stop = stop
        # a stop string that is a special token's text ("<|im_start|>" for a ChatML model) is that token: the text
        # is read without special tokens, so it never held the string, and the model's next turn ran on
        self.stop_ids = special_ids(tokenizer, stop) if stop else frozenset()
        self.byte_ids = byte_token_ids(tokenizer)
        self.skipped_ids = special_token_ids(tokenizer) if self.byte_ids else frozenset()
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars that might begin a stop string
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0  # chars of self.text already streamed
        self.finish: Optional[str] = None  # eos | stop | length | cancelled

    def feed(self, new_tokens: list[int]) -> None:
        if self.finish is not None:
            return
        before = len(self.tokens)
        for t in new_tokens:
            self.tokens.append(t)
            if t in self.eos_ids:
                self.finish = "eos"
                break
            if t in self.stop_ids:
                self.finish = "stop"
                break
        ids = self.tokens[:-1] if self.finish is not None else self.tokens
        self.text = self._decode(ids)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            cut = _find_stop(self.text, self.stop, start=start)
            if cut is not None:
                # Tokens arrive in chunks with device sampling and speculation: keep only those up to the one that
                # completed a stop string, and cut the text where that token's text holds one, so the answer is the
                # one a token-by-token read gives (a longer stop string that starts earlier and completes in a later
                # token of the chunk does not move the cut back).
                text = self.text
                for n in range(before + 1, len(ids) + 1):
                    text = self._decode(ids[:n])
                    first = _find_stop(text, self.stop, start)
                    if first is not None:
                        del self.tokens[n:]
                        cut = first
                        break
                self.text = text[:cut]
                self.finish = "stop"

    def _decode(self, ids: list[int]) -> str:
        if self.lead:
            whole = self.tokenizer.decode(self.lead + ids, skip_special_tokens=True)
            if whole.startswith(self.lead_text):
                return whole[len(self.lead_text) :]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def reason(self) -> str:
        """Why the row ended; asked once the loop has closed every row (engine.observers.Reader)."""
        if self.finish is None:
            raise RuntimeError("the row is still open: its answer has not ended")
        return self.finish

    def take_delta(self, final: bool = False) -> str:
        text = self.text
        end = len(text)
        if not final and self.finish is None:
            # An unfinished character decodes to U+FFFD: one for the whole of it (byte-level BPE), or one per
            # byte so far (SentencePiece's byte fallback: Llama 2, Mistral, Gemma). None of them goes out until
            # the character is whole; a U+FFFD the model really wrote goes out with the final text.
            end = len(text.rstrip("\ufffd"))
            # SentencePiece's byte fallback decodes a run of byte tokens whole, as one piece of UTF-8 or, if it is
            # not, one U+FFFD per byte: a character the run has finished can still turn into U+FFFDs when the next
            # byte token is one that cannot follow it ("é" then 0xAC: three U+FFFDs in the answer's text). The
            # run's text goes out once a token that is not a byte ends it; a special token, which the text leaves
            # out, ends none.
            run = len(self.tokens)
            while run and self.tokens[run - 1] in self.skipped_ids:
                run -= 1
            if run and self.tokens[run - 1] in self.byte_ids:
                while run and (self.tokens[run - 1] in self.byte_ids or self.tokens[run - 1] in self.skipped_ids):
                    run -= 1
                end = min(end, len(self._decode(self.tokens[:run])))
            end = max(self.emitted, end - self.hold)
        delta = text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta


def byte_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the byte tokens (<0x00>..<0xFF>) a tokenizer's ByteFallback decoder reads as runs of UTF-8; none
    where its decoder has no ByteFallback (its <0xNN> tokens, if any, are plain text)."""
    backend = backend_of(tokenizer)
    if not hasattr(backend, "token_to_id") or "ByteFallback" not in repr(getattr(backend, "decoder", None)):
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> Optional[int]:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class Readback:
    """Copies of the device's output buffer into host memory.

    On CUDA: non-blocking copies into pinned memory, each followed by an event; the host reads a slice only once
    its event has completed. At most `max_pending` copies are in flight, which bounds how far the device can
    run ahead of what the host has seen (and so how many steps past EOS are wasted).

    The host copy is kept step-major, [L, B]: the columns a..b of `out` [B, L] land in rows a..b, one contiguous
    block of pinned memory. A copy into a non-contiguous slice of [B, L] (any B > 1) would go through a pageable
    temporary, which makes the copy synchronous: the host would wait for the device at every readback.
    """

    def __init__(self, out: torch.Tensor, max_pending: int = 3):
        self.out = out
        self.cuda = out.is_cuda
        self.host = torch.empty((out.shape[1], out.shape[0]), dtype=out.dtype, pin_memory=self.cuda)  # [L, B]
        self.pending: deque = deque()
        self.issued = 0  # columns [0, issued) copied or in flight
        self.visible = 0  # columns [0, visible) readable on the host
        self.max_pending = max_pending

    def issue(self, upto: int) -> None:
        if upto <= self.issued:
            return
        a, b = self.issued, upto
        if self.cuda:
            self.host[a:b].copy_(self.out[:, a:b].t(), non_blocking=True)  # transposed on the device, then DMA
            event = torch.cuda.Event()
            event.record()
            self.pending.append((b, event))
            while len(self.pending) > self.max_pending:
                self._wait_oldest()
        else:
            self.host[a:b].copy_(self.out[:, a:b].t())
            self.visible = b
        self.issued = b

    def _wait_oldest(self) -> None:
        b, event = self.pending.popleft()
        event.synchronize()
        self.visible = max(self.visible, b)

    def poll(self, wait: bool = False) -> int:
        """Advance `visible` over completed copies (all of them if wait); return it."""
        while self.pending and (wait or self.pending[0][1].query()):
            self._wait_oldest()
        return self.visible

    def columns(self, a: int, b: int) -> list[list[int]]:
        """Tokens of steps a..b, one list per row."""
        return self.host[a:b].t().tolist()


class StepClock:
    """Per-step latencies, device-synchronised: CUDA events on a GPU, host clock on a CPU (where ops run
    synchronously)."""

    def __init__(self, device: torch.device):
        import time

        self._now = time.perf_counter
        self.cuda = device.type == "cuda"
        self.marks: list = []  # index i: end of step i (0 = end of prefill)

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(self._now())

    def durations_s(self, upto: int) -> list[float]:
        """Durations of steps 1..upto-1 whose end marks are known complete."""
        upto = min(upto, len(self.marks))
        if self.cuda:
            return [self.marks[i - 1].elapsed_time(self.marks[i]) / 1e3 for i in range(1, upto)]
        return [self.marks[i] - self.marks[i - 1] for i in range(1, upto)]
