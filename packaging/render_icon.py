"""Render assets/gapless.svg to a PNG (Linux icon themes without SVG support) and an ICO (the Windows
executable and its Start-menu entry), with Qt's own SVG renderer so no other tool is needed.

    python packaging/render_icon.py OUT_DIR        -> OUT_DIR/gapless-256.png, OUT_DIR/gapless.ico
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SIZE = 256  # the largest size Windows and the hicolor theme use for an application icon


def render(svg: Path, out_dir: Path) -> list[Path]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication(["render_icon"])  # QImage and QSvgRenderer need one
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"render_icon: cannot read {svg}")
    image = QImage(SIZE, SIZE, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fmt in ((f"gapless-{SIZE}.png", "PNG"), ("gapless.ico", "ICO")):
        path = out_dir / name
        if not image.save(str(path), fmt):
            raise SystemExit(f"render_icon: Qt cannot write {fmt} to {path}")
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    root = Path(__file__).resolve().parent.parent
    for p in render(root / "assets" / "gapless.svg", Path(sys.argv[1])):
        print(p)
