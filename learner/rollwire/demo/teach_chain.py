"""The chained-addition build of the taught model (`make demo-agent`): its spec.

The chain model is taught like the single-turn one (teach.py: an exact teacher first, then
one that forgets carries in most answers), on whole episodes of learner/tasks/chain.py with the
environment's questions in the context but out of the loss, so RL has room on every turn; its
build report checks whole episodes (teach.greedy_chain_success).
"""

from __future__ import annotations

from rollwire.demo.teach import TeachSpec
from rollwire.demo.tiny_model import TinyModelSpec
from rollwire.learner.tasks.chain import TURNS

CHAIN_SPEC = TeachSpec(
    model=TinyModelSpec(max_position_embeddings=64),
    steps=600,
    threads=2,
    chain_turns=TURNS,
)
"""600 steps on both cores (~2 min here): the built model answers 12% of held-out episodes as
1000 steps on one did, in a third of the time, so a first `make demo-agent` (teaching
included) stays under 5 minutes."""
