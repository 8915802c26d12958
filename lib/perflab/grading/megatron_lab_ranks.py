"""Lab 11's ranks' side: course code that runs beside the learner's layers in each rank, results back as bytes.

Each ``child_lab11_*`` function answers one request of the grader (:mod:`perflab.grading.megatron_lab`)
in every rank of a :class:`perflab.grading.rank_group.RankGroup`, with the namespace in which the
lab's ``problem`` cell ran, and then the learner's ``megatron`` cell (``child_lab11_answer``, once the
grader has read each rank's memory). It builds the learner's layers from what the grader sent this
rank alone: its block of each whole weight and the whole bias, as the lab's ``RankBlock``, never a
seed. It runs them on the tensors the grader sent and
returns the shapes (as JSON) and the values (as raw float32 bytes) of what the grader compares with
one process. The learner's code can change anything in this process, this module included: nothing
it returns is trusted but as a result the grader checks, and what it sent and held is read from outside.

    >>> model = torch.nn.Linear(3, 1)
    >>> batches = [torch.ones(2, 3), torch.zeros(2, 1)]                 # (inputs, targets), ...
    >>> before = model.weight.detach().clone()
    >>> train(model, list(model.parameters()), batches)                # SGD as torch.optim.SGD(momentum=0.9) steps
    >>> bool((model.weight != before).all())
    True

Used by perflab.grading.megatron_lab.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from perflab.grading.triton_lab_backward import tensors_as_bytes, tensors_from_bytes

__all__ = [
    "LAYER_NAMES",
    "LR",
    "SHARD_NAMES",
    "STEPS",
    "backward",
    "child_lab11_answer",
    "child_lab11_backward",
    "child_lab11_build",
    "child_lab11_f_g",
    "child_lab11_forward",
    "child_lab11_hold",
    "child_lab11_layers",
    "child_lab11_mlp",
    "child_lab11_results",
    "child_lab11_warm_up",
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


def _received(namespace, payload: bytes, shapes: list, layers, rank: int, world: int) -> tuple[list, list]:
    """The tensors of ``shapes``, then this rank's block of W and the whole bias of each ``(in_features, out_features,
    dim)`` layer (W split along ``dim`` by the lab's ``rank_slices``), from one payload: each copied into a storage of
    its own, so that a view the learner keeps of one (a bias) keeps no other alive, and with no copy of the whole
    payload on the way."""
    count = len(shapes)
    for features_in, features_out, dim in layers:
        rows, cols = namespace["problem"].rank_slices(features_in, features_out, rank, world, dim)
        shapes = [*shapes, (len(range(features_out)[rows]), len(range(features_in)[cols])), (features_out,)]
    tensors, offset = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are read-only: each tensor is copied out, never written
        for shape in shapes:
            size = math.prod(shape)
            tensors.append(
                torch.frombuffer(payload, dtype=torch.float32, count=size, offset=offset).view(shape).clone()
            )
            offset += 4 * size
    return tensors[:count], tensors[count:]


def _handed(namespace, blocks: list, layers, rank: int, world: int) -> list:
    """Each layer's ``RankBlock``: all that the learner's layer is handed, from the block and bias sent to this rank."""
    problem = namespace["problem"]
    handed = []
    for (features_in, features_out, dim), block, bias in zip(layers, blocks[::2], blocks[1::2]):
        rows, cols = problem.rank_slices(features_in, features_out, rank, world, dim)
        handed.append(problem.RankBlock(block, bias, rows, cols, features_in))
    return handed


def _checked(tensors: list, names) -> tuple[list, bytes]:
    for tensor, name in zip(tensors, names):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(tensor).__name__} (no gradient reached it?)")
    return [list(tensor.shape) for tensor in tensors], tensors_as_bytes(tensors)


def child_lab11_answer(namespace, payload, rank, world, source):
    """Run the learner's cell, after the grader read this rank's memory: what it holds from its import on counts."""
    exec(compile(source, "<cell megatron>", "exec"), namespace)
    return None, b""


def child_lab11_world(namespace, payload, rank, world, store):
    """Leave the world of the last check, if any, and join a new one; gloo connects every pair now, not later."""
    if dist.is_initialized():
        dist.destroy_process_group()
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    dist.all_reduce(torch.zeros(1))
    return None, b""


class _Summed(torch.autograd.Function):
    """The warm-up's own f and g at once: summed over the ranks forward and backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def child_lab11_warm_up(namespace, payload, rank, world, tokens, hidden, ffn):
    """One forward and backward, in course code, of an MLP of the measured one's shape: what a first pass starts once
    in a process (gloo's buffers, autograd's, the allocator's: 18 MiB a rank for TRAFFIC[2]) is then there before the
    grader reads the memory that the answer's use is measured from."""
    x = torch.randn(tokens, hidden, requires_grad=True)
    up = torch.randn(ffn // world, hidden, requires_grad=True)
    down = torch.randn(hidden, ffn // world, requires_grad=True)
    output = _Summed.apply(F.linear(F.gelu(F.linear(_Summed.apply(x), up)), down))
    backward(output, torch.ones_like(output))
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


def child_lab11_layers(namespace, payload, rank, world, tokens, column, row):
    """Each layer alone, kept for ``child_lab11_results`` (the grader reads what this request sent): the
    column-parallel one on the whole input, its block of the output's gradient; the row-parallel one on its block of
    the input, the whole output's gradient."""
    (column_in, column_out), (row_in, row_out) = column, row
    shapes = [(tokens, column_in), (tokens, column_out), (tokens, row_in), (tokens, row_out)]
    layers = [(column_in, column_out, 0), (row_in, row_out, 1)]
    (x_column, dy_column, x_row, dy_row), blocks = _received(namespace, payload, shapes, layers, rank, world)
    column_init, row_init = _handed(namespace, blocks, layers, rank, world)
    out_part, in_part = column_out // world, row_in // world
    tensors = _run_layer(
        namespace["ColumnParallelLinear"](column_init), x_column, dy_column[:, rank * out_part : (rank + 1) * out_part]
    )
    tensors += _run_layer(
        namespace["RowParallelLinear"](row_init), x_row[:, rank * in_part : (rank + 1) * in_part], dy_row
    )
    names = [f"{layer}'s {name}" for layer in ("ColumnParallelLinear", "RowParallelLinear") for name in LAYER_NAMES]
    namespace["_results"] = tensors, names
    return None, b""


def _mlp_layers(hidden: int, ffn: int) -> list[tuple[int, int, int]]:
    return [(hidden, ffn, 0), (ffn, hidden, 1)]  # up: W's rows split (column-parallel); down: its columns


def _shards(mlp) -> list:
    return [mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias]


def child_lab11_mlp(namespace, payload, rank, world, tokens, hidden, ffn, seed):
    """One forward and backward of the MLP; then STEPS of SGD of a replicated layer followed by a new MLP, whose
    gradient reaches the replicated layer only through f's backward all-reduce."""
    layers = _mlp_layers(hidden, ffn)
    (x, dz, *batches), blocks = _received(namespace, payload, [(tokens, hidden)] * (2 + 2 * STEPS), layers, rank, world)
    mlp = namespace["TensorParallelMLP"](*_handed(namespace, blocks, layers, rank, world))
    x = x.clone().requires_grad_()
    output = mlp(x)
    backward(output, dz)
    tensors = [output, x.grad, *(parameter.grad for parameter in _shards(mlp))]
    before = namespace["LayerInit"](seed, hidden, hidden).full_linear()  # the same on every rank
    # A RankBlock hands out its own numbers, not copies: the MLP trained here is built from copies of its own.
    mlp = namespace["TensorParallelMLP"](*_handed(namespace, [block.clone() for block in blocks], layers, rank, world))
    parameters = [before.weight, before.bias, *_shards(mlp)]
    train(lambda inputs: mlp(torch.tanh(before(inputs))), parameters, batches)
    names = ["the MLP's output", "its input gradient", *(f"{name}'s gradient" for name in SHARD_NAMES)]
    names += ["the replicated layer's weight", "its bias", *SHARD_NAMES]
    return _checked(tensors + parameters, names)


def child_lab11_hold(namespace, payload, rank, world, hidden, ffn):
    """Keep this rank's blocks of the measured MLP, sent in a request of their own: the bytes they came in are let go
    when the next request arrives, before the build, in which an answer that copies its blocks holds them twice."""
    namespace["_held"] = _received(namespace, payload, [], _mlp_layers(hidden, ffn), rank, world)[1]
    return None, b""


def child_lab11_build(namespace, payload, rank, world, hidden, ffn):
    """The measured MLP, built from this rank's blocks; then the blocks taken back, so that a layer that keeps its init
    keeps no second copy of them (the lab's check script does the same)."""
    handed = _handed(namespace, namespace.pop("_held"), _mlp_layers(hidden, ffn), rank, world)
    namespace["_traffic_mlp"] = namespace["TensorParallelMLP"](*handed)
    for init in handed:
        init.take_back()
    return None, b""


def child_lab11_forward(namespace, payload, rank, world, tokens, hidden):
    (x,) = tensors_from_bytes(payload, [(tokens, hidden)])
    namespace["_traffic_x"] = x.requires_grad_()
    namespace["_traffic_output"] = namespace["_traffic_mlp"](x)
    return None, b""


def child_lab11_backward(namespace, payload, rank, world, tokens, hidden):
    """The backward; its output and input gradient kept for ``child_lab11_results``, the MLP let go."""
    (dz,) = tensors_from_bytes(payload, [(tokens, hidden)])
    output = namespace.pop("_traffic_output")
    backward(output, dz)
    namespace["_results"] = [output, namespace.pop("_traffic_x").grad], ["the MLP's output", "its input gradient"]
    del namespace["_traffic_mlp"]
    return None, b""


def child_lab11_results(namespace, payload, rank, world):
    """What the last request kept: results are sent in a request of their own, so that the bytes a rank wrote while
    it computed them are its communication alone."""
    return _checked(*namespace.pop("_results"))
