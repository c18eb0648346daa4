"""A line chart written as a PNG with the standard library only (zlib + struct).

Enough for the demo's reward curve: axes, ticks, a legend and a few series, drawn with a
3x5 pixel font, so the demo needs no plotting package.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_FONT = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    "-": "000000111000000",
    "%": "101001010100101",
    "/": "001001010100100",
    ":": "000010000010000",
    "(": "010100100100010",
    ")": "010001001001010",
    " ": "000000000000000",
    "A": "010101111101101",
    "B": "110101110101110",
    "C": "011100100100011",
    "D": "110101101101110",
    "E": "111100110100111",
    "F": "111100110100100",
    "G": "011100101101011",
    "H": "101101111101101",
    "I": "111010010010111",
    "J": "001001001101010",
    "K": "101101110101101",
    "L": "100100100100111",
    "M": "101111111101101",
    "N": "110101101101101",
    "O": "010101101101010",
    "P": "110101110100100",
    "Q": "010101101110011",
    "R": "110101110101101",
    "S": "011100010001110",
    "T": "111010010010010",
    "U": "101101101101111",
    "V": "101101101101010",
    "W": "101101101111101",
    "X": "101101010101101",
    "Y": "101101010010010",
    "Z": "111001010100111",
}
WHITE, BLACK, GREY = (255, 255, 255), (40, 40, 40), (200, 200, 200)


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: tuple[int, int, int]
    markers: bool = False


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, thick: int = 1) -> None:
        """Bresenham's line, `thick` pixels wide."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                self.dot(x0, y0 + t, color)
                self.dot(x0 + t, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color=BLACK, scale: int = 2) -> None:
        for k, ch in enumerate(text.upper()):
            bits = _FONT.get(ch, _FONT[" "])
            for i, bit in enumerate(bits):
                if bit == "1":
                    for a in range(scale):
                        for b in range(scale):
                            self.dot(x + k * 4 * scale + (i % 3) * scale + a, y + (i // 3) * scale + b, color)

    def png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width]) for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")
        )


def line_chart(
    path: str | Path, series: Sequence[Series], title: str, x_label: str, width: int = 800, height: int = 450
) -> Path:
    """Draw `series` against shared axes (y from min(0, data) to max(1, data)) into a PNG."""
    c = Canvas(width, height)
    left, right, top, bottom = 60, width - 20, 50, height - 45
    xs = [x for s in series for x in s.xs] or [0.0, 1.0]
    ys = [y for s in series for y in s.ys] or [0.0, 1.0]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(0.0, min(ys)), max(1.0, max(ys))

    def px(x: float, y: float) -> tuple[int, int]:
        return (
            round(left + (x - x0) / (x1 - x0) * (right - left)),
            round(bottom - (y - y0) / (y1 - y0) * (bottom - top)),
        )

    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        _, yy = px(x0, y)
        c.line(left, yy, right, yy, GREY)
        c.text(8, yy - 5, f"{y:.2f}")
        x = x0 + (x1 - x0) * i / 4
        xx, _ = px(x, y0)
        c.line(xx, bottom, xx, bottom + 5, BLACK)
        c.text(xx - 10, bottom + 10, f"{x:.0f}")
    c.line(left, top, left, bottom, BLACK)
    c.line(left, bottom, right, bottom, BLACK)
    c.text(8, 8, title, BLACK, scale=3)
    c.text((left + right) // 2 - 4 * 2 * len(x_label) // 2, height - 16, x_label)
    legend_x = left + 10
    for s in series:
        points = [px(x, y) for x, y in zip(s.xs, s.ys, strict=False)]
        for (a, b), (d, e) in itertools.pairwise(points):
            c.line(a, b, d, e, s.color, thick=2)
        if s.markers:
            for a, b in points:
                for dx in range(-3, 4):
                    c.line(a + dx, b - 3, a + dx, b + 3, s.color)
        c.line(legend_x, top - 12, legend_x + 20, top - 12, s.color, thick=3)
        c.text(legend_x + 26, top - 16, s.label, s.color)
        legend_x += 26 + 8 * len(s.label) + 24
    out = Path(path)
    out.write_bytes(c.png())
    return out
