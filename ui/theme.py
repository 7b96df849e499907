"""Light and dark themes: the system's colour scheme by default, or a fixed one chosen in the settings.

The app runs the Fusion style with an explicit palette for each scheme, so the look is the same on every
platform (and offscreen), and a style sheet from assets/app.qss whose `@name` tokens take this palette's colours.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

from PySide6.QtCore import QEvent, QObject, Qt, Signal
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPalette, QPen
from PySide6.QtWidgets import QApplication, QWidget

THEME_CHOICES = ("system", "light", "dark")


class PaletteFollower(QWidget):
    """A widget that draws with colours of its own and re-applies them (`apply_palette`) whenever its palette
    changes, e.g. when the user switches the theme, and whenever its screen's scale changes (its lines are as
    many device pixels wide as the scale, see `line_pen`)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.apply_palette is PaletteFollower.apply_palette:
            raise TypeError(f"{cls.__name__} follows the palette, so it must define apply_palette()")

    def apply_palette(self) -> None:
        """Re-applies the widget's own colours from its palette (each subclass defines it)."""

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.DevicePixelRatioChange):
            self.apply_palette()


def line_pen(
    color: QColor | str, widget: QWidget, width: float = 1.0, style: Qt.PenStyle = Qt.PenStyle.SolidLine
) -> QPen:
    """A pen for a plot's lines, `width` pixels wide at the widget's scale. The plots draw with cosmetic pens
    (the same width at any zoom of the data), and Qt draws a cosmetic pen's width in device pixels: at a scale of
    200 % a 1 px curve, axis or grid line was half as thick as the text beside it, the grid all but gone."""
    pen = QPen(QColor(color))
    pen.setCosmetic(True)
    pen.setWidthF(width * widget.devicePixelRatioF())
    pen.setStyle(style)
    return pen


def muted_text(palette: QPalette) -> QColor:
    """The palette's text colour at about 60 % opacity: axes, sources and other secondary text."""
    c = QColor(palette.color(QPalette.ColorRole.Text))
    c.setAlpha(150)
    return c


@dataclass(frozen=True)
class Colors:
    window: str  # main background
    panel: str  # side panels, headers
    base: str  # text fields, conversation background
    text: str
    muted: str  # secondary text: stats lines, hints
    border: str
    accent: str  # selection, primary buttons, links
    accent_text: str  # text on the accent colour
    user_bubble: str  # background of the user's messages
    code_bg: str
    code_header: str
    error: str
    # syntax colours of code blocks
    syn_keyword: str
    syn_string: str
    syn_comment: str
    syn_number: str


# Each colour of Colors in the light and the dark theme, side by side: a colour added to one is added to both.
_SHADES: dict[str, tuple[str, str]] = {
    "window": ("#f3f4f7", "#1d1f24"),
    "panel": ("#eceef2", "#23262c"),
    "base": ("#ffffff", "#17191d"),
    "text": ("#1c2027", "#e4e6eb"),
    "muted": ("#626b78", "#9aa3b0"),
    "border": ("#d5d9e0", "#343842"),
    "accent": ("#2b62d9", "#5b8def"),
    "accent_text": ("#ffffff", "#10131a"),  # 4.5:1 or more on accent and error: dark on the dark theme's light ones
    "user_bubble": ("#e7eefc", "#253149"),
    "code_bg": ("#f5f6f8", "#111316"),
    "code_header": ("#eaecf0", "#262a31"),
    "error": ("#b3261e", "#f2857b"),
    "syn_keyword": ("#8a2be2", "#c792ea"),
    "syn_string": ("#1a7f37", "#a5d6a7"),
    "syn_comment": ("#5f6873", "#7f8896"),
    "syn_number": ("#a65300", "#f7b267"),
}
LIGHT = Colors(**{name: light for name, (light, _dark) in _SHADES.items()})
DARK = Colors(**{name: dark for name, (_light, dark) in _SHADES.items()})


