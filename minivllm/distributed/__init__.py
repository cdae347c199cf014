"""Tensor parallelism on torch.distributed: Megatron sharding of the weights (sharding.py), the
process group that the runner holds (group.py), and the driver-worker step loop (worker.py)."""
