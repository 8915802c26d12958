"""Explorers: drag a control, see a measurement or an exact calculation change.

    >>> from perflab.train import Workload
    >>> from perflab.widgets import data_loading_explorer, float_format_explorer, training_memory_explorer
    >>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=2)
    >>> loading = data_loading_explorer(tiny, steps=2)   # workers, batch size, pinned memory, caching -> samples/s
    >>> list(loading.controls)
    ['pipeline', 'batch_size', 'num_workers', 'pin_memory']
    >>> loading.text                 # its plain-text form: the latest measurement
    'pil, batch 32, 0 workers, pin_memory False: ... samples/s, waiting for data ...% of the time'
    >>> print(float_format_explorer(0.1).text)   # a number -> its fp32 / TF32 / bf16 / fp16 bits, rounding error
    format    stored value         bits (sign exponent mantissa)       relative error  flags
    float32   0.10000000149011612  0 01111011 10011001100110011001101  1.5e-08
    tfloat32  0.0999755859375      0 01111011 1001100110               2.4e-04
    bfloat16  0.10009765625        0 01111011 1001101                  9.8e-04
    float16   0.0999755859375      0 01011 1001100110                  2.4e-04
    0.1 in each format
    >>> memory = training_memory_explorer()      # GPT size, batch, sequence, precision... -> where memory goes
    >>> memory.text
    'TrainingMemory(estimate: 53.78 MB = parameters 1.85 + gradients 1.85 + optimizer state 3.70 + activations 46.39)'
    >>> memory.controls["batch_size"].value = 16    # what dragging the slider does: the estimate follows
    >>> memory.text
    'TrainingMemory(estimate: 100.03 MB = parameters 1.85 + gradients 1.85 + optimizer state 3.70 + activations 92.64)'

``data_loading_explorer()`` measures the course's own :class:`~perflab.train.Workload` unless given another.

Each is an ``ipywidgets`` box whose plain-text form is its current result: where widgets cannot
render (a terminal, nbval, a notebook viewer) the cell still shows what the explorer computed.

Used in: lectures 01, 03, 04 and 05.
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets
import psutil
import torch

from perflab.floats import compare_formats
from perflab.memory_budget import estimate_training_memory, measure_training_memory
from perflab.models import GPTConfig
from perflab.render import Table
from perflab.train import TrainConfig, Workload, train

__all__ = [
    "Explorer",
    "data_loading_explorer",
    "float_format_explorer",
    "measure_data_loading",
    "training_memory_explorer",
]

_WARMUP_STEPS = 2  # the first steps of a run start workers and fill caches: not what the knobs change


class Explorer(widgets.VBox):
    """Controls above a result; every change of a control recomputes the result."""

    def __init__(
        self,
        controls: dict[str, widgets.Widget],
        describe: Callable[..., tuple[str, str]],
        extra: list[widgets.Widget] = (),
    ):
        self.controls = controls
        self._describe = describe
        self.result = widgets.HTML()
        self.text = ""
        super().__init__([*controls.values(), *extra, self.result])
        for control in controls.values():
            control.observe(self.update, names="value")
        self.update()

    def update(self, change=None) -> None:
        self.text, self.result.value = self._describe(**{name: c.value for name, c in self.controls.items()})

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = self.text  # what a frontend without widgets shows instead
        return bundle


def measure_data_loading(
    *,
    pipeline: str,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    workload: Workload = Workload(),
    steps: int = 10,
) -> tuple[float, float]:
    """Samples/s and the share of time spent waiting for data, over ``steps`` steps after a warm-up."""
    config = TrainConfig(
        name="explorer",
        pipeline=pipeline,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        log_every=1000,
    )
    result = train(config, workload, progress=False, max_steps=_WARMUP_STEPS + steps)
    steady = result.steps[_WARMUP_STEPS:]
    seconds = sum(sum(step.values()) for step in steady)
    return batch_size * len(steady) / seconds, sum(step["data_wait"] for step in steady) / seconds


def data_loading_explorer(workload: Workload = Workload(), steps: int = 10) -> Explorer:
    """Measure the training loop's input pipeline live; keeps a table of what you tried."""
    history: list[str] = []

    def describe(pipeline, batch_size, num_workers, pin_memory):
        rate, waiting = measure_data_loading(
            pipeline=pipeline,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            workload=workload,
            steps=steps,
        )
        line = (
            f"{pipeline}, batch {batch_size}, {num_workers} workers, pin_memory {pin_memory}: "
            f"{rate:,.0f} samples/s, waiting for data {waiting:.0%} of the time"
        )
        history.insert(0, line)
        tried = Table(
            (),
            [(entry,) for entry in history[:8]],
            caption=f"latest first; measured over {steps} steps after {_WARMUP_STEPS} warm-up steps",
        )
        return line, tried._repr_html_()

    style = {"description_width": "110px"}
    controls = {
        "pipeline": widgets.ToggleButtons(
            options=[("per-sample PIL", "pil"), ("decoded once", "cached")],
            value="pil",
            description="pipeline",
            style=style,
        ),
        "batch_size": widgets.SelectionSlider(
            options=[16, 32, 64, 128, 256], value=32, description="batch size", continuous_update=False, style=style
        ),
        "num_workers": widgets.IntSlider(
            value=0, min=0, max=4, description="num_workers", continuous_update=False, style=style
        ),
        "pin_memory": widgets.Checkbox(value=False, description="pin_memory", style=style),
    }
    return Explorer(controls, describe)


