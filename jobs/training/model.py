"""Every change made to the model, in one place, composed by `build_model` in one order
(torchtitan's parallelize.py):

1. load, in the compute dtype, with the towers --modality needs (text: none);
2. freeze the per-layer embedding table (kept out of FSDP), and the towers unless --train-towers;
3. LoRA adapters (before FSDP, as torchtune does, so each unit holds one dtype);
4. activation checkpointing (before FSDP, so the recomputation gathers the layer again);
5. FSDP2 over the mesh (`device_mesh`: one slice's devices; across slices HSDP, the model sharded
   within each slice and replicated across them): each decoder layer a unit, then the root (with the towers:
   a tower of its own unit would all-gather only on the ranks whose rows hold its media, and ranks whose rows
   differ would call the collectives in different orders),
   `TokenLoss`, whose forward is the summed token loss.

`apply_tp` is here too: the collectives check's tensor-parallel parity applies it to its toy block.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from config.modality import TOWER_CONFIGS, require_towers, towers_of
from data.render import load_tokenizer, stop_token_ids
from runtime import torch_tpu_api
from runtime.memory_plan import TOWER_MODULES, ModelShape, shape_of
from training.checkpoints import is_sharded
from training.chunked_loss import row_log_probs, token_log_probs
from training.lora import TARGET_PATTERN
from training.recipe import token_loss_sum


def load_model(ref: str, dtype: str = "bfloat16", attention: str = "eager", towers: tuple[str, ...] = ()):
    """In the compute dtype (so the unsharded per-layer table matches), with only the `towers` named (text only:
    the causal LM), no KV cache; `attention` is transformers' attn_implementation (eager or sdpa). A gs://
    directory is copied to this machine first."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from runtime.storage import model_directory

    token, ref = os.environ.get("HF_TOKEN"), model_directory(ref)
    config = AutoConfig.from_pretrained(ref, token=token)
    require_towers(config, towers, ref)
    for kind, tower in TOWER_CONFIGS.items():
        if kind not in towers and hasattr(config, tower):
            setattr(config, tower, None)
    auto = AutoModelForImageTextToText if towers else AutoModelForCausalLM
    model = auto.from_pretrained(ref, config=config, dtype=getattr(torch, dtype), attn_implementation=attention,
                                 token=token)  # fmt: skip
    model.config.use_cache = False
    return model


def tower_modules(model) -> list:
    """The towers the model holds and their embedders (none for the causal LM)."""
    return [getattr(model.model, name) for names in TOWER_MODULES.values() for name in names
            if getattr(model.model, name, None) is not None]  # fmt: skip


def packed_media_masks(causal_lm, input_ids, position_ids, token_types):
    """Gemma 4's attention masks for packed rows holding pictures (None when its text config reads them causally):
    full-attention layers causal, sliding ones causal within the window or bidirectional within a picture, and no
    token attending to another record's, the record boundaries found from the positions.

    transformers 5.23's own (modeling_gemma4.py, create_masks_for_vision_model) passes the pictures' blocks to
    create_causal_mask as an or_mask_function, which packed rows call with each token's position in its record
    (masking_utils.py, packed_sequence_compatibility_function remaps the indices) while the blocks are indexed by
    the row: a picture in a row's second record then reads the first's blocks, and its soft tokens lose their
    bidirectional attention (measured on the tiny model: 4.2 apart in the last hidden state). create_causal_mask's
    own block_sequence_ids argument applies them after the remapping. It applies them after the sliding window too:
    the same mask while a picture's soft tokens fit in the window (280 at most by default, Gemma 4's window 512)."""
    from transformers.masking_utils import create_causal_mask, sliding_window_overlay
    from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

    text = causal_lm.config.get_text_config()
    if text.use_bidirectional_attention != "vision":
        return None
    shape = torch.empty((*input_ids.shape, 1), dtype=language_model(causal_lm).embed_tokens.weight.dtype,
                        device=input_ids.device)  # (its shape, dtype and device are all the masks read)  # fmt: skip
    blocks = get_block_sequence_ids_for_mask(token_types, device=input_ids.device)
    return {
        "full_attention": create_causal_mask(text, shape, None, None, position_ids),
        "sliding_attention": create_causal_mask(text, shape, None, None, position_ids, block_sequence_ids=blocks,
                                                and_mask_function=sliding_window_overlay(text.sliding_window)),
    }  # fmt: skip


