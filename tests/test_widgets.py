import ipywidgets as W
import matplotlib.pyplot as plt

from lib.book.widgets import slider_plot


def figure(k):
    fig, ax = plt.subplots()
    ax.plot(range(k))
    return fig


def test_one_slider_precomputes_every_position_as_an_image():
    box = slider_plot(figure, {"k": [1, 2, 3]}, initial={"k": 2})
    slider, stack = box.children
    assert isinstance(slider, W.SelectionSlider) and [type(c) for c in stack.children] == [W.Image] * 3
    assert slider.value == 2 and stack.selected_index == 1
    assert all(bytes(c.value[:4]) == b"\x89PNG" for c in stack.children)


def test_two_sliders_nest_stacks_and_text_becomes_html():
    box = slider_plot(lambda a, b: f"{a}-{b}<", {"a": [1, 2], "b": ["x", "y", "z"]}, initial={"b": "z"})
    s1, s2, outer = box.children
    assert len(outer.children) == 2 and all(len(inner.children) == 3 for inner in outer.children)
    assert "1-z&lt;" in outer.children[0].children[2].value  # escaped
    assert all(inner.selected_index == 2 for inner in outer.children)

