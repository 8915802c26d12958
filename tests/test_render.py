"""perflab.render: tables as text and HTML, the provenance line and its JSON round trip, figure footers."""

import json

import matplotlib.pyplot as plt
import pytest
import torch
from perflab.render import Environment, Markup, Table, add_footer

WHERE = Environment("cpu", "AMD EPYC 7B13", "2.14.1", 2, "3.11.7", "2026-11-24", "40eb828")


def test_text_columns_are_as_wide_as_their_widest_cell_and_the_caption_comes_last():
    table = Table(("name", "samples/s"), [("naive", "1,200"), ("decoded once", 98)], caption="median of 5")
    assert str(table).splitlines() == [
        "name          samples/s",
        "naive         1,200",
        "decoded once  98",
        "median of 5",
    ]


def test_numeric_columns_align_right_in_text_and_html():
    table = Table(("name", "samples/s"), [("naive", "1,200"), ("cached", "98")], numeric=(1,))
    assert str(table).splitlines() == ["name    samples/s", "naive       1,200", "cached         98"]
    assert '<td style="text-align:right">98</td>' in table._repr_html_()
    assert "<td>cached</td>" in table._repr_html_()


def test_html_escapes_every_cell_header_and_caption_line():
    table = Table(("a<b",), [("x & y",), ("<script>",)], caption="first <line>\nsecond & last")
    html = table._repr_html_()
    assert "<th>a&lt;b</th>" in html and "<td>x &amp; y</td>" in html and "<td>&lt;script&gt;</td>" in html
    assert "<caption>first &lt;line&gt;<br>second &amp; last</caption>" in html
    assert "<script>" not in html


def test_markup_cells_keep_their_html_and_show_their_text_in_a_terminal():
    bits = Markup("0 111", "<span>0</span> <span>111</span>")
    table = Table(("bits",), [(bits,)])
    assert str(table) == "bits\n0 111"
    assert "<td><span>0</span> <span>111</span></td>" in table._repr_html_()


def test_a_table_without_header_has_no_header_row_and_coloured_rows_stay_readable():
    table = Table((), [("verdict", "PASS"), ("why", "fast")], row_colours=("#b8e2b0", ""))
    html = table._repr_html_()
    assert "<th>" not in html and html.count("<tr") == 2
    assert '<tr style="background:#b8e2b0;color:#000"><td>verdict</td>' in html and "<tr><td>why</td>" in html
    assert str(table) == "verdict  PASS\nwhy      fast"


def test_rows_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="as many cells as the header"):
        Table(("a", "b"), [("only one",)])
    with pytest.raises(ValueError, match="row colours"):
        Table(("a",), [("x",), ("y",)], row_colours=("#fff",))


def test_environment_prints_one_line_and_survives_json():
    assert str(WHERE) == "cpu (AMD EPYC 7B13, 2 threads), torch 2.14.1, Python 3.11.7, 2026-11-24, commit 40eb828"
    assert Environment.from_dict(json.loads(json.dumps(WHERE.to_dict()))) == WHERE


def test_environment_captures_this_process():
    here = Environment.capture(torch.device("cpu"))
    assert here.device == "cpu" and here.torch == torch.__version__ and here.threads == torch.get_num_threads()
    assert here.commit  # a short hash in a checkout, "unknown" elsewhere
    assert str(here).startswith(f"cpu ({here.device_name}, ")


def test_footer_writes_the_text_at_the_bottom_of_the_figure():
    figure, ax = plt.subplots(figsize=(6, 4))
    ax.plot([0, 1], [0, 1])
    add_footer(figure, f"measured on {WHERE}")
    (footer,) = figure.texts
    assert footer.get_text() == f"measured on {WHERE}" and footer.get_position()[1] < 0.01
    figure.canvas.draw()
    assert ax.get_tightbbox().y0 > footer.get_window_extent().y1  # the axes' labels stay above the footer
    plt.close(figure)


def test_a_footer_wider_than_its_figure_wraps_and_leaves_room_for_every_line():
    figure, ax = plt.subplots(figsize=(3, 3))
    add_footer(figure, f"median of 5 rounds interleaved epoch by epoch on {WHERE}; labels: share of the ceiling")
    (footer,) = figure.texts
    figure.canvas.draw()
    assert footer.get_window_extent().height > 2 * footer.get_fontsize()  # three lines or more: wrapped
    assert footer.get_window_extent().x1 <= figure.bbox.x1
    assert ax.get_tightbbox().y0 > footer.get_window_extent().y1
    plt.close(figure)


def test_one_thread_is_singular():
    assert "(AMD EPYC 7B13, 1 thread)," in str(Environment("cpu", "AMD EPYC 7B13", "2.14.1", 1, "3.11.7", "d", "c"))
