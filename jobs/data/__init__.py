"""The data's path, from a file or a hub dataset to the rows a rank trains on; imports config/ and runtime/.

- labels: IGNORE (a position not trained on) and the count of predicted positions
- sft_data: load and split the records, pack and lay out rows
- render: records to chat turns to tokens (the prompt masked, the end of turn trained)
- prepare: every record checked, rendered and laid out once, before any worker starts (Ray Data), under
  <storage>/prepared/<key>; prepared: those rows read back memory-mapped, and the data report
- preference_data: DPO's pairs checked and tokenized as TRL's DPOTrainer does
- prompt_data: GRPO's prompt records checked and tokenized; tiny_records: the tiny pairs, prompts and reward file

Called by training/ (each rank's loader), evaluation/ (the held-out records) and the fine-tune's driver.
"""
