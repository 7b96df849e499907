"""Peak decimation of a time series to the pixels it is drawn on.

A plot a few hundred pixels wide cannot show more than a couple of points per pixel column, and pyqtgraph's own
downsampling works on every point held on every paint. Here each column keeps its lowest and highest value
(NaN ignored), so every peak and dip survives and the drawn extremes equal the data's; a gap (NaN) at a column's
start or end stays a gap, so separate runs (generations, the traced window) are never joined across time that
has no data. A series with at most two points per column is passed through unchanged.
"""

from __future__ import annotations

import numpy as np


def peak_decimate(
    x: np.ndarray, y: np.ndarray, x_lo: float, x_hi: float, columns: int
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) for a plot spanning [x_lo, x_hi] over `columns` pixels. `x` is sorted; rows before x_lo (the one
    that lets a line enter from the left edge) are kept as they are. Per column, in time order: a NaN where the
    column starts with a gap, its lowest value at the column's first x, its highest at its last x, a NaN where it
    ends with a gap; a column with no finite value is one NaN."""
    if x.size <= 2 * columns or columns < 1:
        return x, y
    edges = np.linspace(x_lo, x_hi, columns + 1)
    bounds = np.searchsorted(x, edges)  # column k holds rows bounds[k]:bounds[k + 1]
    bounds[-1] = x.size  # anything at or past x_hi belongs to the last column
    head = bounds[0]
    counts = np.diff(bounds)
    starts = bounds[:-1][counts > 0]
    if starts.size == 0:
        return x, y
    ends = starts + counts[counts > 0]  # exclusive
    lows = np.fmin.reduceat(y, starts)  # NaN only where the whole column is NaN
    highs = np.fmax.reduceat(y, starts)
    empty = np.isnan(lows)
    lead = np.isnan(y[starts]) & ~empty
    trail = np.isnan(y[ends - 1]) & ~empty

    n = starts.size
    xs = np.empty((n, 4))
    ys = np.empty((n, 4))
    xs[:, 0] = xs[:, 1] = x[starts]
    xs[:, 2] = xs[:, 3] = x[ends - 1]
    ys[:, 0] = ys[:, 3] = np.nan
    ys[:, 1] = lows
    ys[:, 2] = highs
    keep = np.empty((n, 4), dtype=bool)
    keep[:, 0] = lead | empty
    keep[:, 1] = keep[:, 2] = ~empty
    keep[:, 3] = trail
    return (np.concatenate((x[:head], xs[keep])), np.concatenate((y[:head], ys[keep])))
