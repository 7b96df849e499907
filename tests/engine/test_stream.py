"""Host side of a generation: read-back of the device's token buffer and per-row text."""

import torch

from engine.stream import Readback


def test_readback_columns_per_row_in_pieces():
    out = torch.arange(3 * 10).reshape(3, 10)  # [B, L]
    rb = Readback(out)
    rb.issue(4)
    rb.issue(4)  # nothing new
    rb.issue(7)
    assert rb.poll(wait=True) == 7
    assert rb.columns(0, 7) == out[:, :7].tolist()
    assert rb.columns(4, 7) == [[4, 5, 6], [14, 15, 16], [24, 25, 26]]
    out[:, 7:] = -1  # written by later steps; the host sees them only once copied
    rb.issue(10)
    assert rb.columns(7, 10) == [[-1] * 3] * 3


def test_readback_destination_of_every_copy_is_contiguous():
    # A non-contiguous host destination makes a CUDA device-to-host copy go through a pageable temporary and
    # wait for the device; every slice the read-back copies into must be one contiguous block, for any B.
    for batch in (1, 4, 16):
        rb = Readback(torch.zeros(batch, 64, dtype=torch.long))
        for a, b in ((0, 1), (1, 9), (9, 64)):
            assert rb.host[a:b].is_contiguous(), (batch, a, b)


