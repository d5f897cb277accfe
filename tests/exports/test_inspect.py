"""``streampack inspect``: the terminal picture against a golden text, the PNG's pixels.

The PNG is read back with matplotlib's own image reader and checked where its parts
must be: the size the layout promises, padding cells grey, a black line exactly on a
segment boundary with each side in its segment's colour, and the permission panel
showing ``permission(row)`` entry by entry.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from streampack import render
from streampack.cli import main as cli_main
from streampack.errors import StreampackError
from streampack.service.inspect_batch import corpus_batch, worked_example

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "fixtures" / "seed" / "inspect.txt"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def example():
    return worked_example(None)


def test_terminal_view_of_the_worked_example_matches_the_golden_text(capsys):
    # Through the real command: stdout is captured (not a terminal), so no colour codes.
    assert cli_main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert out == GOLDEN.read_text()


def test_colour_codes_only_decorate_the_same_text(capsys):
    assert cli_main(["inspect", "--color"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[31m" in out and "\x1b[32m" in out  # segments 0 and 1 of row 0
    assert ANSI.sub("", out) == GOLDEN.read_text()
    assert cli_main(["inspect", "--color", "--no-color"]) == 0
    assert "\x1b[" not in capsys.readouterr().out


def test_text_of_a_wide_batch_fits_the_width_and_names_every_segment():
    batch = corpus_batch(_corpus_settings(), 0, 3)
    for width in (100, 60):
        text = render.batch_text(batch, row=3, width=width)
        assert max(len(line) for line in text.splitlines()) <= width
    text = render.batch_text(batch, row=3)
    occ = batch.occurrences[batch.occurrences["row"] == 3]
    for record in occ:
        assert f"segment {record['segment']}: columns [{record['start']}, {record['stop']})" in text
    assert f"fill ratio {render.fill_ratio(batch):.3f}" in text
    per_row = " ".join(map(str, np.bincount(batch.occurrences["row"], minlength=batch.rows)))
    assert f"documents per row {per_row}" in text


def _corpus_settings():
    from streampack.settings import ProducerSettings

    return ProducerSettings(
        corpus=str(ROOT / "fixtures" / "corpus"),
        capacity=256,
        max_rows_per_batch=4,
        window_documents=40,
        window_tokens=3000,
    )


def _close(pixel: np.ndarray, hex_colour: str) -> bool:
    return bool(np.abs(pixel[:3] - np.array(render._rgb(hex_colour))).max() <= 1.5 / 255)


def test_png_has_its_size_and_the_colours_of_padding_boundaries_and_permission(tmp_path, example):
    from matplotlib.image import imread

    path = tmp_path / "batch.png"
    layout = render.batch_png(example, path, row=0)
    image = imread(path)
    # 10 in x (0.9 + 2 rows x 0.6 + 0.9 + 5 + 0.5) in at 100 dpi.
    assert render.png_size(2) == (1000, 850)
    assert image.shape[:2] == (850, 1000)
    assert (layout.width, layout.height) == (1000, 850)

    def at(point: tuple[int, int]) -> np.ndarray:
        x, y = point
        return image[y, x]

    blue, orange, green = render.SEGMENT_COLOURS[:3]
    pad = render.PAD_COLOUR
    # Row 0 is A A A B B pad; row 1 is C C C C pad pad. Sample off the cell texts.
    for row, colours in ((0, [blue] * 3 + [orange] * 2 + [pad]), (1, [green] * 4 + [pad] * 2)):
        for column, colour in enumerate(colours):
            assert _close(at(layout.cell_point(row, column + 0.12, 0.8)), colour), (row, column)
    # Boundaries: A|B at column 3 and B|pad at 5 of row 0, C|pad at 4 of row 1 are black;
    # the inside of segment A (column 2.0 of row 0) is not.
    for row, column in ((0, 3.0), (0, 5.0), (1, 4.0)):
        assert _close(at(layout.cell_point(row, column, 0.8)), render.BOUNDARY_COLOUR)
    assert _close(at(layout.cell_point(0, 2.0, 0.8)), blue)
    # The permission panel is permission(0), entry by entry.
    allowed = example.permission(0)
    colour_of_segment = {0: blue, 1: orange}
    for query in range(example.capacity):
        for key in range(example.capacity):
            pixel = at(layout.permission_point(query, key))
            if allowed[query, key]:
                expected = colour_of_segment[int(example.segments[0, query])]
            elif example.input_valid[0, query] and example.input_valid[0, key]:
                expected = render.DENIED_COLOUR
            else:
                expected = pad
            assert _close(pixel, expected), (query, key, pixel)


def test_png_of_a_chosen_row_and_a_wide_batch(tmp_path):
    from matplotlib.image import imread

    batch = corpus_batch(_corpus_settings(), 0, 3)
    path = tmp_path / "wide.png"
    layout = render.batch_png(batch, path, row=1)
    image = imread(path)
    assert image.shape[:2] == render.png_size(4)[::-1] == (970, 1000)
    last = int(batch.valid_lengths[1])
    x, y = layout.permission_point(last, last)  # a padding query: grey
    assert _close(image[y, x], render.PAD_COLOUR)


def test_png_without_matplotlib_names_the_extra(tmp_path, example, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(StreampackError, match=r"pip install 'streampack\[plot\]'"):
        render.batch_png(example, tmp_path / "x.png")


def test_a_saved_batch_renders_like_the_original(tmp_path, example, capsys):
    path = tmp_path / "batch.npz"
    render.save_batch(example, path)
    loaded = render.load_batch(path)
    assert loaded.digest() == example.digest()
    assert np.array_equal(loaded.occurrences, example.occurrences)
    assert render.batch_text(loaded) == render.batch_text(example)
    assert cli_main(["inspect", "--batch-file", str(path), "--row", "1"]) == 0
    assert "row 1: permission(1)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "--row", "2"], "--row 2; this batch has rows 0..1"),
        (
            ["inspect", "--corpus", str(ROOT / "fixtures" / "corpus"), "--batch", "100000"],
            "--batch 100000; epoch 0",
        ),
    ],
)
def test_bad_choices_are_one_clear_line(argv, message, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_the_readme_shows_the_golden_rendering_and_links_the_committed_png():
    readme = (ROOT / "README.md").read_text()
    assert "$ streampack inspect\n" + GOLDEN.read_text() in readme
    assert "(docs/inspect-worked-example.png)" in readme
    from matplotlib.image import imread

    assert imread(ROOT / "docs" / "inspect-worked-example.png").shape[:2] == (850, 1000)


# -- supervision masks: context-only cells are drawn apart from trained ones (C5) -----------

MASKED_GOLDEN = ROOT / "fixtures" / "seed" / "inspect-masked.txt"


@pytest.fixture(scope="module")
def masked_example():
    import streampack as sp
    from streampack.trace import find_fixture, load_worked_example

    examples, binding, config, _ = load_worked_example(find_fixture(None))
    # The worked example as prompt-then-response: A trains 100 and EOS, B its EOS, C
    # 102, 104 and EOS (the masks of tests/_packing_cases.py).
    masks = np.array([0, 0, 1, 1] + [1, 0, 1] + [0, 1, 0, 1, 1], np.uint8)
    masked = sp.Examples(
        tokens=examples.tokens,
        offsets=examples.offsets,
        doc=examples.doc,
        start=examples.start,
        stop=examples.stop,
        mask=masks,
    )
    return sp.pack_examples(masked, binding, config).batches[0]


def test_terminal_view_of_a_masked_batch_marks_context_only_targets(
    tmp_path, masked_example, capsys
):
    text = render.batch_text(masked_example, title="the worked example, prompts masked")
    assert text == MASKED_GOLDEN.read_text()
    assert "  trained     -   ✓   ✓   -   ✓   ·" in text.splitlines()
    assert "supervised targets 6 of 9" in text
    path = tmp_path / "masked.npz"
    render.save_batch(masked_example, path)
    assert cli_main(["inspect", "--batch-file", str(path), "--row", "1"]) == 0
    out = capsys.readouterr().out
    assert "  trained     ✓   -   ✓   ✓   ·   ·" in out.splitlines()


def test_png_of_a_masked_batch_draws_context_only_cells_pale(tmp_path, masked_example, example):
    from matplotlib.image import imread

    path = tmp_path / "masked.png"
    layout = render.batch_png(masked_example, path, row=0)
    image = imread(path)
    blue, orange, green = (np.array(render._rgb(c)) for c in render.SEGMENT_COLOURS[:3])

    def pale(colour):
        return render.CONTEXT_TINT * colour + (1 - render.CONTEXT_TINT)

    context = render.context_only(masked_example)
    assert context.tolist() == [
        [True, False, False, True, False, False],
        [False, True, False, False, False, False],
    ]
    colours = {0: blue, 1: orange, 2: green}
    for row in range(2):
        for column in range(int(masked_example.valid_lengths[row])):
            segment = int(masked_example.segments[row, column])
            want = pale(colours[segment]) if context[row, column] else colours[segment]
            x, y = layout.cell_point(row, column + 0.12, 0.8)
            assert np.abs(image[y, x][:3] - want).max() <= 1.5 / 255, (row, column)
    # An unmasked batch has no context-only cell: its picture is the one it always was.
    assert not render.context_only(example).any()
    np.testing.assert_array_equal(
        render.cell_colours(example), render._segment_colours(example.segments)
    )
