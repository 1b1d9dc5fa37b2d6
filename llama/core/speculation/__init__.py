"""Speculative decoding: drafting (prompt lookup, predictions, a draft model), the verify step's bookkeeping, and the step times that decide when drafting pays."""
