"""Scheduling and paging: the scheduler's slot and queue state, the typed ops of a step, and the paged KV pool's bookkeeping (no tensors)."""
