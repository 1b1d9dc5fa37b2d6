"""From logits to a token: temperature, top-p/top-k, seeded draws, log-probabilities, and grammar masks."""
