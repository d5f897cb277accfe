"""Pictures of one ``PackedBatch``: a terminal rendering and a PNG.

Both show the same things: every row's cells coloured by segment with padding marked,
the inputs, targets and positions of one chosen row, its block-causal permission
matrix (exactly ``PackedBatch.permission(row)``), the fill ratio and the documents per
row. ``batch_text`` needs nothing beyond numpy (Unicode blocks, ANSI colours when
asked); ``batch_png`` draws with matplotlib, imported only when called (the ``plot``
extra).

Colours follow the segment ordinal: consecutive segments of a row always differ, and a
segment has the same colour in every panel. In the text, segments also alternate
between two glyphs (``█`` and ``▓``) so that boundaries stay visible without colour.

A batch with context-only cells (a supervision mask left their valid targets out of
the loss, rule C5: a prompt, say) says so: the header counts the supervised targets,
the text's cell table gains a ``trained`` line (``✓`` trained, ``-`` context only), and
the PNG draws a context-only cell in a pale tint of its segment's colour. A batch
without any (every unmasked batch) is drawn exactly as before masks existed.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from .batch import OCCURRENCE_DTYPE, PackedBatch
from .errors import InvalidConfig, InvalidCoordinate, StreampackError
from .examples import Binding

#: PNG colours, by segment ordinal modulo their number (matplotlib's tab10 without grey).
SEGMENT_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
)
PAD_COLOUR = "#d0d0d0"  # padding cells, and permission entries of a padding query or key
DENIED_COLOUR = "#ffffff"  # permission entries of two valid cells that may not attend
CONTEXT_TINT = 0.35  # a context-only cell: its segment's colour at this strength on white
BOUNDARY_COLOUR = "#000000"  # the line drawn where one segment ends and the next begins

#: ANSI foreground colours for segments (red, green, yellow, blue, magenta, cyan).
ANSI_SEGMENT = (31, 32, 33, 34, 35, 36)
ANSI_PAD = 90  # bright black (grey)
GLYPHS = ("█", "▓")
PAD_GLYPH = "░"

#: PNG geometry: a fixed width, rows and the permission panel stacked (inches at DPI).
DPI = 100
FIGURE_WIDTH_IN = 10.0
ROW_HEIGHT_IN = 0.6
PERMISSION_HEIGHT_IN = 5.0
TOP_IN, GAP_IN, BOTTOM_IN = 0.9, 0.9, 0.5
LEFT_IN, RIGHT_IN = 1.8, 0.3
ANNOTATE_MAX_CAPACITY = 24  # cells wider than this carry no text in the PNG

# -- shared description --------------------------------------------------------------


def documents_per_row(batch: PackedBatch) -> list[int]:
    """Occurrences (documents, or document pieces) in each row."""
    return np.bincount(batch.occurrences["row"], minlength=batch.rows).astype(int).tolist()


def fill_ratio(batch: PackedBatch) -> float:
    """Valid cells over all cells."""
    cells = batch.rows * batch.capacity
    return float(batch.valid_lengths.sum()) / cells if cells else 0.0


def _check_row(batch: PackedBatch, row: int) -> None:
    if not 0 <= row < batch.rows:
        raise InvalidCoordinate(f"row={row} is outside this batch; accepted: 0..{batch.rows - 1}")


def context_only(batch: PackedBatch) -> np.ndarray:
    """``[rows, capacity]``: cells with a valid target that is not trained (rule C5)."""
    return np.asarray(batch.target_valid & ~batch.loss_mask)


def _header(batch: PackedBatch, title: str) -> str:
    valid = int(batch.valid_lengths.sum())
    cells = batch.rows * batch.capacity
    kind = " (filler: all padding)" if batch.filler else ""
    supervised = ""
    if context_only(batch).any():
        supervised = (
            f", supervised targets {int(batch.loss_mask.sum())} of {int(batch.target_valid.sum())}"
        )
    return (
        f"{title}{kind}: {batch.rows} rows x {batch.capacity} cells, fill ratio "
        f"{fill_ratio(batch):.3f} ({valid} of {cells} cells), documents per row "
        f"{' '.join(map(str, documents_per_row(batch)))}{supervised}"
    )


# -- terminal --------------------------------------------------------------------------


class _Paint:
    """ANSI colouring that is a no-op when colour is off."""

    def __init__(self, colour: bool) -> None:
        self.colour = colour

    def segment(self, text: str, segment: int) -> str:
        if not self.colour:
            return text
        code = ANSI_PAD if segment < 0 else ANSI_SEGMENT[segment % len(ANSI_SEGMENT)]
        return f"\x1b[{code}m{text}\x1b[0m"

    def bold(self, text: str) -> str:
        return f"\x1b[1m{text}\x1b[0m" if self.colour else text


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` as lines of at most ``width`` characters, continuations indented."""
    return textwrap.wrap(
        text, width, subsequent_indent=indent + "    ", break_on_hyphens=False
    ) or [""]


