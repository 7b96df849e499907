"""Chats written into a store as the app writes them, for the store's tests."""

from __future__ import annotations

from typing import Optional


def chain(store, chat_id: int, *contents: str, parent: Optional[int] = None) -> list:
    """Messages each answering the one before, a user's first and then taking turns; the messages."""
    out = []
    for i, content in enumerate(contents):
        out.append(store.add_message(chat_id, ("user", "assistant")[i % 2], content, parent))
        parent = out[-1].id
    return out


def streaming_answer(store, question: str) -> tuple:
    """A new chat with `question` and an empty answer still streaming: (chat, question, answer)."""
    chat = store.create_chat()
    (q,) = chain(store, chat.id, question)
    return chat, q, store.add_message(chat.id, "assistant", "", q.id, status="streaming")
