"""Files written whole (engine.paths.write_whole) and output paths checked before the work (output_file)."""

from __future__ import annotations

import pytest

from engine.errors import OutputPathError
from engine.paths import output_file, write_whole


def test_a_name_near_the_longest_a_file_system_takes_is_written_whole(tmp_path):
    """The temporary file beside it was named after it with more added: a name of 250 bytes could not be written."""
    target = tmp_path / ("é" * 123 + ".md")  # 250 bytes
    write_whole(target, "kept")
    assert target.read_text(encoding="utf-8") == "kept"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary file left


def test_a_name_longer_than_a_file_system_takes_is_refused_with_the_reason(tmp_path):
    with pytest.raises(OutputPathError, match="cannot write the chat to .*: File name too long"):
        output_file(tmp_path / ("t" * 300 + ".md"), "the chat")
