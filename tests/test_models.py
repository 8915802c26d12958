"""The course's models: shapes, equivalences (checkpointing, memory formats, attention
implementations), what the profiler and the FLOP counter see, and that a GPT can learn."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from perflab.models import (
    GPT,
    GPTConfig,
    ResNet,
    ResNetConfig,
    count_flops,
    count_parameters,
    naive_attention,
    sdpa_attention,
    tiled_attention,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

TINY_GPT = GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=32)
ATTENTIONS = ("naive", "sdpa", "tiled")


@pytest.fixture(autouse=True)
def _seeded_single_thread():
    # These models are tiny: splitting each operator across threads costs more than it saves,
    # and on a busy machine waiting threads make the suite several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def images(batch: int = 8, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def tokens(config: GPTConfig, batch: int = 3, length: int | None = None) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, length or config.block_size))


def same_weights(model: nn.Module, config: GPTConfig | ResNetConfig) -> nn.Module:
    """A model built from ``config`` with ``model``'s parameters and buffers."""
    rebuilt = type(model)(config)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# --- shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [32, 40])
def test_resnet_maps_images_to_one_logit_per_class(size):
    model = ResNet(ResNetConfig(num_classes=7, in_channels=1, widths=(4, 8), blocks_per_stage=2))
    assert model(torch.randn(5, 1, size, size)).shape == (5, 7)
    assert len(model.blocks) == 4


def test_gpt_logits_have_one_row_per_position_and_loss_starts_near_uniform():
    model = GPT(TINY_GPT)
    idx = tokens(TINY_GPT, length=50)  # shorter than block_size is allowed
    logits, loss = model(idx)
    assert logits.shape == (3, 50, TINY_GPT.vocab_size) and loss is None
    _, loss = model(idx, targets=tokens(TINY_GPT, length=50))
    # Small initial weights give near-uniform predictions: cross-entropy ~ log(vocab_size).
    assert loss.shape == () and abs(loss.item() - math.log(TINY_GPT.vocab_size)) < 0.1


def test_gpt_lm_head_shares_the_token_embedding():
    model = GPT(TINY_GPT)
    assert model.lm_head.weight is model.token_embedding.weight
    counted_twice = sum(t.numel() for t in model.state_dict().values())
    assert count_parameters(model) == counted_twice - TINY_GPT.vocab_size * TINY_GPT.n_embd


def test_generate_appends_tokens_and_top_k_1_is_greedy():
    model = GPT(TINY_GPT).eval()
    seen_lengths = []
    model.register_forward_pre_hook(lambda module, args: seen_lengths.append(args[0].size(1)))
    prompt = tokens(TINY_GPT, batch=2, length=TINY_GPT.block_size - 2)
    sampled = model.generate(prompt, max_new_tokens=5)
    assert sampled.shape == (2, TINY_GPT.block_size + 3) and torch.equal(sampled[:, : prompt.size(1)], prompt)
    assert 0 <= sampled.min() and sampled.max() < TINY_GPT.vocab_size
    # The context grows up to block_size, then slides: the model never sees more.
    block = TINY_GPT.block_size
    assert seen_lengths == [block - 2, block - 1, block, block, block]
    greedy = model.generate(prompt, max_new_tokens=4, top_k=1)
    expected = prompt
    for _ in range(4):
        next_token = model(expected[:, -block:])[0][:, -1].argmax(-1, keepdim=True)
        expected = torch.cat((expected, next_token), dim=1)
    assert torch.equal(greedy, expected)