def build_palette(c: Colors) -> QPalette:
    p = QPalette()
    role = QPalette.ColorRole
    for r, v in (
        (role.Window, c.window),
        (role.WindowText, c.text),
        (role.Base, c.base),
        (role.AlternateBase, c.panel),
        (role.Text, c.text),
        (role.Button, c.panel),
        (role.ButtonText, c.text),
        (role.ToolTipBase, c.panel),
        (role.ToolTipText, c.text),
        (role.Highlight, c.accent),
        (role.HighlightedText, c.accent_text),
        (role.Link, c.accent),
        (role.PlaceholderText, c.muted),
        (role.Mid, c.border),
        (role.Midlight, c.border),
        (role.Light, c.base),
        (role.Dark, c.border),
        (role.Shadow, c.border),
        (role.BrightText, c.error),
    ):
        p.setColor(r, QColor(v))
    disabled = QColor(c.muted)
    for r in (role.WindowText, role.Text, role.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, r, disabled)
    return p


SMALL_FONT, TITLE_FONT = 0.9, 1.15  # hints, stats lines and notices; the chat's title: times the application's


def font_points(font: QFont) -> float:
    """The font's size in points (a font sized in pixels at 96 dpi, as Qt counts them)."""
    return font.pointSizeF() if font.pointSizeF() > 0 else max(1, font.pixelSize()) * 0.75


def style_sheet(c: Colors, font_pt: Optional[float] = None) -> str:
    """assets/app.qss with every `@name` replaced by the colour of that name, `@assets` by the folder of the
    images it uses, and `@small_font` and `@title_font` by sizes in proportion to the application's font (or
    `font_pt`), so a user's larger font enlarges the hints and title with the rest."""
    folder = resources.files("assets")
    template = folder.joinpath("app.qss").read_text(encoding="utf-8")
    pt = font_pt if font_pt is not None else font_points(QGuiApplication.font())
    values = {
        **asdict(c),
        "assets": Path(str(folder)).as_posix(),
        "small_font": f"{SMALL_FONT * pt:.1f}pt",
        "title_font": f"{TITLE_FONT * pt:.1f}pt",
    }

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise KeyError(f"app.qss uses an unknown colour @{name}")
        return values[name]

    return re.sub(r"@([a-z_]+)", sub, template)


def _on_fusion(app: QApplication) -> bool:
    """Whether the application's style is Fusion. Under a style sheet the style the application reports is Qt's
    nameless style-sheet wrapper; one of ours is only ever put on Fusion."""
    style = app.style()
    if style.name().lower() == "fusion":
        return True
    return style.metaObject().className() == "QStyleSheetStyle" and app.styleSheet() in (
        style_sheet(LIGHT),
        style_sheet(DARK),
    )


class ThemeManager(QObject):
    """Applies the light or dark theme to the application and follows the system while set to "system"."""

    changed = Signal(object)  # Colors

    def __init__(self, app: QApplication, choice: str = "system"):
        super().__init__(app)
        self._app = app
        self._choice = "system"
        self._scheme: Optional[str] = None
        if not _on_fusion(app):  # setting it again re-polishes every widget alive
            app.setStyle("Fusion")
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._system_changed)
        self.set_choice(choice)

    @property
    def choice(self) -> str:
        return self._choice

    @property
    def scheme(self) -> str:
        """The scheme in use: "light" or "dark"."""
        return self._scheme or "light"

    @property
    def colors(self) -> Colors:
        return DARK if self.scheme == "dark" else LIGHT

    def set_choice(self, choice: str) -> None:
        if choice not in THEME_CHOICES:
            raise ValueError(f"theme must be one of {', '.join(THEME_CHOICES)}, got {choice!r}")
        self._choice = choice
        self._apply()

    def _system_scheme(self) -> str:
        scheme = QGuiApplication.styleHints().colorScheme()
        return "dark" if scheme == Qt.ColorScheme.Dark else "light"

    def _system_changed(self, _scheme) -> None:
        if self._choice == "system":
            self._apply()

    def _apply(self) -> None:
        scheme = self._system_scheme() if self._choice == "system" else self._choice
        if scheme == self._scheme:
            return
        self._scheme = scheme
        c = self.colors
        # Each set re-polishes every widget alive, the other windows' too: a look already in force (a second
        # window opened on the theme of the first) is not set again.
        palette, sheet = build_palette(c), style_sheet(c)
        if self._app.palette() != palette:
            self._app.setPalette(palette)
        if self._app.styleSheet() != sheet:
            self._app.setStyleSheet(sheet)
        self.changed.emit(c)
