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


def test_on_a_cpu_the_presets_are_what_the_ladder_runs():
    """The CPU ladder runs int8, candidates and speculation without compile (minutes to compile there, and slower
    than the eager step's own kernels); choosing those presets in the panel gives the same options, so it does
    not ask for a compile the diagnosis advises against. On CUDA they stay as defined."""
    from app.gui import preset_for_device
    from engine.ladder import RELAXED_RUNGS

    base = EngineOptions(device="cpu")
    for name in PRESETS:
        cpu = preset_for_device(name, base, "cpu")
        if name in RELAXED_RUNGS:
            assert not cpu.compile and not cpu.cuda_graph, name
            assert getattr(cpu, DEFINING_OPTION[name]) == getattr(PRESETS[name], DEFINING_OPTION[name]), name
        cuda = preset_for_device(name, base.with_(device="cuda"), "cuda")
        assert (cuda.compile, cuda.cuda_graph) == (PRESETS[name].compile, PRESETS[name].cuda_graph), name
    assert preset_for_device("compile", base, "cpu").compile  # the compile rung itself still compiles