# --- configuration errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GPTConfig(n_embd=30, n_head=4), "divisible by n_head"),
        (lambda: GPTConfig(attention="flash"), "unknown attention 'flash'"),
        (lambda: GPTConfig(n_layer=0), "n_layer must be a positive int"),
        (lambda: GPTConfig(dropout=1.0), "dropout"),
        (lambda: ResNetConfig(widths=()), "widths"),
        (lambda: ResNetConfig(blocks_per_stage=0), "blocks_per_stage"),
        (lambda: tiled_attention(*torch.randn(3, 1, 1, 4, 2), tile_size=0), "tile_size"),
    ],
)
def test_bad_configuration_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_gpt_rejects_sequences_longer_than_block_size():
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY_GPT)(tokens(TINY_GPT, length=TINY_GPT.block_size + 1))


# --- checkpointing ------------------------------------------------------------------------


def saved_activation_elements(model: nn.Module, *inputs: torch.Tensor) -> int:
    """How many tensor elements autograd keeps for backward after ``model(*inputs)``,
    not counting the parameters themselves."""
    parameters = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(tensor):
        nonlocal total
        if tensor.data_ptr() not in parameters:
            total += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*inputs)
    return total


def test_resnet_checkpointing_changes_memory_not_results():
    config = ResNetConfig(widths=(8, 16), blocks_per_stage=2)
    plain = ResNet(config)
    checkpointed = same_weights(plain, replace(config, checkpoint_blocks=True))
    x = images()
    # Training mode, where checkpointing applies and BatchNorm uses the batch's statistics.
    for model in (plain, checkpointed):
        model(x).logsumexp(-1).sum().backward()
    torch.testing.assert_close(checkpointed(x), plain(x))
    torch.testing.assert_close(grads(checkpointed), grads(plain))
    # Recomputation must not update the running statistics a second time.
    torch.testing.assert_close(checkpointed.state_dict(), plain.state_dict())
    assert saved_activation_elements(checkpointed, x) < saved_activation_elements(plain, x) / 2


def test_gpt_checkpointing_changes_memory_not_results():
    config = replace(TINY_GPT, dropout=0.1)  # checkpoint must replay the same dropout masks
    plain = GPT(config)
    checkpointed = same_weights(plain, replace(config, checkpoint_blocks=True))
    idx = tokens(config)
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)
        logits, loss = model(idx, targets=idx)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(grads(checkpointed), grads(plain))
    assert saved_activation_elements(checkpointed, idx) < saved_activation_elements(plain, idx) / 2


# --- memory formats, precisions, compilation ----------------------------------------------


@pytest.mark.parametrize("training", [True, False])
def test_resnet_channels_last_gives_the_same_output(training):
    model = ResNet(ResNetConfig()).train(training)
    model.blocks[0].bn2.weight.data.normal_()  # not the zero init: make every branch count
    x = images()
    expected = model(x)
    channels_last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    torch.testing.assert_close(channels_last(x.to(memory_format=torch.channels_last)), expected, rtol=1e-4, atol=1e-5)


def test_resnet_runs_under_bfloat16_autocast():
    model = ResNet().to(memory_format=torch.channels_last)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(images().to(memory_format=torch.channels_last))
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gpt_runs_under_bfloat16_autocast(attention):
    config = replace(TINY_GPT, attention=attention, tile_size=16)
    model = GPT(config)
    reference = same_weights(model, TINY_GPT)
    idx = tokens(config)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, targets=idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # bfloat16 keeps 8 bits of mantissa: close to float32, not equal
    torch.testing.assert_close(loss, reference(idx, targets=idx)[1], rtol=0.02, atol=0.0)


def test_compiled_checkpointed_resnet_matches_eager():
    # aot_eager traces like inductor does (Dynamo + AOTAutograd) without a C++ build.
    eager = ResNet(ResNetConfig(widths=(8, 16), checkpoint_blocks=True))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = images()
    eager(x).sum().backward()
    compiled(x).sum().backward()
    torch.testing.assert_close(grads(compiled_model), grads(eager))
    torch.testing.assert_close(compiled_model.state_dict(), eager.state_dict())


