"""Rollouts of the learner's own: requesting and scoring groups through the target, the scored group, the buffer
and its ledger, and the admission rules that decide what is requested, kept and trained on."""
