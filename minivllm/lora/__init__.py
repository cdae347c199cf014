"""Many LoRA adapters on one base model, batched together (issue 32): adapters are weights beside the
layers, never merged into them; a step groups its rows by adapter (layers.py, csrc/lora.c)."""
