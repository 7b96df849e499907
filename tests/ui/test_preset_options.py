"""Every ladder rung names the option it adds, so the panel can say why a rung cannot run here."""

from __future__ import annotations

from dataclasses import fields

from engine.types import PRESETS, EngineOptions
from ui.toggles import DEFINING_OPTION


def test_every_preset_names_the_option_it_adds():
    assert set(DEFINING_OPTION) == set(PRESETS)
    names = {f.name for f in fields(EngineOptions)}
    order = list(PRESETS)
    for before, preset in zip([None, *order], order):
        option = DEFINING_OPTION[preset]
        if before is None:
            assert option is None  # the first rung adds nothing
            continue
        assert option in names
        assert getattr(PRESETS[preset], option) != getattr(PRESETS[before], option), (preset, option)