def test_a_stop_string_inside_a_chunk_keeps_only_the_tokens_up_to_it():
    from tiny_models import make_tokenizer

    from engine.stream import RowText

    tok = make_tokenizer()
    ids = tok("the quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    upto = next(n for n in range(1, len(ids) + 1) if "fox" in tok.decode(ids[:n]))
    one = RowText(tok, set(), ("fox",))
    one.feed(ids[:3])
    one.feed(ids[3:])  # the rest in one chunk, as a device-sampling read-back delivers it
    assert one.finish == "stop" and one.text == tok.decode(ids).split("fox")[0]
    assert one.tokens == ids[:upto] and len(one.tokens) < len(ids)
    each = RowText(tok, set(), ("fox",))  # one token at a time (host sampling) ends at the same token
    for t in ids:
        each.feed([t])
    assert each.tokens == one.tokens and each.text == one.text


def test_a_chunk_cuts_where_the_first_completed_stop_string_is_not_at_an_earlier_starting_one():
    """Stop strings where the longer one starts earlier but completes later: read token by token, the shorter one
    ends the answer first; read in one chunk (device sampling, an accepted draft), the answer is the same."""
    from tiny_models import make_tokenizer

    from engine.stream import RowText

    tok = make_tokenizer()
    ids = tok("the quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    stops = ("quick brown fox jumps", "brown")
    each = RowText(tok, set(), stops)
    for t in ids:
        each.feed([t])
    assert each.finish == "stop" and each.text == "the quick "
    one = RowText(tok, set(), stops)
    one.feed(ids[:1])
    one.feed(ids[1:])
    assert one.finish == "stop"
    assert (one.text, one.tokens) == (each.text, each.tokens)


def byte_fallback_tokenizer():
    """A tokenizer that decodes as Llama-2's, Mistral's and Gemma's do: a character outside the vocabulary is its
    UTF-8 bytes, one token each, and an unfinished character decodes to one U+FFFD per byte so far."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "a": 1, "▁b": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def streamed(row, ids: list[int], chunk: int = 1) -> list[str]:
    """The deltas `row` streams when its tokens come `chunk` at a time, a flush after each, then the final one."""
    out = []
    for n in range(0, len(ids), chunk):
        row.feed(ids[n : n + chunk])
        out.append(row.take_delta())
    row.finish = "length"
    out.append(row.take_delta(final=True))
    return out


def test_a_character_split_over_byte_tokens_streams_whole():
    from engine.stream import RowText

    tok = byte_fallback_tokenizer()
    whale = [3 + b for b in "🐳".encode()]  # four byte tokens
    ids = [1, *whale, 2, *whale, *whale, 1]
    assert tok.decode(ids) == "a🐳 b🐳🐳a" and tok.decode([1, *whale[:2]]) == "a\ufffd\ufffd"
    deltas = streamed(RowText(tok, set(), ()), ids)  # a flush after every token: one lands inside each character
    assert "".join(deltas) == "a🐳 b🐳🐳a" and not any("\ufffd" in d for d in deltas)


def test_a_character_a_later_byte_token_spoils_is_streamed_as_the_answer_s_text_has_it():
    """Byte fallback decodes a run of byte tokens whole: "é" (two byte tokens) then 0xAC, which cannot follow it, is
    three U+FFFDs in the answer's text. The "é" streamed as soon as it was whole, so what was shown and what was
    saved (and the server's stream and its whole answer) differed."""
    from engine.stream import RowText

    tok = byte_fallback_tokenizer()
    e_acute, euro = ([3 + b for b in c.encode()] for c in ("é", "€"))
    ids = [1, *e_acute, 3 + 0xAC, 2, *euro, 1, *e_acute, 1]
    assert tok.decode(ids) == "a\ufffd\ufffd\ufffd b€aéa"
    for chunk in (1, 2, 3):
        row = RowText(tok, set(), ())
        deltas = streamed(row, ids, chunk)
        assert "".join(deltas) == row.text == tok.decode(ids), (chunk, deltas)
        assert "é" in deltas[-1] or "é" in deltas[-2]  # the last one, whole, went out once "a" ended its run


def test_a_special_token_inside_a_byte_run_does_not_end_it_while_streaming():
    """The text leaves special tokens out, so byte fallback reads the bytes on both sides of one as one run: "é"
    split by <s>, then 0xAC, is three U+FFFDs in the answer; streamed, the <s> ended the run and "é" went out."""
    from tiny_models import make_sentencepiece_tokenizer

    from engine.stream import RowText

    tok = make_sentencepiece_tokenizer()
    byte = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xAC)}
    paris = tok("Paris", add_special_tokens=False)["input_ids"]
    ids = [*paris, byte[0xC3], tok.bos_token_id, byte[0xA9], tok.bos_token_id, byte[0xAC], *paris]
    assert tok.decode(ids, skip_special_tokens=True) == "Paris\ufffd\ufffd\ufffd Paris"
    row = RowText(tok, set(), ())
    deltas = streamed(row, ids)
    assert "".join(deltas) == row.text == "Paris\ufffd\ufffd\ufffd Paris", deltas


def test_a_stop_string_that_is_a_special_token_s_text_stops_at_that_token():
    """The text is read without special tokens, so "<|im_start|>" as a stop string never matched: the model's
    next turn ran on into the answer, its <|im_start|> left out."""
    from tiny_models import make_tokenizer

    from engine.stream import RowText

    tok = make_tokenizer()
    start = tok.convert_tokens_to_ids("<|im_start|>")
    words = tok("hello world", add_special_tokens=False)["input_ids"]
    turn = words + [start] + tok("user\nthe quick fox", add_special_tokens=False)["input_ids"]
    for chunk in (1, 3, len(turn)):
        row = RowText(tok, set(), ("<|im_start|>",))
        for n in range(0, len(turn), chunk):
            row.feed(turn[n : n + chunk])
        assert (row.finish, row.text, row.tokens) == ("stop", "hello world", words + [start]), chunk
    # a stop string of plain text still stops where it is read
    row = RowText(tok, set(), ("<|im_start|>", "world"))
    row.feed(turn)
    assert (row.finish, row.text) == ("stop", "hello ")


def test_a_plain_completion_keeps_the_space_its_answer_begins_with():
    """Decoded alone, the answer "▁Paris" of a SentencePiece model lost its space: "The capital of France isParis"."""
    from tiny_models import make_sentencepiece_tokenizer

    from engine.stream import RowText

    tok = make_sentencepiece_tokenizer()
    prompt = tok("The capital of France is")["input_ids"]
    answer = tok("The capital of France is Paris, and")["input_ids"][len(prompt) :]
    assert tok.convert_ids_to_tokens(answer[0]).startswith("▁")
    alone, after = RowText(tok, set(), ()), RowText(tok, set(), (), lead=tuple(prompt[-4:]))
    for row in (alone, after):
        for t in answer:
            row.feed([t])
    assert alone.text == "Paris, and"  # a chat's answer starts without it, as the template's turn begins
    assert after.text == " Paris, and" and tok.decode(prompt + answer, skip_special_tokens=True).endswith(after.text)


def test_a_plain_completion_after_a_prompt_ending_in_byte_tokens_keeps_its_characters():
    """The prompt's last tokens began inside "€" (three byte tokens of SentencePiece's byte fallback): decoded after
    them, the answer's "€€" came out as six U+FFFDs, as the whole run of bytes was read as one."""
    from tiny_models import make_sentencepiece_tokenizer

    from engine.stream import RowText

    tok = make_sentencepiece_tokenizer()
    prompt = tok("Paris €€")["input_ids"]
    answer = tok("Paris €€€€")["input_ids"][len(prompt) :]
    assert tok.convert_ids_to_tokens(prompt[-4:])[0] == "<0xAC>"  # the lead begins inside the first "€"
    row = RowText(tok, set(), (), lead=tuple(prompt[-4:]))
    for t in answer:
        row.feed([t])
    assert row.text == "€€" and tok.decode(prompt + answer) == "Paris €€€€"
