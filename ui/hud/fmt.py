"""How the HUD writes figures: one place, so the bars, the table and the plots agree. None is always "n/a"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from engine import figures
from engine.figures import FigureSpec
from engine.types import EngineOptions, describe_options

NA = "n/a"


def number(v: Optional[float], unit: str = "", digits: Optional[int] = None, top: Optional[float] = None) -> str:
    """`v` in `unit`; `digits` by magnitude where None; never rounded to 0 or to `top` (figures.rounded)."""
    if v is None or not math.isfinite(v):
        return NA
    if digits is None:
        a = abs(v)
        digits = 0 if a >= 1000 else 1 if a >= 10 else 2
    text = figures.rounded(v, digits, top)
    return f"{text} {unit}" if unit else text


def percent(v: Optional[float]) -> str:
    return number(v, "%", 1, top=100.0)


def size(v: Optional[float]) -> str:
    """Bytes in binary units (KiB / MiB / GiB), as memory is counted: 1,023.9 MiB, then 1.0 GiB (never "1,024.0
    MiB")."""
    if v is None or not math.isfinite(v):
        return NA
    return _scaled(v, (("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)), 1024, " ")


def count(v: Optional[float]) -> str:
    """A count in thousands, millions, billions: 999, 1.0K, 999.9K, then 1.0M (never "1000.0K")."""
    if v is None or not math.isfinite(v):
        return NA
    return _scaled(v, (("", 1), ("K", 10**3), ("M", 10**6), ("B", 10**9)), 1000, "")


def _scaled(v: float, units: tuple[tuple[str, int], ...], step: int, sep: str) -> str:
    """`v` in the largest unit it reaches, moved up one where one decimal would round it to `step` of that unit."""
    i = max((n for n, (_, scale) in enumerate(units) if abs(v) >= scale), default=0)
    digits = 0 if i == 0 else 1
    if round(abs(v) / units[i][1], digits) >= step and i + 1 < len(units):
        i, digits = i + 1, 1
    unit, scale = units[i]
    return f"{v / scale:,.{digits}f}{sep if unit else ''}{unit}"


def figure_value(spec: FigureSpec, v: Optional[float]) -> str:
    """A registered figure's value in its unit (engine/figures.py), "n/a" when None."""
    if spec.unit == "%":
        return number(v, "%", 1 if spec.digits is None else spec.digits, top=100.0)
    if spec.unit == "bytes":
        return size(v)
    if spec.unit in ("tokens", "count"):
        return number(v, digits=0 if spec.digits is None else spec.digits)
    if spec.unit == "fraction":  # stored 0..1, shown as a percentage
        digits = 0 if spec.digits is None else spec.digits
        return NA if v is None or not math.isfinite(v) else number(100 * v, "%", digits, top=100.0)
    if spec.unit == "ratio":
        return ratio(v)
    return number(v, spec.unit, spec.digits)


@dataclass(frozen=True)
class ShownFigure:
    """A registered figure (engine/figures.py) the HUD draws in a colour (a bar, a plot): its title, unit and
    format come from the registry."""

    key: str  # the figure's key in the registry
    color: str

    @property
    def figure(self) -> FigureSpec:
        return figures.spec(self.key)

    @property
    def title(self) -> str:
        return self.figure.label

    def format(self, v: Optional[float]) -> str:
        return figure_value(self.figure, v)


def ratio(v: Optional[float], digits: int = 2) -> str:
    """×1.13; a ratio that is not zero never shown as ×0.00 (×<0.01)."""
    return NA if v is None or not math.isfinite(v) else f"×{figures.rounded(v, digits)}"


def delta(rel: Optional[float]) -> str:
    """A relative change, always as the ratio to the reference (×1.13, ×0.50, ×4.00), as the ladder's speed-ups are."""
    if rel is None or not math.isfinite(rel):
        return NA
    return ratio(1.0 + rel)


def bare_source(source: str) -> str:
    """The engine's labels name the figure first ("SM activity — NVML GPM"); beside a title, keep the rest."""
    return source.split(" — ", 1)[1] if " — " in source else source


def nice_ceiling(v: float) -> float:
    """The next of 1, 2, 5 × 10^k at or above v: a y range that only moves in steps, so plots do not jitter."""
    if not math.isfinite(v) or v <= 0:
        return 1.0
    k = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if v <= m * k * (1 + 1e-9):
            return m * k
    return 10 * k


def options_summary(options: EngineOptions) -> str:
    """EngineOptions in a few words, with the device first (engine.types.describe_options)."""
    return describe_options(options, device=True)
