"""Lab 11's ranks' side: course code that runs beside the learner's layers in each rank, results back as bytes.

Each ``child_lab11_*`` function answers one request of the grader (:mod:`perflab.grading.megatron_lab`)
in every rank of a :class:`perflab.grading.rank_group.RankGroup`, with the namespace in which the
lab's ``problem`` cell and the learner's ``megatron`` cell ran. It builds the learner's layers from
``LayerInit`` and seeds the grader drew, runs them on the tensors it sent, and returns the shapes
(as JSON) and the values (as raw float32 bytes) of what the grader compares with one process. The
learner's code can change anything in this process, this module included: nothing it returns is
trusted but as a result the grader checks, and what it sent and held is read from outside.

    >>> model = torch.nn.Linear(3, 1)
    >>> batches = [torch.ones(2, 3), torch.zeros(2, 1)]                 # (inputs, targets), ...
    >>> before = model.weight.detach().clone()
    >>> train(model, list(model.parameters()), batches)                # SGD as torch.optim.SGD(momentum=0.9) steps
    >>> bool((model.weight != before).all())
    True

Used by perflab.grading.megatron_lab.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.nn.functional as F

from perflab.grading.triton_lab_backward import tensors_as_bytes, tensors_from_bytes

__all__ = [
    "LAYER_NAMES",
    "LR",
    "SHARD_NAMES",
    "STEPS",
    "backward",
    "child_lab11_backward",
    "child_lab11_build",
    "child_lab11_f_g",
    "child_lab11_forward",
    "child_lab11_layers",
    "child_lab11_mlp",
    "child_lab11_outputs",
    "child_lab11_world",
    "train",
]

STEPS, LR, MOMENTUM = 3, 0.1, 0.9
PROCESS_GROUP_TIMEOUT_S = 20  # a rank left alone in a collective gives up after this
LAYER_NAMES = ("weight", "bias", "output", "input gradient", "weight gradient", "bias gradient")
SHARD_NAMES = ("up.weight", "up.bias", "down.weight", "down.bias")


def backward(output: torch.Tensor, gradient: torch.Tensor) -> None:
    """``output.backward(gradient)``, the same gradients: autograd checks a gradient tensor's shape with sympy, which it
    imports the first time (most of a second per process)."""
    (output * gradient).sum().backward()


def train(model, parameters: list, batches: list) -> None:
    """SGD with momentum on (input, target) pairs, step for step as ``torch.optim.SGD`` (without what making one
    imports, ``torch._dynamo``: a second and a half per process)."""
    momenta = [None] * len(parameters)
    for inputs, targets in zip(batches[::2], batches[1::2]):
        F.mse_loss(model(inputs), targets).backward()
        with torch.no_grad():
            for index, parameter in enumerate(parameters):
                gradient, parameter.grad = parameter.grad, None
                momenta[index] = gradient if momenta[index] is None else momenta[index].mul_(MOMENTUM).add_(gradient)
                parameter.sub_(LR * momenta[index])


def _checked(tensors: list, names) -> tuple[list, bytes]:
    for tensor, name in zip(tensors, names):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(tensor).__name__} (no gradient reached it?)")
    return [list(tensor.shape) for tensor in tensors], tensors_as_bytes(tensors)


def child_lab11_world(namespace, payload, rank, world, store):
    """Leave the world of the last check, if any, and join a new one; gloo connects every pair now, not later."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    dist.all_reduce(torch.zeros(1))
    return None, b""


def child_lab11_f_g(namespace, payload, rank, world, shape):
    x, grad_f, grad_g = tensors_from_bytes(payload, [shape] * 3)
    f_input, g_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    f_output = namespace["CopyToParallelRegion"].apply(f_input)
    backward(f_output, grad_f)
    g_output = namespace["ReduceFromParallelRegion"].apply(g_input)
    backward(g_output, grad_g)
    return _checked(
        [f_output, f_input.grad, g_output, g_input.grad], ["f(x)", "f's input gradient", "g(x)", "g's input gradient"]
    )


