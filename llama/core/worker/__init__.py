"""The worker: the runner that executes a step's ops on the model, the KV cache it owns, steps queued ahead, and the exact (row-invariant) passes."""
