"""The training: the model, one step, the run around the steps; imports data/, config/ and runtime/.

- model: every change to the model (load, freeze, LoRA, activation checkpointing, FSDP2), in one order
- lora: the adapters and their merge; checkpoints: sharded and full saves, resume, the export
- recipe, chunked_loss: the schedule, the loss and its normalisation, clipping; the chunked cross-entropy
- step: one optimizer step and its parts; dpo: DPO's loss, metrics and step; preferences: the pairs'
  loaders and reference log-probabilities
- grpo: GRPO's advantages, loss and step (TRL's); rewards: its reward functions; sampler: the learner's own
  generation; grpo_iteration: sample, score, step; grpo_objective: --objective grpo in the run loop; prompts:
  the prompts prepared once and each rank's loader
- objectives: what is trained (sft, dpo or grpo); training_run: the run loop (progress, evals, saves, stops)
- stopping: a preemption notice or SIGTERM turned into a save; samples: greedy answers at each eval

Called by ray_train_llm_finetune.py's train_loop_per_worker, and by evaluation/.
"""
