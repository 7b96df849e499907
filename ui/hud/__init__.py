"""The performance HUD: live plots, the last generation's figures, the compare table and the ladder chart."""

from ui.hud.panel import HudPanel

__all__ = ["HudPanel"]
