"""The built-in tasks (single-turn and chained addition), the data streams, rewards and held-out evaluation."""
