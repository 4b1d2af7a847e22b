"""LoRA adapters over a resident base model: reading them (`reading`) and the room a
replica keeps for them on its device, with the batched product that applies them (`room`)."""
