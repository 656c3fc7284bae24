"""Line charts as inline SVG, drawn on the server: the dashboard needs no chart library and
no CDN, and a chart is plain markup that a test can read."""

from __future__ import annotations

import dataclasses
import math

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 360, 140
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 44, 8, 20, 18


@dataclasses.dataclass(frozen=True)
class Series:
    label: str
    color: str
    # (x, y) with x in 0..1 across the chart's width (None y: no value there, a gap).
    points: list[tuple[float, float | None]]


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above `value` (> 0)."""
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * 10**exponent >= value:
            return step * 10**exponent
    return 10 ** (exponent + 1)


def _format(value: float, unit: str) -> str:
    """A figure for people: three significant digits (0.701 s, 12.3 s, 4.5 min)."""
    if unit == "s" and value >= 120:
        return f"{value / 60:.1f} min"
    if unit == "s" and 0 < value < 0.001:
        return f"{value * 1000:.3g} ms"
    text = f"{value:.0f}" if value >= 100 else f"{value:.3g}"  # never 1.23e+03
    return f"{text}{' ' + unit if unit else ''}"


def line_chart(*, title: str, series: list[Series], unit: str = "", x_label: str) -> SafeString:
    """An SVG chart of `series` on one y axis from 0 to a round maximum; each series is a
    polyline (broken where it has no value) with `data-series` and `data-max` attributes."""
    values = [y for s in series for _, y in s.points if y is not None]
    top = _nice_ceiling(max(values)) if values and max(values) > 0 else 1.0
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def xy(x: float, y: float) -> str:
        return f"{PAD_LEFT + x * plot_w:.1f},{PAD_TOP + plot_h - y / top * plot_h:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}" '
        f'class="chart" data-top="{top:g}">',
        f'<text x="{PAD_LEFT}" y="13" class="title">{escape(title)}</text>',
        f'<line x1="{PAD_LEFT}" y1="{PAD_TOP + plot_h}" x2="{WIDTH - PAD_RIGHT}" '
        f'y2="{PAD_TOP + plot_h}" class="axis"/>',
        f'<line x1="{PAD_LEFT}" y1="{PAD_TOP}" x2="{PAD_LEFT}" y2="{PAD_TOP + plot_h}" '
        'class="axis"/>',
        f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 4}" text-anchor="end">'
        f"{escape(_format(top, unit))}</text>",
        f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + plot_h}" text-anchor="end">0</text>',
        f'<text x="{WIDTH - PAD_RIGHT}" y="{HEIGHT - 4}" text-anchor="end">'
        f"{escape(x_label)}</text>",
    ]
    for n, s in enumerate(series):
        present = [y for _, y in s.points if y is not None]
        peak = max(present) if present else 0
        segments, current = [], []
        for x, y in s.points:
            if y is None:
                if current:
                    segments.append(current)
                current = []
            else:
                current.append(xy(x, y))
        if current:
            segments.append(current)
        for segment in segments:
            if len(segment) == 1:  # a lone value: a dot
                cx, cy = segment[0].split(",")
                parts.append(
                    f'<circle cx="{cx}" cy="{cy}" r="2" fill="{s.color}" '
                    f'data-series="{escape(s.label)}" data-max="{peak:g}"/>'
                )
            else:
                parts.append(
                    f'<polyline fill="none" stroke="{s.color}" stroke-width="1.5" '
                    f'points="{" ".join(segment)}" data-series="{escape(s.label)}" '
                    f'data-max="{peak:g}"/>'
                )
        # The legend names the series and its peak; its colour inline, as the page's
        # stylesheet sets every chart text's fill.
        legend = f"{s.label}: peak {_format(peak, unit)}" if present else f"{s.label}: none"
        parts.append(
            f'<text x="{PAD_LEFT + 8 + n * 130}" y="{PAD_TOP + 10}" style="fill: {s.color}">'
            f"{escape(legend)}</text>"
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every interpolated text is escaped
