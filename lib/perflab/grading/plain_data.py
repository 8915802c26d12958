"""Results that cross from a learner's process to the trusted grader as plain data, and nothing else.

    >>> import torch
    >>> header, payload = encode({"losses": torch.tensor([0.5, 0.25]), "steps": 2, "raised": None})
    >>> header["dict"]["losses"], len(payload)          # JSON, and the tensors' bytes
    ({'tensor': 'float32', 'shape': [2], 'at': 0, 'bytes': 8}, 8)
    >>> decode(header, payload)
    {'losses': tensor([0.5000, 0.2500]), 'steps': 2, 'raised': None}

What may cross: ``None``, ``bool``, ``int``, ``float``, ``str``, lists (and tuples, which arrive as
lists) and dicts with ``str`` keys of those, and tensors (a dense tensor's bytes with its dtype and
shape). Anything else is refused on both sides: by :func:`encode`, with a message that names what
the learner's code returned, and by :func:`decode`, which rebuilds only these types from JSON and
bytes. So an object whose ``__eq__`` says yes to everything, or a ``float`` subclass whose
differences are 0, never reaches the comparisons: they run on what :func:`decode` built.

    >>> class Anything(float):
    ...     def __eq__(self, other):
    ...         return True
    >>> encode([Anything(1.0)])
    Traceback (most recent call last):
    ...
    perflab.grading.plain_data.NotPlainData: [0]: a Anything, not plain data (None, bool, int, float, str, list, dict, tensor)

Used by perflab.grading.checked.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DTYPES", "NotPlainData", "decode", "encode"]

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MAX_DEPTH = 16


class NotPlainData(TypeError):
    """A result that is not plain data: what the learner's code returned, named where it was found."""


def _tensor_header(tensor: torch.Tensor, chunks: list[bytes], offset: int, where: str) -> tuple[dict, int]:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES or tensor.is_sparse or tensor.is_quantized:
        raise NotPlainData(
            f"{where}: a {tensor.dtype} tensor of layout {tensor.layout}, not a dense one of {list(DTYPES)}"
        )
    dense = tensor.detach().to("cpu").contiguous()
    raw = dense.reshape(-1).view(torch.uint8).numpy().tobytes() if dense.numel() else b""
    chunks.append(raw)
    return {"tensor": name, "shape": list(dense.shape), "at": offset, "bytes": len(raw)}, offset + len(raw)


def encode(value) -> tuple[object, bytes]:
    """``value`` as a JSON-able header and the tensors' bytes; raises ``NotPlainData`` on anything else."""
    chunks: list[bytes] = []
    offset = 0

    def walk(item, where: str, depth: int):
        nonlocal offset
        if depth > MAX_DEPTH:
            raise NotPlainData(f"{where}: nested deeper than {MAX_DEPTH}")
        kind = type(item)  # the exact type: a subclass of float or str may redefine comparisons
        if item is None or kind in (bool, int, str):
            return item
        if kind is float:
            return item if math.isfinite(item) else {"float": repr(item)}
        if kind in (list, tuple):
            return [walk(element, f"{where}[{index}]", depth + 1) for index, element in enumerate(item)]
        if kind is dict:
            if not all(type(key) is str for key in item):
                raise NotPlainData(f"{where}: a dict whose keys are not all str")
            return {"dict": {key: walk(element, f"{where}[{key!r}]", depth + 1) for key, element in item.items()}}
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            header, offset = _tensor_header(item, chunks, offset, where)
            return header
        raise NotPlainData(
            f"{where or 'the result'}: a {kind.__name__}, not plain data (None, bool, int, float, str, list, dict, tensor)"
        )

    # A dict travels as {"dict": {...}}, so that no dict of the learner's is ever read as a tensor's header.
    return walk(value, "", 0), b"".join(chunks)


def decode(header, payload: bytes):
    """Rebuild plain data from ``encode``'s header and bytes; raises ``NotPlainData`` on anything malformed."""

    def walk(item, depth: int):
        if depth > MAX_DEPTH:
            raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
        kind = type(item)
        if item is None or kind in (bool, int, float, str):
            return item
        if kind is list:
            return [walk(element, depth + 1) for element in item]
        if kind is dict and set(item) == {"dict"} and type(item["dict"]) is dict:
            return {key: walk(element, depth + 1) for key, element in item["dict"].items()}
        if kind is dict and set(item) == {"float"} and item["float"] in ("inf", "-inf", "nan"):
            return float(item["float"])
        if kind is dict and set(item) == {"tensor", "shape", "at", "bytes"}:
            return _tensor(item, payload)
        raise NotPlainData(f"malformed data: {str(item)[:200]}")

    return walk(header, 0)


def _tensor(item: dict, payload: bytes) -> torch.Tensor:
    dtype, shape, start, size = DTYPES.get(item["tensor"]), item["shape"], item["at"], item["bytes"]
    if dtype is None or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise NotPlainData(f"malformed tensor: {str(item)[:200]}")
    if type(start) is not int or type(size) is not int or start < 0 or start + size > len(payload):
        raise NotPlainData("a tensor's bytes lie outside the payload")
    count = math.prod(shape)
    if size != count * torch.empty((), dtype=dtype).element_size():
        raise NotPlainData(f"a tensor of shape {shape} in {dtype} cannot hold {size} bytes")
    if not size:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload[start : start + size]), dtype=torch.uint8).view(dtype).reshape(shape)