def _run_layer(layer, x: torch.Tensor, gradient: torch.Tensor) -> list:
    x = x.clone().requires_grad_()
    output = layer(x)
    backward(output, gradient)
    return [layer.weight, layer.bias, output, x.grad, layer.weight.grad, layer.bias.grad]


def child_lab11_layers(namespace, payload, rank, world, tokens, column, row, seeds):
    """Each layer alone: the column-parallel one on the whole input, its block of the output's gradient; the
    row-parallel one on its block of the input, the whole output's gradient."""
    (column_in, column_out), (row_in, row_out) = column, row
    shapes = [(tokens, column_in), (tokens, column_out), (tokens, row_in), (tokens, row_out)]
    x_column, dy_column, x_row, dy_row = tensors_from_bytes(payload, shapes)
    LayerInit = namespace["LayerInit"]
    out_part, in_part = column_out // world, row_in // world
    tensors = _run_layer(
        namespace["ColumnParallelLinear"](LayerInit(seeds[0], column_in, column_out)),
        x_column,
        dy_column[:, rank * out_part : (rank + 1) * out_part],
    )
    tensors += _run_layer(
        namespace["RowParallelLinear"](LayerInit(seeds[1], row_in, row_out)),
        x_row[:, rank * in_part : (rank + 1) * in_part],
        dy_row,
    )
    names = [f"{layer}'s {name}" for layer in ("ColumnParallelLinear", "RowParallelLinear") for name in LAYER_NAMES]
    return _checked(tensors, names)


def _mlp(namespace, hidden: int, ffn: int, seeds):
    LayerInit = namespace["LayerInit"]
    return namespace["TensorParallelMLP"](LayerInit(seeds[0], hidden, ffn), LayerInit(seeds[1], ffn, hidden))


def _shards(mlp) -> list:
    return [mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias]


def child_lab11_mlp(namespace, payload, rank, world, tokens, hidden, ffn, seeds):
    """One forward and backward of the MLP; then STEPS of SGD of a replicated layer followed by a new MLP, whose
    gradient reaches the replicated layer only through f's backward all-reduce."""
    x, dz, *batches = tensors_from_bytes(payload, [(tokens, hidden)] * (2 + 2 * STEPS))
    mlp = _mlp(namespace, hidden, ffn, seeds)
    x = x.clone().requires_grad_()
    output = mlp(x)
    backward(output, dz)
    tensors = [output, x.grad, *(parameter.grad for parameter in _shards(mlp))]
    before = namespace["LayerInit"](seeds[2], hidden, hidden).full_linear()  # the same on every rank
    mlp = _mlp(namespace, hidden, ffn, seeds)
    parameters = [before.weight, before.bias, *_shards(mlp)]
    train(lambda inputs: mlp(torch.tanh(before(inputs))), parameters, batches)
    names = ["the MLP's output", "its input gradient", *(f"{name}'s gradient" for name in SHARD_NAMES)]
    names += ["the replicated layer's weight", "its bias", *SHARD_NAMES]
    return _checked(tensors + parameters, names)


def child_lab11_build(namespace, payload, rank, world, hidden, ffn, seeds):
    namespace["_traffic_mlp"] = _mlp(namespace, hidden, ffn, seeds)
    return None, b""


def child_lab11_forward(namespace, payload, rank, world, tokens, hidden):
    (x,) = tensors_from_bytes(payload, [(tokens, hidden)])
    namespace["_traffic_x"] = x.requires_grad_()
    namespace["_traffic_output"] = namespace["_traffic_mlp"](x)
    return None, b""


def child_lab11_backward(namespace, payload, rank, world, tokens, hidden):
    (dz,) = tensors_from_bytes(payload, [(tokens, hidden)])
    backward(namespace["_traffic_output"], dz)
    return None, b""


def child_lab11_outputs(namespace, payload, rank, world):
    tensors = [namespace.pop("_traffic_output"), namespace.pop("_traffic_x").grad]
    del namespace["_traffic_mlp"]
    return _checked(tensors, ["the MLP's output", "its input gradient"])
