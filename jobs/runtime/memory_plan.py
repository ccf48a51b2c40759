"""How much device memory a fine-tune needs: one estimate, in one function (`plan`).

No imports beyond the standard library: the stack runs it at preview (infra/cloud/models.py holds the
Gemma 4 rows), and the job runs it on the model it loaded, to print next to what it measured.

Assumptions, per device, in bytes (w: bytes per parameter of the compute dtype, 2 for bf16):
- FSDP2 shards every parameter but the per-layer embedding table over the devices; each decoder
  layer is a unit, the root (token embedding = the tied LM head) another. Sharded: weights w,
  gradients w and AdamW's two moments 2w per *trainable* parameter (all of them, or LoRA's
  adapters, r x (in + out) per targeted linear layer).
- Unsharded at any time: the per-layer table (frozen, kept out of FSDP); the root unit (gathered
  for the whole step) and two decoder layers (the one computing, the next prefetched); when the
  base is trained, their unsharded gradients as well, before the reduce-scatter.
- Activations kept for the backward pass, per token and layer: w x (8 hidden + 2 query + 2 key/value
  + 4 MLP width) plus eager attention's heads x seq_len scores and probabilities (w + 4 + w; eager
  attention makes the whole [seq, seq] matrix even in sliding layers). With activation
  checkpointing only each layer's input is kept, and one layer's activations exist during its
  recomputation.
- Logits: the full path holds rows x seq x vocab in w, fp32 and the fp32 gradient; the chunked
  loss one chunk's three fp32 [chunk, vocab] buffers (the head's gradient it accumulates is the
  root unit's unsharded gradient, counted above).
- The vision and audio towers the data needs (none for text), whole on every device: `towers_bytes`.
- It leaves HEADROOM of the device's memory free for the runtime, XLA's workspace and
  fragmentation. It is an estimate: the job prints it beside the measured peak, every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30
HEADROOM = 0.10


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: parameter counts and the widths activations take."""

    name: str
    params: int  # every parameter of the text model, the tied head counted once
    per_layer_table: int  # embed_tokens_per_layer: frozen, never sharded (0: none)
    embedding: int  # embed_tokens, which is also the LM head
    largest_layer: int  # parameters of the largest decoder layer (one FSDP unit)
    lora_in_out: int  # sum of (in + out) over LoRA's target linear layers: rank r adds r x this
    layers: int
    hidden: int
    mlp_width: int  # per token: the MLP's intermediate width (mean over layers; MoE: + top-k experts')
    query_width: int  # heads x head_dim (mean over layers)
    kv_width: int  # key/value heads x head_dim (mean over layers; 0 where layers share them)
    heads: int
    vocab: int
    sliding_window: int  # tokens a sliding-window layer attends to (every few layers attend to all)
    active_params: int  # the weights a token passes through: all but the per-layer table, and of a mixture
    # of experts only its top-k experts' share
    experts: int = 0  # a mixture of experts: the experts per layer (0: dense)


@dataclass(frozen=True)
class Workload:
    """What the plan needs of a run: its devices, rows and the choices that change memory."""

    devices: int
    batch: int  # rows per device
    seq_len: int
    dtype_bytes: int = 2
    activation_checkpointing: bool = False
    lora: bool = False
    lora_rank: int = 16
    loss_chunk: int = 256
    sequences: int = 1  # rows a record makes (sequences_per_record)
    tower_params: int = 0  # the vision and audio towers loaded (with their embedders): in the root unit
    train_towers: bool = False
    sampler: bool = False  # GRPO: the learner generates its completions (a KV cache for its rows)
    reference: bool = False  # GRPO with beta > 0: the starting weights, sharded as the learner's


def grpo_parts(objective: str, beta: float) -> dict:
    """Workload's GRPO fields for a run's objective and beta (docs/grpo.md: the sampler is the learner)."""
    return {"sampler": objective == "grpo", "reference": objective == "grpo" and beta > 0}


def sequences_per_record(objective: str) -> int:
    """Rows a record makes in a forward pass: a DPO pair two (its chosen and rejected answers), else one."""
    return 2 if objective == "dpo" else 1


