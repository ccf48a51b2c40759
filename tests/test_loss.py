"""The chunked cross-entropy: the full path's loss and gradients, without ever the full logits."""

from __future__ import annotations

import pytest
import torch
from recipe import IGNORE, token_loss_sum

from tests.inprocess import settings

VOCAB, HIDDEN = 500, 16


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def losses_and_grads(hidden, weight, labels, softcap, chunk):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = token_loss_sum(hidden, weight, labels, softcap, chunk)
    (loss / 100).backward()  # as the step scales it: by the global count of predicted tokens
    return loss.detach(), hidden.grad, weight.grad


@pytest.fixture
def one_thread():
    """The full path's own loss varies by ~2e-5 between fresh processes with two intra-op threads
    (measured: 3 runs in 16, never with one): compare on one thread, so 1e-5 measures the chunking."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("softcap", [30.0, None])
@pytest.mark.parametrize("chunk", [7, 36, 64, 10_000])  # 7 and 64 do not divide the 3 x 36 positions
def test_the_chunked_loss_equals_the_full_one_value_and_gradients(softcap, chunk, one_thread):
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 37, HIDDEN) * 2, torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (3, 37))
    labels[0, :10] = IGNORE  # a masked prompt
    labels[1, 20] = IGNORE  # a record boundary inside a packed row
    labels[2, 30:] = IGNORE  # filler
    full = losses_and_grads(hidden, weight, labels, softcap, 0)
    chunked = losses_and_grads(hidden, weight, labels, softcap, chunk)
    for got, want in zip(chunked, full, strict=True):
        assert relative(got, want) < 1e-5
    moved = labels.clone()
    moved[0, 12] = IGNORE
    assert relative(token_loss_sum(hidden, weight, moved, softcap, chunk), full[0]) > 1e-4  # IGNORE counts nothing


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any op of the forward and backward passes produced in one tensor."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_the_full_logits_is_ever_made():
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 129, HIDDEN), torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (4, 129))
    sizes = {}
    for chunk in (0, 64):
        with LargestTensor() as seen:
            losses_and_grads(hidden, weight, labels, 30.0, chunk)
        sizes[chunk] = seen.largest
    assert sizes[0] >= 4 * 128 * VOCAB  # the full path: [rows x seq x vocab] logits
    assert sizes[64] == 64 * VOCAB  # the chunked one: one chunk of them at most


def test_the_tied_head_under_fsdp_gets_the_models_own_gradients_chunked(tiny_assets, gloo_rank):
    """The model's own output embedding (tied to the input one, FSDP2's unsharded root weight), no copy:
    a packed training step, chunked, gives the loss and every gradient of the plain Hugging Face
    model's own forward (full logits, its soft-cap, its loss) on the same batch."""
    from loop import TrainingData
    from model import freeze_per_layer_embeddings, language_model
    from recipe import predicted_tokens
    from sft_data import model_inputs
    from transformers import AutoModelForCausalLM

    from tests.inprocess import build

    config = settings(tiny_assets, "--loss-chunk", "50", "--eval-split", "none")
    trainee, _ = build(config)
    model = trainee.model
    head = language_model(model).embed_tokens.weight
    assert model.lm_head.weight is head  # tied: one parameter, sharded once
    batch = next(iter(TrainingData(config, trainee.tokenizer, 0, 1).loader))
    loss = trainee.loss(**model_inputs(batch, True, "cpu"))
    loss.backward()
    ours = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}

    plain = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    freeze_per_layer_embeddings(plain)  # as the fine-tune does
    inputs = model_inputs(batch, True, "cpu")
    reference = plain(**inputs).loss * predicted_tokens(inputs["labels"])  # its mean, as a sum
    reference.backward()
    theirs = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert relative(loss.detach(), reference.detach()) < 1e-5
    assert ours.keys() == theirs.keys() and "model.language_model.embed_tokens.weight" in ours
    for name in ours:
        assert relative(ours[name], theirs[name]) < 1e-4, name


def test_peak_memory_is_this_processs_high_water_mark_and_resets():
    from backend import get_backend

    cpu = get_backend("cpu")
    cpu.reset_peak_memory()
    before = cpu.peak_memory_gib()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    during = cpu.peak_memory_gib()
    del block
    assert 0 < before and during - before > 0.05
    cpu.reset_peak_memory()
    assert cpu.peak_memory_gib() < during - 0.05  # the freed block no longer counts