# --- the three attention implementations --------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length, tile_size", [(1, 16), (37, 16), (100, 32), (64, 64), (50, 128)])
def test_attention_implementations_agree_forward_and_backward(causal, length, tile_size):
    # float64, so that any difference beyond rounding is a bug, not precision
    q, k, v = (torch.randn(2, 3, length, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    upstream = torch.randn(2, 3, length, 8, dtype=torch.float64)
    results = {}
    for name, attention in [
        ("naive", naive_attention),
        ("sdpa", sdpa_attention),
        ("tiled", lambda q, k, v, causal: tiled_attention(q, k, v, causal, tile_size=tile_size)),
    ]:
        output = attention(q, k, v, causal=causal)
        results[name] = (output, *torch.autograd.grad(output, (q, k, v), upstream))
    for name in ("sdpa", "tiled"):
        for got, expected in zip(results[name], results["naive"]):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_causal_attention_ignores_the_future():
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    changed_future = v.clone()
    changed_future[:, :, 20:] += 1.0
    for attention in (naive_attention, sdpa_attention, lambda q, k, v: tiled_attention(q, k, v, tile_size=16)):
        before, after = attention(q, k, v), attention(q, k, changed_future)
        torch.testing.assert_close(after[:, :, :20], before[:, :, :20])
        assert not torch.allclose(after[:, :, 20:], before[:, :, 20:])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gpt_outputs_do_not_depend_on_the_attention_implementation(attention):
    reference = GPT(replace(TINY_GPT, attention="naive"))
    model = same_weights(reference, replace(TINY_GPT, attention=attention, tile_size=16))
    idx = tokens(TINY_GPT, length=45)
    torch.testing.assert_close(model(idx)[0], reference(idx)[0], rtol=1e-4, atol=1e-5)


class OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor every operator returns, backward included."""

    def __init__(self):
        super().__init__()
        self.shapes: list[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [t.shape for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def has_square(self, length: int) -> bool:
        """Whether some tensor ended in a ``length x length`` matrix, like attention scores."""
        return any(tuple(shape[-2:]) == (length, length) for shape in self.shapes)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_attention_never_creates_a_t_by_t_tensor(causal):
    length = 256
    q, k, v = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(3))
    probes = {}
    for name, attention in [
        ("naive", naive_attention),
        ("tiled", lambda *qkv, causal: tiled_attention(*qkv, causal, 32)),
    ]:
        with OutputShapes() as probes[name]:
            attention(q, k, v, causal=causal).sum().backward()
    assert probes["naive"].has_square(length)  # the probe does see a score matrix
    assert not probes["tiled"].has_square(length)
    largest = max(shape.numel() for shape in probes["tiled"].shapes)
    assert largest <= q.numel()  # nothing bigger than q, k, v or the output, forward or backward


@pytest.mark.parametrize("attention, builds_scores", [("naive", True), ("tiled", False)])
def test_gpt_runs_the_attention_its_config_names(attention, builds_scores):
    config = replace(TINY_GPT, attention=attention, tile_size=16)
    with OutputShapes() as probe:
        GPT(config)(tokens(config))
    assert probe.has_square(config.block_size) == builds_scores


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiled_attention_peak_gpu_memory_is_a_fraction_of_naive():
    q, k, v = (torch.randn(1, 4, 4096, 64, device="cuda") for _ in range(3))
    peaks = {}
    for name, attention in [("naive", naive_attention), ("tiled", tiled_attention)]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            attention(q, k, v)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
    assert peaks["naive"] >= 4 * 4096 * 4096 * 4  # one float32 score matrix per head
    assert peaks["tiled"] < peaks["naive"] / 10


# --- learning, profiling, counting --------------------------------------------------------


def gratings(count: int, classes: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy stripes whose orientation is the label: a small image problem a CNN must learn."""
    labels = torch.randint(0, classes, (count,))
    angle = labels * math.pi / classes
    phase = torch.rand(count) * 2 * math.pi
    coords = torch.arange(size).float()
    along = coords * torch.cos(angle)[:, None, None] + coords[:, None] * torch.sin(angle)[:, None, None]
    stripes = torch.sin(along + phase[:, None, None])[:, None].expand(count, 3, size, size)
    return stripes + 0.3 * torch.randn(count, 3, size, size), labels


def test_resnet_learns_to_classify_images():
    classes = 4
    train_images, train_labels = gratings(256, classes)
    val_images, val_labels = gratings(256, classes)
    model = ResNet(ResNetConfig(num_classes=classes, widths=(8, 16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(30):
        batch = torch.randint(0, len(train_images), (64,))
        loss = F.cross_entropy(model(train_images[batch]), train_labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = (model.eval()(val_images).argmax(-1) == val_labels).float().mean().item()
    assert accuracy > 0.75  # chance is 1 / classes = 0.25


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gpt_learns_a_repeated_sequence(attention):
    config = replace(TINY_GPT, attention=attention, block_size=32, tile_size=8)
    model = GPT(config)
    pattern = torch.randint(0, config.vocab_size, (8,))
    sequence = pattern.repeat(5)[None]  # after one period every next token is predictable
    inputs, targets = sequence[:, :32], sequence[:, 1:33]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        _, loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 3


def test_blocks_appear_as_named_regions_in_a_profile():
    resnet = ResNet(ResNetConfig(widths=(4, 8), blocks_per_stage=2, checkpoint_blocks=True))
    gpt = GPT(replace(TINY_GPT, n_layer=3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        resnet(images()).sum().backward()
        gpt(tokens(TINY_GPT))
    names = {event.key for event in profile.key_averages()}
    assert {f"resnet.block{i}" for i in range(4)} <= names
    assert {f"gpt.block{i}" for i in range(3)} <= names
    assert "resnet.block4" not in names and "gpt.block3" not in names


def test_count_flops_of_a_linear_layer():
    batch, fan_in, fan_out = 8, 32, 16
    layer = nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in)
    matmul = 2 * batch * fan_in * fan_out  # one multiply and one add per term
    assert count_flops(layer, x, backward=False) == matmul
    # backward: one matmul for the weight's gradient, and one more when the input needs one
    assert count_flops(layer, x) == 2 * matmul
    assert count_flops(layer, x.requires_grad_()) == 3 * matmul
    assert layer.weight.grad is None and x.grad is None  # counting left no gradients behind


def test_count_flops_of_a_gpt_matches_the_matmuls_of_its_config():
    config = replace(TINY_GPT, attention="naive")
    batch, length, width = 2, config.block_size, config.n_embd
    per_layer = (
        2 * batch * length * width * 3 * width  # q, k, v projection
        + 2 * 2 * batch * length * length * width  # scores and weighted values, over all heads
        + 2 * batch * length * width * width  # output projection
        + 2 * 2 * batch * length * width * 4 * width  # MLP up and down
    )
    forward = config.n_layer * per_layer + 2 * batch * length * width * config.vocab_size
    idx = tokens(config, batch=batch)
    assert count_flops(GPT(config), idx, backward=False) == forward
    # Each matmul's backward is two matmuls of its size, one per operand: in a GPT both
    # operands of every matmul need a gradient (activations descend from the embeddings).
    assert count_flops(GPT(config), idx, idx) == 3 * forward


def test_count_flops_sees_the_tiles_that_causal_tiled_attention_skips():
    length, tile, head_dim = 128, 32, 16
    q, k, v = (torch.randn(1, 1, length, head_dim) for _ in range(3))
    full = count_flops(naive_attention, q, k, v, backward=False)
    assert full == 2 * 2 * length * length * head_dim
    tiles_per_side = length // tile
    tiles_visited = tiles_per_side * (tiles_per_side + 1) // 2  # the diagonal and below
    tiled = count_flops(lambda q, k, v: tiled_attention(q, k, v, tile_size=tile), q, k, v, backward=False)
    assert tiled == full * tiles_visited // tiles_per_side**2
