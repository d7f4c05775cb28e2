"""LoRA adapters: PEFT loading and validation, tensor-parallel sharding."""
