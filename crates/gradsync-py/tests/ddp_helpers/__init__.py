"""Helpers of the torch.distributed and DDP tests: launching ranks, and the programs they run."""
