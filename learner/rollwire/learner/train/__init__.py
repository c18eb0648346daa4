"""The policy step: the GRPO arithmetic, the trainer (model, LoRA adapter, optimiser) and the KL reference
scored by the replicas."""