def float_format_explorer(value: float = 0.1) -> Explorer:
    """Type a number; see how each format stores it."""

    def describe(number):
        comparison = compare_formats(number)
        return repr(comparison), comparison._repr_html_()

    controls = {"number": widgets.FloatText(value=value, description="number")}
    return Explorer(controls, describe)


def training_memory_explorer(device: str | torch.device = "cpu", max_share_of_ram: float = 0.25) -> Explorer:
    """Estimate where a GPT's training memory goes; the button checks the estimate against a measured step.

    The measured step runs on ``device``; it is refused when the estimate needs more than
    ``max_share_of_ram`` of the memory this machine has free, so a slider cannot freeze a laptop.
    """
    measured = widgets.HTML()
    button = widgets.Button(description="measure this one", tooltip="run one training step on this machine")
    style = {"description_width": "110px"}
    controls = {
        "n_layer": widgets.IntSlider(
            value=2, min=1, max=12, description="layers", continuous_update=False, style=style
        ),
        "n_embd": widgets.SelectionSlider(
            options=[64, 128, 256, 384, 512, 768], value=128, description="width", continuous_update=False, style=style
        ),
        "batch_size": widgets.SelectionSlider(
            options=[1, 2, 4, 8, 16, 32, 64], value=8, description="batch size", continuous_update=False, style=style
        ),
        "seq_len": widgets.SelectionSlider(
            options=[64, 128, 256, 512, 1024, 2048],
            value=256,
            description="sequence length",
            continuous_update=False,
            style=style,
        ),
        "attention": widgets.Dropdown(
            options=["naive", "sdpa", "tiled"], value="naive", description="attention", style=style
        ),
        "precision": widgets.Dropdown(
            options=["float32", "bfloat16"], value="float32", description="precision", style=style
        ),
        "optimizer": widgets.Dropdown(
            options=["adamw", "sgd_momentum", "sgd"], value="adamw", description="optimizer", style=style
        ),
        "checkpointing": widgets.Checkbox(value=False, description="activation checkpointing", style=style),
    }

    def settings(values):
        model = GPTConfig(
            n_layer=values["n_layer"],
            n_embd=values["n_embd"],
            n_head=max(1, values["n_embd"] // 64),
            block_size=values["seq_len"],
            attention=values["attention"],
        )
        options = {key: values[key] for key in ("batch_size", "seq_len", "precision", "optimizer", "checkpointing")}
        return model, options

    def describe(**values):
        model, options = settings(values)
        estimate = estimate_training_memory(model, **options)
        measured.value = ""
        return repr(estimate), estimate._repr_html_()

    def measure(_):
        model, options = settings({name: c.value for name, c in controls.items()})
        estimate = estimate_training_memory(model, **options)
        allowed = max_share_of_ram * psutil.virtual_memory().available
        if estimate.total > allowed:
            measured.value = (
                f"<p>Not measured: the estimate, {estimate.total / 1e6:,.0f} MB, is more than "
                f"{max_share_of_ram:.0%} of this machine's free memory ({allowed / 1e6:,.0f} MB).</p>"
            )
            return
        measured.value = "<p>measuring one training step...</p>"
        measured.value = estimate.compare(measure_training_memory(model, **options, device=device))._repr_html_()

    button.on_click(measure)
    return Explorer(controls, describe, extra=[button, measured])