def _glyph(segment: int) -> str:
    return PAD_GLYPH if segment < 0 else GLYPHS[segment % 2]


def _buckets(length: int, slots: int) -> list[tuple[int, int]]:
    """[start, stop) of ``min(length, slots)`` nearly equal consecutive pieces."""
    count = min(length, slots)
    edges = np.linspace(0, length, count + 1).round().astype(int)
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def _dominant(values: np.ndarray) -> int:
    kinds, counts = np.unique(values, return_counts=True)
    return int(kinds[np.argmax(counts)])


def _strip(batch: PackedBatch, row: int, slots: int, paint: _Paint) -> str:
    segments = batch.segments[row]
    out = []
    for start, stop in _buckets(batch.capacity, slots):
        segment = _dominant(segments[start:stop])
        out.append(paint.segment(_glyph(segment), segment))
    return "".join(out)


def _cells_table(batch: PackedBatch, row: int, width: int, paint: _Paint) -> list[str]:
    valid = batch.input_valid[row]
    columns = {
        "column": [str(c) for c in range(batch.capacity)],
        "segment": [str(s) if v else "·" for s, v in zip(batch.segments[row], valid)],
        "input": [str(t) if v else "·" for t, v in zip(batch.inputs[row], valid)],
        "target": [
            str(t) if v else "·" for t, v in zip(batch.targets[row], batch.target_valid[row])
        ],
        "position": [str(p) if v else "·" for p, v in zip(batch.positions[row], valid)],
    }
    if context_only(batch).any():  # only a masked batch has a line to show here
        columns["trained"] = [
            "✓" if trained else "-" if target else "·"
            for trained, target in zip(batch.loss_mask[row], batch.target_valid[row])
        ]
    cell_width = max(len(text) for values in columns.values() for text in values) + 1
    label_width = 2 + max(map(len, columns)) + 1
    shown = max(1, min(batch.capacity, (width - label_width) // cell_width))
    lines = []
    for name, values in columns.items():
        cells = []
        for c in range(shown):
            text = values[c].rjust(cell_width)
            cells.append(
                text if name == "column" else paint.segment(text, int(batch.segments[row, c]))
            )
        lines.append(f"  {name:<{label_width - 3}} " + "".join(cells))
    if shown < batch.capacity:
        lines += _wrap(
            f"  ... columns {shown}..{batch.capacity - 1} not shown "
            f"(the segments below cover them)",
            width,
        )
    return lines


def _segments_legend(
    batch: PackedBatch, row: int, width: int, paint: _Paint, limit: int = 24
) -> list[str]:
    occ = batch.occurrences[batch.occurrences["row"] == row]
    lines = []
    for record in occ[:limit]:
        segment, start, stop = int(record["segment"]), int(record["start"]), int(record["stop"])
        swatch = paint.segment(_glyph(segment) * 2, segment)
        text = (
            f"segment {segment}: columns [{start}, {stop}), document "
            f"{int(record['source_id'])} of source {int(record['source'])} (example "
            f"{int(record['example_id'])}), range [{int(record['range_start'])}, "
            f"{int(record['range_stop'])}), positions "
            f"0..{stop - start - 1}"
        )
        wrapped = _wrap(text, width - 5, "     ")
        lines.append(f"  {swatch} {wrapped[0]}")
        lines += wrapped[1:]
    if len(occ) > limit:
        lines.append(f"  ... {len(occ) - limit} more segments")
    valid = int(batch.valid_lengths[row])
    if valid < batch.capacity:
        lines.append(
            f"  {paint.segment(PAD_GLYPH * 2, -1)} padding: columns [{valid}, {batch.capacity})"
        )
    return lines


def _permission(batch: PackedBatch, row: int, width: int, paint: _Paint) -> list[str]:
    allowed = batch.permission(row)
    capacity = batch.capacity
    label = len(str(capacity - 1))
    side = max(1, min(capacity, (width - label - 4) // 2, 40))
    pieces = _buckets(capacity, side)
    one_cell = len(pieces) == capacity
    lines = []
    if one_cell:
        lines.append(" " * (label + 3) + " ".join(str(c % 10) for c in range(capacity)))
    else:
        most = max(b - a for a, b in pieces)
        lines += _wrap(
            f"  (each character covers up to {most} x {most} entries: █ all "
            f"allowed, ▒ some, · none)",
            width,
        )
    for q0, q1 in pieces:
        segment = _dominant(batch.segments[row, q0:q1])
        cells = []
        for k0, k1 in pieces:
            block = allowed[q0:q1, k0:k1]
            if block.all():
                mark = "■" if one_cell else "█"
            elif block.any():
                mark = "▒"
            else:
                mark = "·"
            cells.append(paint.segment(mark, segment) if mark != "·" else mark)
        name = str(q0) if one_cell else f"{q0}"
        lines.append(f"  {name.rjust(label)} " + " ".join(cells))
    return lines


def batch_text(
    batch: PackedBatch,
    *,
    row: int = 0,
    title: str = "batch",
    width: int = 100,
    colour: bool = False,
) -> str:
    """The terminal picture of ``batch`` (see the module docstring), at most ``width``
    columns wide when colour codes are not counted. ``row`` is the row shown in detail."""
    _check_row(batch, row)
    if width < 40:
        raise InvalidConfig(f"width={width} is too narrow; accepted: >= 40 columns")
    paint = _Paint(colour)
    b = batch.binding
    lines = [paint.bold(line) for line in _wrap(_header(batch, title), width)]
    lines += _wrap(
        f"binding: vocab_size {b.vocab_size}, tokenizer {b.tokenizer}, "
        f"split_receipt {b.split_receipt}, partition {b.partition}",
        width,
    )
    lines.append("")
    per_row = documents_per_row(batch)
    label = len(str(batch.rows - 1))
    tail = len(f"  {max(per_row, default=0)} docs  {batch.capacity}/{batch.capacity}")
    slots = width - (8 + label) - tail  # "> row R  " before the strip
    cells_per_char = -(-batch.capacity // min(batch.capacity, slots))
    scale = (
        "one character per cell"
        if cells_per_char == 1
        else f"one character per {cells_per_char} cells, the most common segment"
    )
    lines += _wrap(
        f"rows ({scale}; {GLYPHS[0]}/{GLYPHS[1]} alternate segments, {PAD_GLYPH} padding)", width
    )
    for r in range(batch.rows):
        docs = f"{per_row[r]} doc{'s' if per_row[r] != 1 else ' '}"
        mark = ">" if r == row else " "
        lines.append(
            f"{mark} row {str(r).rjust(label)}  {_strip(batch, r, slots, paint)}  "
            f"{docs}  {int(batch.valid_lengths[r])}/{batch.capacity}"
        )
    key = " (trained: ✓ in the loss, - context only)" if context_only(batch).any() else ""
    lines += ["", f"row {row}: cells{key}"]
    lines += _cells_table(batch, row, width, paint)
    lines += ["", f"row {row}: segments"]
    lines += _segments_legend(batch, row, width, paint)
    lines.append("")
    lines += _wrap(
        f"row {row}: permission({row}), query down, key across "
        f"(■ allowed: same segment, key not later; · not)",
        width,
    )
    lines += _permission(batch, row, width, paint)
    return "\n".join(lines) + "\n"


# -- PNG -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PngLayout:
    """Where things landed in a PNG ``batch_png`` wrote, in pixels from the top left."""

    width: int
    height: int
    cells: tuple[float, float, float, float]  # left, top, right, bottom of the row grid
    permission: tuple[float, float, float, float]  # the same for the permission matrix
    rows: int
    capacity: int

    def cell_point(self, row: int, column: float, fy: float = 0.5) -> tuple[int, int]:
        """Pixel (x, y) at ``column`` (fractional: 3.0 is the boundary before cell 3)
        and fraction ``fy`` of the height of ``row`` in the row grid."""
        left, top, right, bottom = self.cells
        x = left + (right - left) * column / self.capacity
        y = top + (bottom - top) * (row + fy) / self.rows
        return int(x), int(y)

    def permission_point(self, query: int, key: int) -> tuple[int, int]:
        """Pixel (x, y) at the centre of permission entry (query, key)."""
        left, top, right, bottom = self.permission
        x = left + (right - left) * (key + 0.5) / self.capacity
        y = top + (bottom - top) * (query + 0.5) / self.capacity
        return int(x), int(y)


def png_size(rows: int) -> tuple[int, int]:
    """(width, height) in pixels of the PNG of a batch with ``rows`` rows."""
    height = TOP_IN + rows * ROW_HEIGHT_IN + GAP_IN + PERMISSION_HEIGHT_IN + BOTTOM_IN
    return round(FIGURE_WIDTH_IN * DPI), round(height * DPI)


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def segment_rgb(segment: int) -> tuple[float, float, float]:
    """The PNG colour of a segment ordinal (``-1``: padding)."""
    if segment < 0:
        return _rgb(PAD_COLOUR)
    return _rgb(SEGMENT_COLOURS[segment % len(SEGMENT_COLOURS)])


def _import_pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise StreampackError(
            "the PNG picture needs matplotlib; install it with: pip install 'streampack[plot]'"
        ) from error
    return plt


def batch_png(
    batch: PackedBatch, path: str | Path, *, row: int = 0, title: str = "batch"
) -> PngLayout:
    """Write the picture of ``batch`` to ``path`` (PNG) and say where its parts are.

    Top: every row, one box per cell in its segment's colour (pale where the cell's
    target is context only, not trained), padding grey, a black line at each boundary
    between segments, and (for small capacities) each cell's input→target and position.
    Bottom: ``permission(row)``, an allowed entry in the colour of its segment, a denied
    one white, one with a padding query or key grey.
    """
    _check_row(batch, row)
    plt = _import_pyplot()
    width_px, height_px = png_size(batch.rows)
    width_in, height_in = width_px / DPI, height_px / DPI
    figure = plt.figure(figsize=(width_in, height_in), dpi=DPI)
    try:
        grid = _draw_rows(figure, batch, width_in, height_in)
        _draw_captions(figure, batch, title, height_in)
        perm = _draw_permission(figure, batch, row, width_in, height_in)
        figure.savefig(path, dpi=DPI, format="png")

        def box(axes: Any) -> tuple[float, float, float, float]:
            x0, y0, x1, y1 = axes.get_position().extents  # figure fractions, origin bottom
            return (x0 * width_px, (1 - y1) * height_px, x1 * width_px, (1 - y0) * height_px)

        return PngLayout(
            width=width_px,
            height=height_px,
            cells=box(grid),
            permission=box(perm),
            rows=batch.rows,
            capacity=batch.capacity,
        )
    finally:
        plt.close(figure)


def _palette() -> np.ndarray:
    """Segment colours by ordinal modulo their number; the last entry (index -1) padding."""
    return np.array([segment_rgb(s) for s in range(len(SEGMENT_COLOURS))] + [segment_rgb(-1)])


def _segment_colours(segments: np.ndarray) -> np.ndarray:
    """``[..., 3]`` RGB of each cell's segment (padding grey)."""
    return _palette()[np.where(segments < 0, -1, segments % len(SEGMENT_COLOURS))]


def cell_colours(batch: PackedBatch) -> np.ndarray:
    """``[rows, capacity, 3]``: the PNG colour of every cell, context-only ones pale."""
    colours = _segment_colours(batch.segments)
    pale = CONTEXT_TINT * colours + (1 - CONTEXT_TINT)
    return np.where(context_only(batch)[..., None], pale, colours)


def _draw_rows(figure: Any, batch: PackedBatch, width_in: float, height_in: float) -> Any:
    """The row grid: cells in their colours, segment boundaries, row labels, and for
    small capacities each cell's text."""
    rows, capacity, seg = batch.rows, batch.capacity, batch.segments
    grid_w = width_in - LEFT_IN - RIGHT_IN
    grid_h = rows * ROW_HEIGHT_IN
    grid = figure.add_axes(
        (
            LEFT_IN / width_in,
            1 - (TOP_IN + grid_h) / height_in,
            grid_w / width_in,
            grid_h / height_in,
        )
    )
    grid.imshow(
        cell_colours(batch), aspect="auto", interpolation="nearest", extent=(0, capacity, rows, 0)
    )
    per_row = documents_per_row(batch)
    grid.set_yticks(
        [r + 0.5 for r in range(rows)],
        [
            f"row {r}: {per_row[r]} doc{'s' if per_row[r] != 1 else ''}, "
            f"{int(batch.valid_lengths[r])}/{capacity}"
            for r in range(rows)
        ],
        fontsize=8,
    )
    grid.set_xlabel("column", fontsize=8)
    grid.tick_params(axis="x", labelsize=7)
    line_width = 3 * 72 / DPI  # 3 pixels, in points
    for r in range(rows):
        columns = np.flatnonzero(seg[r, 1:] != seg[r, :-1]) + 1
        for column in columns:
            grid.plot(
                [column, column],
                [r, r + 1],
                color=BOUNDARY_COLOUR,
                linewidth=line_width,
                solid_capstyle="butt",
            )
        if r:
            grid.axhline(r, color="#ffffff", linewidth=line_width)
    if capacity <= ANNOTATE_MAX_CAPACITY:
        for r in range(rows):
            for c in range(capacity):
                if batch.input_valid[r, c]:
                    target = str(batch.targets[r, c]) if batch.target_valid[r, c] else "·"
                    text = f"{batch.inputs[r, c]}→{target}\npos {batch.positions[r, c]}"
                else:
                    text = "pad"
                grid.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=7)
    grid.set_xlim(0, capacity)
    grid.set_ylim(rows, 0)
    return grid


def _draw_captions(figure: Any, batch: PackedBatch, title: str, height_in: float) -> None:
    """The header line and the key to the row grid's colours."""
    figure.text(
        0.5, 1 - 0.3 / height_in, _header(batch, title), ha="center", va="center", fontsize=9
    )
    figure.text(
        0.5,
        1 - 0.6 / height_in,
        "cells coloured by segment (consecutive segments differ), grey = padding, "
        "black line = segment boundary"
        + ("; pale = context only (not trained)" if context_only(batch).any() else "")
        + (
            "; each cell: input→target, position" if batch.capacity <= ANNOTATE_MAX_CAPACITY else ""
        ),
        ha="center",
        va="center",
        fontsize=8,
    )


def _draw_permission(
    figure: Any, batch: PackedBatch, row: int, width_in: float, height_in: float
) -> Any:
    """``permission(row)``: allowed in the query's segment colour, denied white, an
    entry with a padding query or key grey."""
    capacity = batch.capacity
    allowed = batch.permission(row)
    query_seg = np.broadcast_to(batch.segments[row][:, None], allowed.shape)
    both_valid = batch.input_valid[row][:, None] & batch.input_valid[row][None, :]
    perm_rgb = np.where(
        allowed[..., None],
        _segment_colours(query_seg),
        np.where(both_valid[..., None], np.array(_rgb(DENIED_COLOUR)), _palette()[-1]),
    )
    grid_w = width_in - LEFT_IN - RIGHT_IN
    side = min(PERMISSION_HEIGHT_IN, grid_w)
    perm_left = LEFT_IN + (grid_w - side) / 2
    perm_bottom = BOTTOM_IN + (PERMISSION_HEIGHT_IN - side)
    perm = figure.add_axes(
        (perm_left / width_in, perm_bottom / height_in, side / width_in, side / height_in)
    )
    perm.imshow(perm_rgb, aspect="auto", interpolation="nearest", extent=(0, capacity, capacity, 0))
    perm.set_title(
        f"row {row}: permission({row}), query (down) may use key (across); "
        "colour = allowed, white = denied, grey = padding",
        fontsize=8,
    )
    perm.set_xlabel("key column", fontsize=8)
    perm.set_ylabel("query column", fontsize=8)
    perm.tick_params(labelsize=7)
    perm.set_xlim(0, capacity)
    perm.set_ylim(capacity, 0)
    return perm


# -- a batch on disk -------------------------------------------------------------------


def save_batch(batch: PackedBatch, path: str | Path) -> None:
    """Write ``batch`` (every array, its occurrences, binding and filler flag) as .npz."""
    meta = {"binding": batch.binding.as_dict(), "filler": bool(batch.filler)}
    arrays = {name: getattr(batch, name) for name in batch.ARRAY_FIELDS}
    with open(path, "wb") as handle:
        np.savez(handle, occurrences=batch.occurrences, meta=np.array(json.dumps(meta)), **arrays)


def load_batch(path: str | Path) -> PackedBatch:
    """The batch ``save_batch`` wrote (no pickled objects are read)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {name: data[name] for name in PackedBatch.ARRAY_FIELDS}
            occurrences = data["occurrences"]
    except (OSError, KeyError, ValueError) as exc:
        raise InvalidConfig(f"{str(path)!r} is not a batch saved by streampack: {exc}") from None
    if occurrences.dtype != OCCURRENCE_DTYPE:
        raise InvalidConfig(f"{str(path)!r}: occurrences have dtype {occurrences.dtype}")
    return PackedBatch(
        **arrays,
        occurrences=occurrences,
        binding=Binding(**meta["binding"]),
        filler=bool(meta["filler"]),
    )