def image_encodings(model, input_ids, media: dict) -> dict:
    """`media` with its pictures encoded as the model's own get_image_features encodes them (the vision tower, then
    its embedder), but without the blank pictures' rows (data/media_rows.RecordMedia): the real pictures come first,
    so their soft tokens are the first rows, as many as the prompt has image tokens, and each blank's one pooled row
    is past them. (transformers splits the rows by each picture's real patches, which a blank's pooled row breaks.)
    The tower's inputs keep the batch's one shape; only the rows kept vary."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    media = dict(media)
    pixels, positions = media.pop("pixel_values"), media.pop("image_position_ids")
    encoded = model.vision_tower(pixel_values=pixels, pixel_position_ids=positions)
    pooled = model.embed_vision(inputs_embeds=encoded.last_hidden_state)
    soft = int((input_ids == model.config.image_token_id).sum())
    return media | {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=(pooled[:soft],))}}


def idle_towers(model, media: dict):
    """0 x the output of each tower this micro-batch gives nothing to (a rank whose rows hold no picture, say), run on
    a blank input, when the towers train: every trainable weight then has a gradient (zeros) on every rank, as the
    root unit's reduce-scatter needs (each rank sends the same parameters' gradients), and the loss is unchanged.
    The blank picture is one pooling window of patches (one soft token), the blank clip 16 silent frames."""
    zero = torch.zeros((), device=next(model.parameters()).device)
    if model.vision_tower is not None and "pixel_values" not in media and "mm_encoder_outputs" not in media:
        vision = model.config.vision_config
        k, patch = vision.pooling_kernel_size, vision.patch_size
        positions = torch.tensor([[[x, y] for y in range(k) for x in range(k)]], device=zero.device)
        pixels = torch.zeros((1, k * k, 3 * patch * patch), device=zero.device)
        zero = zero + 0.0 * sum(f.float().sum() for f in model.get_image_features(pixels, positions).pooler_output)
    if model.audio_tower is not None and "input_features" not in media:
        bins = model.config.audio_config.subsampling_conv_channels[0]  # the mel bins (modeling_gemma4's projection)
        frames = torch.zeros((1, 16, bins), device=zero.device)
        mask = torch.ones((1, 16), dtype=torch.bool, device=zero.device)
        zero = zero + 0.0 * model.get_audio_features(frames, mask).pooler_output.float().sum()
    return zero


def freeze_towers(model) -> None:
    """The vision and audio towers and their embedders trained no further (the default; --train-towers trains
    them)."""
    for module in tower_modules(model):
        module.requires_grad_(False)


def language_model(model):
    return getattr(model.model, "language_model", model.model)


def freeze_per_layer_embeddings(model):
    """The per-layer embedding table is huge and trained no further: frozen, and kept out of FSDP. None for a model
    without one (12B's gemma4_unified text model has no such module)."""
    table = getattr(language_model(model), "embed_tokens_per_layer", None)
    if table is None:
        return None
    table.weight.requires_grad_(False)
    return table.weight


def apply_lora(model, rank: int, alpha: int):
    """Inject the adapters (the base is frozen by peft); returns the peft LoraConfig (the export needs it)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGET_PATTERN, lora_dropout=0.0, bias="none")
    inject_adapter_in_model(config, model)
    return config


def apply_activation_checkpointing(model) -> None:
    """Recompute every decoder layer in the backward pass (transformers' non-reentrant checkpointing of
    its GradientCheckpointingLayer)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_compile(model, backend: str) -> None:
    """torch.compile each decoder layer in place (Module.compile: the same module, so FSDP2 wraps it and the
    checkpoints' names do not change), as torchtitan compiles each block; dynamic=False, packed rows keeping every
    step's shapes. Evals and sample answers run eager (training_run.TrainingRun.evaluate)."""
    for layer in language_model(model).layers:
        layer.compile(dynamic=False, backend=backend)


def compile_counts(settings) -> dict[str, int]:
    """What grows when a step compiles again: with settings.compile, the frames torch.compile has compiled
    (torch._dynamo's counters); on TPU, TorchTPU's program-cache misses (fused eager's programs too)."""
    from torch._dynamo.utils import counters

    counts = {"recompiles": counters["frames"]["total"]} if settings.compile else {}
    misses = torch_tpu_api.cache_misses() if settings.backend == "tpu" else None
    return counts if misses is None else counts | {"program_cache_misses": misses}


class TokenLoss(torch.nn.Module):
    """The training forward: the sum of the model's token losses, never its logits (loss_chunk tokens of
    logits at a time; 0: all at once). The FSDP root, so the tied head it reads is the root's unsharded
    weight, gathered once for the step, with no copy."""

    def __init__(self, causal_lm, loss_chunk: int, attention_kernels=nullcontext):
        super().__init__()
        self.causal_lm, self.loss_chunk, self.attention_kernels = causal_lm, loss_chunk, attention_kernels
        self.softcap = causal_lm.config.get_text_config().final_logit_softcapping

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None, per_row: bool = False,
                temperature: float | None = None, **media):  # fmt: skip
        """The token losses' sum; `per_row`: each row's sum of log p(label) instead (DPO's, dpo.py); `temperature`:
        each position's log p(label) at that temperature (GRPO's, grpo.py). `media`: the
        towers' inputs (prepared.RecordMedia.of), the soft tokens' types derived from the ids as the processor
        derives them (1 a picture's, 3 a clip's: processing_utils.create_mm_token_type_ids)."""
        if media:
            media["mm_token_type_ids"] = self.media_token_types(input_ids)
            if attention_mask is None and position_ids is not None:  # packed rows
                attention_mask = packed_media_masks(self.causal_lm, input_ids, position_ids, media["mm_token_type_ids"])
        if "pixel_values" in media:
            media = image_encodings(self.causal_lm.model, input_ids, media)
        with self.attention_kernels():
            out = self.causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=False, **media)  # fmt: skip
        if temperature is not None:
            return token_log_probs(out.last_hidden_state, self.causal_lm.lm_head.weight, labels, self.softcap,
                                   temperature)  # fmt: skip
        if per_row:
            return row_log_probs(out.last_hidden_state, self.causal_lm.lm_head.weight, labels, self.softcap,
                                 self.loss_chunk)  # fmt: skip
        summed = token_loss_sum(out.last_hidden_state, self.causal_lm.lm_head.weight, labels, self.softcap,
                                self.loss_chunk)  # fmt: skip
        return summed + idle_towers(self.causal_lm.model, media) if self.trains_towers() else summed

    def trains_towers(self) -> bool:
        return any(p.requires_grad for m in tower_modules(self.causal_lm) for p in m.parameters())

    def media_token_types(self, input_ids):
        config = self.causal_lm.config
        types = torch.zeros_like(input_ids)
        types = torch.where(input_ids == config.image_token_id, 1, types)
        return torch.where(input_ids == config.audio_token_id, 3, types)