@dataclass(frozen=True)
class MemoryPlan:
    parts: dict[str, float]  # GiB per device
    hbm_gib: float | None  # the device's memory (None: unknown, as on CPU)
    headroom: float = HEADROOM  # the share of it left free

    @property
    def total_gib(self) -> float:
        return sum(self.parts.values())

    @property
    def usable_gib(self) -> float | None:
        return None if self.hbm_gib is None else self.hbm_gib * (1 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.usable_gib is None or self.total_gib <= self.usable_gib

    def as_output(self) -> dict:
        out = {k: round(v, 2) for k, v in self.parts.items()} | {"total_gib": round(self.total_gib, 2)}
        if self.hbm_gib is not None:
            out |= {"hbm_gib": self.hbm_gib, "usable_gib": round(self.usable_gib, 2),
                    "headroom_gib": round(self.usable_gib - self.total_gib, 2), "fits": self.fits}  # fmt: skip
        return out


def trainable_params(model: ModelShape, workload: Workload) -> int:
    return workload.lora_rank * model.lora_in_out if workload.lora else model.params - model.per_layer_table


def plan(model: ModelShape, workload: Workload, hbm_gib: float | None = None) -> MemoryPlan:
    """Bytes per device of a fine-tune of `model` under `workload`, by part (see the module's docstring)."""
    w, devices = workload.dtype_bytes, workload.devices
    trainable = trainable_params(model, workload)
    sharded = model.params - model.per_layer_table + (trainable if workload.lora else 0)
    gathered = model.embedding + 2 * model.largest_layer
    tokens = workload.batch * workload.sequences * workload.seq_len
    per_token_layer = w * (8 * model.hidden + 2 * model.query_width + 2 * model.kv_width + 4 * model.mlp_width)
    per_token_layer += model.heads * workload.seq_len * (w + 4 + w)
    if workload.activation_checkpointing:
        activations = tokens * (model.layers * model.hidden * w + per_token_layer)
    else:
        activations = tokens * model.layers * per_token_layer
    if workload.loss_chunk > 0:  # (the head's gradient it accumulates is the root's unsharded gradient above)
        logits = min(workload.loss_chunk, tokens) * model.vocab * 4 * 3
    else:
        logits = tokens * model.vocab * (w + 4 + 4)
    parts = {
        "weights": sharded * w / devices,
        "gradients": trainable * w / devices,
        "optimizer": 2 * trainable * w / devices,
        "frozen_tables": model.per_layer_table * w,
        "gathered": gathered * w * (1 if workload.lora else 2),
        "activations": activations,
        "logits": logits,
    }
    if workload.tower_params:
        parts["towers"] = towers_bytes(workload)
    if workload.sampler:  # generate()'s keys and values: every layer's, for each of this device's rows
        parts["kv_cache"] = 2 * model.kv_width * model.layers * w * workload.batch * workload.seq_len
    if workload.reference:  # a second copy of the weights, frozen: no gradients, no optimizer state
        parts["reference"] = (model.params - model.per_layer_table) * w / devices + model.per_layer_table * w
    return MemoryPlan({k: v / GIB for k, v in parts.items()}, hbm_gib)


def towers_bytes(workload: Workload) -> float:
    """The vision and audio towers: in the root unit (training/model.py), so gathered for the whole step, and with
    --train-towers their unsharded gradients too and their sharded AdamW moments. Their activations are not kept
    when they are frozen (nothing in them needs a gradient); trained, they are left out of the plan."""
    w, towers = workload.dtype_bytes, workload.tower_params
    return towers * w * (2 if workload.train_towers else 1) + (2 * towers * w / workload.devices
                                                              if workload.train_towers else 0)  # fmt: skip


# vLLM TPU's share of a device for the weights and the KV cache (its gpu_memory_utilization); the rest is XLA's
# workspace. tpu-inference's own CI serves Gemma 4 E4B at 0.85 on one v6e chip, E2B at 0.94, and 0.98 runs out of
# memory in the decode precompile (.buildkite/models/google_gemma-4-E2B-it.yml, google_gemma-4-E4B-it.yml).
SERVE_MEMORY_UTILIZATION = 0.85
# Sequences of the full context the plan keeps room for at once (the served evaluation's and make bench's 8
# concurrent requests); vLLM gives the KV cache whatever else is free and queues what does not fit.
SERVE_SEQUENCES = 8


def serving_plan(model: ModelShape, devices: int, max_model_len: int, hbm_gib: float | None = None,
                 sequences: int = SERVE_SEQUENCES) -> MemoryPlan:  # fmt: skip
    """Bytes per device of serving `model` in bf16 with its weights and KV cache split over `devices` (tensor
    parallelism): every parameter (the per-layer table too), and keys and values for `sequences` sequences of
    `max_model_len` tokens in each layer that keeps its own (KV-shared layers keep none; a sliding-window layer is
    counted at full length, vLLM's bound before its hybrid allocator trims it)."""
    w = 2
    kv_per_token = 2 * model.kv_width * model.layers * w
    parts = {"weights": model.params * w / devices, "kv_cache": kv_per_token * max_model_len * sequences / devices}
    return MemoryPlan({k: v / GIB for k, v in parts.items()}, hbm_gib, headroom=1 - SERVE_MEMORY_UTILIZATION)


def remedy(model: ModelShape, workload: Workload, hbm_gib: float, topologies: dict[str, int],
           grad_accum: int = 1) -> str | None:  # fmt: skip
    """The first change that fits, with the values to set, trying in this order: activation checkpointing;
    LoRA; fewer rows a device with `gradAccum` raised to keep the global batch; a larger topology of the same
    generation (`topologies`: name -> devices). Each step is tried alone and with the ones before it but
    LoRA (which changes what is trained, so it is never slipped into a full fine-tune's advice); then all
    of them together; then, last, a shorter sequence (a power of two). None when nothing fits."""
    rows = workload.batch * grad_accum  # a device's rows per optimizer step (the global batch / devices)
    batches = [workload.batch] + [b for b in range(workload.batch - 1, 0, -1) if rows % b == 0]
    larger = [t for t, d in sorted(topologies.items(), key=lambda t: t[1]) if d > workload.devices]
    steps = [[{}], [{"lora": True}], [{"batch": b} for b in batches[1:]],
             [{"devices": topologies[t], "batch": b} for t in larger for b in batches]]  # fmt: skip
    tries = [c | ac for step in steps for c in step for ac in ({}, {"activation_checkpointing": True})]
    tries += [{"lora": True, "activation_checkpointing": True, "batch": b} | ({"devices": topologies[t]} if t else {})
              for t in [None, *larger] for b in batches]  # fmt: skip
    shorter = [2**k for k in range(workload.seq_len.bit_length() - 1, 6, -1) if 2**k < workload.seq_len]
    tries += [{"seq_len": n} | ac for n in shorter for ac in ({}, {"activation_checkpointing": True})]
    for changes in tries:
        changed = {k: v for k, v in changes.items() if getattr(workload, k) != v}
        if changed and (p := plan(model, replace(workload, **changed), hbm_gib)).fits:
            names = {d: t for t, d in topologies.items()}
            same_batch = "; the global batch unchanged" if "batch" in changed else ""
            return f"{_settings(changed, names, rows)} ({p.total_gib:.1f} GiB{same_batch})"
    return None


def _settings(changed: dict, topology_of: dict[int, str], rows: int) -> str:
    """The stack keys of a change to a workload, in the advice's order."""
    said = {
        "activation_checkpointing": "activationCheckpointing: true",
        "lora": "lora: true",
        "batch": f"batchSize: {changed.get('batch')}, gradAccum: {rows // changed.get('batch', 1)}",
        "devices": f"tpuTopology: {topology_of.get(changed.get('devices'))}",
        "seq_len": f"seqLen: {changed.get('seq_len')}",
    }
    return ", ".join(said[k] for k in said if k in changed)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# a tower's kind -> its modules in Gemma4Model (transformers 5.23, modeling_gemma4.py): the tower and its embedder
TOWER_MODULES = {"image": ("vision_tower", "embed_vision"), "audio": ("audio_tower", "embed_audio")}


def in_a_tower(name: str) -> bool:
    """Whether a parameter's or module's dotted name is inside a vision or audio tower or its embedder."""
    return any(f".{t}." in f".{name}." for names in TOWER_MODULES.values() for t in names)


def text_params(model) -> list:
    """The text model's parameters, each once (the tied head): not the vision and audio towers (Workload counts
    those)."""
    named = {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=True)}.values()
    return [p for n, p in named if not in_a_tower(n)]


