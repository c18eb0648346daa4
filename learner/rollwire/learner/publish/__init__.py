"""Publishing: each trained adapter version pushed to the target without holding up training."""
