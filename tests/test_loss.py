"""The chunked cross-entropy: the full path's loss and gradients, without ever the full logits."""

from __future__ import annotations

import pytest
import torch

from data.labels import IGNORE
from tests.inprocess import settings
from training.recipe import token_loss_sum

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


def ours_and_theirs(assets: dict, *flags: str) -> tuple[dict, dict]:
    """One training step's first micro-batch through the fine-tune's model (model.build_model: FSDP2, the
    TokenLoss forward) and through the plain Hugging Face model's own forward (full logits, its soft-cap,
    its loss): ({"loss": ..., gradient name: ...}, the same for transformers)."""
    from transformers import AutoModelForCausalLM

    from data.labels import predicted_tokens
    from data.sft_data import model_inputs
    from tests.inprocess import build
    from training.model import freeze_per_layer_embeddings
    from training.step import TrainingData

    config = settings(assets, "--eval-split", "none", *flags)
    trainee, _ = build(config)
    batch = next(iter(TrainingData(config, trainee.tokenizer, 0, 1).loader))
    inputs = model_inputs(batch, config.packing, "cpu")
    loss = trainee.loss(**inputs)
    loss.backward()
    ours = {n: p.grad.full_tensor() for n, p in trainee.model.named_parameters() if p.grad is not None}

    # eager attention, as the fine-tune loads it: transformers' sdpa path differs from its eager one on rows
    # longer than a sliding window (measured: gradients 2.5e-4 apart in float64, 8.7e-4 in float32)
    plain = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32, attn_implementation="eager")
    freeze_per_layer_embeddings(plain)  # as the fine-tune does
    reference = plain(**inputs).loss * predicted_tokens(inputs["labels"])  # its mean, as a sum
    reference.backward()
    theirs = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    return {"loss": loss.detach()} | ours, {"loss": reference.detach()} | theirs


def test_the_tied_head_under_fsdp_gets_the_models_own_gradients_chunked(tiny_assets, gloo_rank):
    """The model's own output embedding (tied to the input one, FSDP2's unsharded root weight), no copy:
    a packed training step, chunked, gives the loss and every gradient of the plain Hugging Face
    model's own forward on the same batch."""
    ours, theirs = ours_and_theirs(tiny_assets, "--loss-chunk", "50")
    assert relative(ours["loss"], theirs["loss"]) < 1e-5
    assert ours.keys() == theirs.keys() and "model.language_model.embed_tokens.weight" in ours
    for name in ours:
        assert relative(ours[name], theirs[name]) < 1e-4, name


@pytest.fixture(scope="module")
def tiny_e2b(tiny_assets, tmp_path_factory):
    """The tiny Gemma 4 with E2B's structure (jobs/tiny_assets.py's `e2b` size), same tokenizer."""
    from tests.inprocess import tiny_of_size

    return tiny_of_size("e2b", tiny_assets, tmp_path_factory.mktemp("e2b") / "model")


@pytest.mark.parametrize("rows", ["packed", "padded"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "recomputed"])
def test_kv_shared_layers_train_on_transformers_own_loss(tiny_e2b, rows, checkpointing, gloo_rank):
    """E2B's 20 of 35 layers reuse earlier layers' keys and values; some transformers versions broke that
    without a cache or under gradient checkpointing (loss 10-15). The tiny E2B (4 of 7 shared) through the
    fine-tune's forward, packed and padded, activations stored and recomputed: transformers' loss and
    gradients."""
    flags = ["--loss-chunk", "50", "--packing" if rows == "packed" else "--no-packing"]
    ours, theirs = ours_and_theirs(tiny_e2b, *flags, *(["--activation-checkpointing"] if checkpointing else []))
    assert relative(ours["loss"], theirs["loss"]) < 1e-5
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert relative(ours[name], theirs[name]) < 1e-4, name
    shared = [n for n in ours if ".layers.6.self_attn.k_proj" in n]
    assert shared == []  # the last layer is KV-shared: it has no k_proj of its own to train


def test_the_tiny_e2b_shares_its_kv_like_e2b(tiny_e2b):
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(tiny_e2b["model"]).get_text_config()
    assert (text.num_hidden_layers, text.num_kv_shared_layers) == (7, 4)  # E2B: 35 and 20, the same share
    assert set(text.layer_types) == {"sliding_attention", "full_attention"} and text.layer_types[-1] == "full_attention"


def test_peak_memory_is_this_processs_high_water_mark_and_resets():
    from runtime.backend import get_backend

    cpu = get_backend("cpu")
    cpu.reset_peak_memory()
    before = cpu.peak_memory_gib()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    during = cpu.peak_memory_gib()
    del block
    assert 0 < before and during - before > 0.05
    cpu.reset_peak_memory()
    assert cpu.peak_memory_gib() < during - 0.05  # the freed block no longer counts