def shape_of(model, name: str = "") -> ModelShape:
    """A loaded Hugging Face Gemma 4 model's shape (the table's rows are this, on the published configs)."""
    import torch

    text = model.config.get_text_config()
    language = getattr(model.model, "language_model", model.model)
    layers = list(language.layers)
    table = getattr(language, "embed_tokens_per_layer", None)

    def width(layer, module: str) -> int:
        found = [
            m.out_features for n, m in layer.named_modules() if n.endswith(module) and isinstance(m, torch.nn.Linear)
        ]
        return found[0] if found else 0

    def mlp(layer) -> int:
        experts = (text.top_k_experts or 0) * (text.moe_intermediate_size or 0) if hasattr(layer, "experts") else 0
        return width(layer, "mlp.up_proj") + experts

    experts = sum(p.numel() for n, p in language.named_parameters() if ".experts." in n)
    top_k = (text.top_k_experts or 0) / (text.num_experts or 1) if experts else 0
    targets = [m for n, m in language.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in LORA_TARGETS]  # fmt: skip
    return ModelShape(
        name=name or getattr(model.config, "_name_or_path", ""),
        params=sum(p.numel() for p in text_params(model)),
        per_layer_table=table.weight.numel() if table is not None else 0,
        embedding=language.embed_tokens.weight.numel(),
        largest_layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        lora_in_out=sum(m.in_features + m.out_features for m in targets),
        layers=len(layers),
        hidden=text.hidden_size,
        mlp_width=sum(mlp(layer) for layer in layers) // len(layers),
        query_width=sum(width(layer, "q_proj") for layer in layers) // len(layers),
        kv_width=sum(width(layer, "k_proj") for layer in layers) // len(layers),
        heads=text.num_attention_heads,
        vocab=text.vocab_size,
        sliding_window=text.sliding_window,
        active_params=sum(p.numel() for p in text_params(model))
        - (table.weight.numel() if table is not None else 0)
        - round(experts * (1 - top_k)),
        experts=(text.num_experts or 0) if getattr(text, "enable_moe_block", False) else 0,
    )
