"""The Optimizations panel's kernels choice: the fused preset selects it, editing it emits the options, and an
engine that cannot run the fused kernels turns it back to torch with the reason on the disabled entry."""

from __future__ import annotations

from toggles_driver import pick, toggles_panel

from engine.types import EngineOptions, describe_options, preset_options


def test_kernels_choice_follows_presets_edits_and_the_engine(qtbot):
    t, got = toggles_panel(qtbot, EngineOptions())
    assert t.kernels.currentData() == "torch"
    pick(t.preset, "fused")
    assert got[-1] == preset_options("fused", EngineOptions())
    assert t.kernels.currentData() == "fused" and t.cuda_graph.isChecked() and not t.compile.isChecked()
    pick(t.kernels, "torch")
    assert got[-1].kernels == "torch" and t.preset.currentData() == "custom"

    pick(t.kernels, "fused")
    why = "the fused kernels are Triton GPU kernels and this runs on the CPU"
    t.set_applied(got[-1], {"kernels": why})
    assert got[-1].kernels == "torch" and t.kernels.currentData() == "torch"
    item = t.kernels.model().item(t.kernels.findData("fused"))
    assert not item.isEnabled() and item.toolTip() == f"Unavailable: {why}"
    assert not t.preset.model().item(t.preset.findData("fused")).isEnabled()


def test_describe_options_names_the_fused_kernels():
    text = describe_options(preset_options("fused", EngineOptions(device="cuda")).to_dict())
    assert text == "fp16 · static KV · device sampling · eager · CUDA graph · kernels fused"
