"""Preallocated numpy ring buffers for the HUD's time series.

Producers append rows; readers get the held rows oldest-first. Memory is allocated once, so a long session
costs the same as a short one, and appending never reallocates. A value that was not measured is stored as
NaN and stays NaN: the plots draw it as a gap, the exports write it as empty / null.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np


class RingTable:
    """A fixed-capacity table of float64 columns sharing one write position."""

    def __init__(self, capacity: int, columns: Sequence[str]):
        if capacity < 1:
            raise ValueError(f"ring capacity must be >= 1, got {capacity}")
        if len(set(columns)) != len(columns) or not columns:
            raise ValueError(f"ring columns must be distinct and non-empty, got {list(columns)}")
        self.capacity = int(capacity)
        self.columns = tuple(columns)
        self._index = {name: i for i, name in enumerate(self.columns)}
        self._data = np.full((self.capacity, len(self.columns)), np.nan, dtype=np.float64)
        self._next = 0  # row written next
        self.total = 0  # rows ever appended, including those overwritten since
        self.version = 0  # bumped on every change, so a painter can skip unchanged data

    def __len__(self) -> int:
        return min(self.total, self.capacity)

    @property
    def dropped(self) -> int:
        """Rows overwritten because the ring was full."""
        return self.total - len(self)

    def append(self, row: Sequence[Optional[float]]) -> None:
        self.extend(np.asarray([_as_row(row, len(self.columns))], dtype=np.float64))

    def extend(self, rows: np.ndarray | Iterable[Sequence[Optional[float]]]) -> None:
        """Append rows ([n, columns]); None becomes NaN. A block larger than the ring keeps its newest rows."""
        if not isinstance(rows, np.ndarray):
            rows = np.asarray([_as_row(r, len(self.columns)) for r in rows], dtype=np.float64)
        if rows.size == 0:
            return
        if rows.ndim != 2 or rows.shape[1] != len(self.columns):
            raise ValueError(f"expected rows of {len(self.columns)} columns, got shape {rows.shape}")
        n = rows.shape[0]
        self.total += n
        self.version += 1
        if n >= self.capacity:
            self._data[:] = rows[n - self.capacity :]
            self._next = 0
            return
        first = min(n, self.capacity - self._next)
        self._data[self._next : self._next + first] = rows[:first]
        if first < n:
            self._data[: n - first] = rows[first:]
        self._next = (self._next + n) % self.capacity

    def column(self, name: str, start: int = 0) -> np.ndarray:
        """The held values of one column, oldest first (a copy), from the `start`-th held row on."""
        return self._ordered(self._data[:, self._index[name]], start)

    def search(self, name: str, value: float) -> int:
        """How many held rows (oldest first) come before the first whose `name` is >= value; the column must
        be sorted oldest first, as times are. Reads the ring in place: no copy, O(log n)."""
        col = self._data[:, self._index[name]]
        if self.total < self.capacity:
            return int(np.searchsorted(col[: self.total], value))
        older, newer = col[self._next :], col[: self._next]  # the held rows are these two runs, in this order
        if older.size and older[-1] >= value:
            return int(np.searchsorted(older, value))
        return older.size + int(np.searchsorted(newer, value))

    def first(self, name: str) -> Optional[float]:
        """The oldest held value of a column, None when nothing is held or it was not measured."""
        if self.total == 0:
            return None
        v = self._data[self._next if self.total >= self.capacity else 0, self._index[name]]
        return None if np.isnan(v) else float(v)

    def rows(self) -> np.ndarray:
        """All held rows, oldest first (a copy), shape [len, columns]."""
        return self._ordered(self._data)

    def last(self, name: str) -> Optional[float]:
        """The newest held value of a column, None when nothing is held or it was not measured."""
        if self.total == 0:
            return None
        v = self._data[(self._next - 1) % self.capacity, self._index[name]]
        return None if np.isnan(v) else float(v)

    def clear(self) -> None:
        self._data.fill(np.nan)
        self._next = 0
        self.total = 0
        self.version += 1

    def _ordered(self, a: np.ndarray, start: int = 0) -> np.ndarray:
        if self.total < self.capacity:
            return a[start : self.total].copy()
        older = a[self._next :]
        if start >= len(older):
            return a[start - len(older) : self._next].copy()
        return np.concatenate((older[start:], a[: self._next]))


def _as_row(row: Sequence[Optional[float]], width: int) -> list[float]:
    if len(row) != width:
        raise ValueError(f"expected a row of {width} values, got {len(row)}")
    return [np.nan if v is None else float(v) for v in row]


def last_finite(values: np.ndarray) -> Optional[float]:
    """The newest measured (finite) value of a column, None when none was measured."""
    idx = np.flatnonzero(np.isfinite(values))
    return float(values[idx[-1]]) if idx.size else None
