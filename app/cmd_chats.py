"""`gapless chats list | export | import`: the chat store from the command line."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from app.chat_io import (
    MAX_FILE_BYTES,
    ChatFileError,
    export_json,
    export_markdown,
    parse_chat,
    read_chat_file,
    store_chat,
    write_text,
)
from app.paths import AppPaths
from app.store import ChatStore
from app.terminal import printable

EXIT_OK = 0


def run_chats(args: Any, paths: AppPaths) -> int:
    paths.ensure()
    with ChatStore(paths.database) as store:
        for notice in store.notices:  # a damaged database repaired or moved aside, before anything it lists
            print(f"gapless: {notice}", file=sys.stderr)
        if args.chats_command == "list":
            for c in store.list_chats():
                when = datetime.fromtimestamp(c.updated).strftime("%Y-%m-%d %H:%M")
                print(f"{c.id}\t{when}\t{store.count_messages(c.id)} messages\t{printable(c.title)}")
            return EXIT_OK
        if args.chats_command == "export":
            store.get_chat(args.chat_id)  # "no chat with id N" before anything is written
            text = export_markdown(store, args.chat_id) if args.markdown else export_json(store, args.chat_id)
            if args.output is None or str(args.output) == "-":
                sys.stdout.write(text)
            else:
                write_text(args.output, text)
                print(f"chat {args.chat_id} written to {args.output}", file=sys.stderr)
            return EXIT_OK
        if args.chats_command == "import":
            newest, chat = store.newest_chat_id(), None
            try:
                if str(args.path) == "-":  # as export writes to standard output: `chats export 1 | chats import -`
                    chat = parse_chat(sys.stdin.buffer.read(MAX_FILE_BYTES + 1))
                else:
                    chat = read_chat_file(Path(args.path))
                chat_id = store_chat(store, chat)
            except ChatFileError as exc:
                raise ChatFileError(f"{args.path} was not imported: {exc}") from exc
            except KeyboardInterrupt:
                # Ctrl+C while the chat's transaction committed (a large chat's commit takes seconds) is raised
                # once it has: the chat is stored, and a command that said only "interrupted" had it imported
                # again as a second copy. Found by what it holds: a window may have started a chat meanwhile
                if chat is not None:  # None: stopped while the file was read
                    read = (chat.title, chat.created)
                    stored = [c for c in store.chats_after(newest) if (c.title, c.created) == read]
                    if stored:
                        print(f"imported as chat {stored[0].id} before the interrupt: {printable(chat.title)}")
                raise
            print(f"imported as chat {chat_id}: {printable(store.get_chat(chat_id).title)}")
            return EXIT_OK
    raise ValueError(f"unknown chats command {args.chats_command!r}")