def device_mesh(device_type: str, world: int, num_slices: int = 1):
    """One dimension over every device of one slice; with more slices two, as Google's TorchTPU sample builds
    it: ("dp_replicate", "dp_shard") = (slices, devices a slice). Ray Train numbers the workers slice by
    slice (its MEGASCALE_SLICE_ID is rank // workers a slice), so each row, a dp_shard group, is one slice:
    FSDP's all-gathers and reduce-scatters stay on the slice's ICI and only the gradients' all-reduce
    crosses the data-centre network between slices."""
    from torch.distributed.device_mesh import init_device_mesh

    if num_slices == 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (num_slices, world // num_slices), mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_fsdp(root: TokenLoss, mesh, ignored: set, dtype: str = "bfloat16") -> TokenLoss:
    """FSDP2: each decoder layer, then the root; params in the compute dtype, fp32 gradient reduction.
    On a 2-D mesh FSDP2 is HSDP: sharded over the second dimension, replicated over the first.

    Each whole decoder layer is a unit (torchtitan's layout): only two are unsharded at a time. (The
    walkthrough shards only the MLPs, which leaves every attention projection in the root, gathered
    for the whole step: 15 GB of a 32 GB v6e chip for 31B.) Gradients are summed over ranks, not
    averaged: the loss is already divided by the global count of predicted tokens (step.train_step),
    so an average would divide a second time. Under HSDP that holds for both reductions (the reduce-scatter
    within a slice, the all-reduce across slices): one global batch is one sum.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    for layer in language_model(root.causal_lm).layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # SUM, which every backend has (gloo has no AVG)
    return root


def apply_tp(model, mesh):
    """Megatron-style: W1 split by output columns, W2 by input rows; one all-reduce per forward."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def stop_at_end_of_turn(model, tokenizer) -> None:
    """generate() stops at the chat template's end-of-turn token as well as at EOS (render.stop_token_ids)."""
    eos = model.generation_config.eos_token_id
    ids = stop_token_ids(tokenizer, eos)
    if ids != ([eos] if isinstance(eos, int) else list(eos or [])):
        model.generation_config.eos_token_id = ids


@dataclass
class Trainee:
    """What `build_model` makes: `loss` is what the loop calls (the FSDP root); `model` the Hugging Face
    model inside it (checkpoints and the export read it); `lora` the adapters' config, if any; `shape`
    the model before LoRA, for the memory plan."""

    loss: TokenLoss
    model: object
    tokenizer: object
    lora: object | None
    shape: ModelShape


def load_model_and_tokenizer(settings, dtype: str, restored):
    """Weights from --model, or from a walkthrough-style (full) checkpoint being resumed; a sharded
    checkpoint is loaded on top afterwards (checkpoints.ShardedCheckpointer)."""
    full = restored is not None and not is_sharded(restored)
    with restored.as_directory() if full else nullcontext(None) as restored_dir:
        source = restored_dir or settings.model
        tokenizer = load_tokenizer(settings.tokenizer or source)
        model = load_model(source, dtype, settings.attention, towers_of(settings.modality))
    return model, tokenizer


def flash_on_tpu():
    """SDPA's OVERRIDEABLE backend, which TorchTPU fills with its flash (splash) kernel: how Google's newer TorchTPU
    sample runs attention (as issue 36 reports it; not read here). Whether that kernel takes Gemma 4's 512-wide
    global heads is not known (FlashAttention rejects them: ../shared/FACTS.md), so TPU runs default to eager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.OVERRIDEABLE])


def packed_masks_without_host_reads() -> None:
    """transformers 5.23 finds packed rows' documents from their position ids, then asks the device whether there
    is more than one (`if (packed_sequence_mask[:, -1] == 0).all(): return None`, masking_utils.py
    `find_packed_sequence_indices`): a host read in every forward, twice for Gemma 4's two mask kinds, which
    splits TorchTPU's fused program. Its own comment says the all-zero indices it returns under compile mean the
    same as None; so they are kept: the same masks, no read."""
    from transformers import masking_utils

    if getattr(masking_utils.find_packed_sequence_indices, "reads_nothing", False):
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor:
        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    find_packed_sequence_indices.reads_nothing = True
    find_packed_sequence_indices.original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def build_model(settings, backend, dtype: str, world: int, restored) -> Trainee:
    """The model as it trains, every change in this module's order, over all ranks."""
    packed_masks_without_host_reads()
    model, tokenizer = load_model_and_tokenizer(settings, dtype, restored)
    if settings.chat_template:
        stop_at_end_of_turn(model, tokenizer)
    frozen = freeze_per_layer_embeddings(model)
    if not settings.train_towers:
        freeze_towers(model)
    shape = shape_of(model)  # before LoRA: the plan adds the adapters itself
    lora = apply_lora(model, settings.lora_rank, settings.lora_alpha) if settings.lora else None
    if settings.activation_checkpointing:
        apply_activation_checkpointing(model)
    if settings.compile:
        apply_compile(model, torch_tpu_api.COMPILE_BACKEND if backend.name == "tpu" else "inductor")
    model.to(backend.device())
    mesh = device_mesh(backend.device_type, world, settings.num_slices)
    kernels = flash_on_tpu if backend.name == "tpu" and settings.attention == "sdpa" else nullcontext
    root = apply_fsdp(TokenLoss(model, settings.loss_chunk, kernels), mesh, ignored={frozen} - {None}, dtype=dtype)
    root.train()  # (from_pretrained gives eval mode, where transformers skips activation checkpointing)
    return Trainee(root, model, tokenizer, lora, shape)


def adamw(trainee: Trainee, settings) -> torch.optim.Optimizer:
    """AdamW over what is trainable (everything but the per-layer table, or LoRA's adapters), its learning rate a
    device tensor each step writes into (step.set_lr): no program's constant changes from step to step. On TPU,
    TorchTPU's own AdamW (torch_tpu_api); elsewhere torch's fused one, whose step counts stay on the device
    (torch/optim/adam.py's default path reads each with .item())."""
    trainable = [p for p in trainee.model.parameters() if p.requires_grad]
    lr = torch.tensor(settings.lr, dtype=torch.float32, device=trainable[0].device)
    if settings.backend == "tpu":
        return torch_tpu_api.adamw(trainable, lr, settings.weight_decay)
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=settings.weight_decay, fused=True)
