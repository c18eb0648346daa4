"""The chained-addition build of the taught model (`make demo-agent`): its spec and its check.

The chain model is taught like the single-turn one (teach.py: an exact teacher first, then
one that forgets carries in most answers), on whole episodes of learner/chain.py with the
environment's questions in the context but out of the loss, so RL has room on every turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollwire.demo.teach import TeachSpec
from rollwire.demo.tiny_model import TinyModelSpec
from rollwire.learner.chain import TURNS, from_example, question, read_answer
from rollwire.learner.task import Example

CHAIN_SPEC = TeachSpec(
    model=TinyModelSpec(max_position_embeddings=64),
    steps=1000,
    chain_turns=TURNS,
)


def greedy_chain_success(model, encode, tokenizer, examples: Sequence[Example], max_new_tokens: int = 4) -> float:
    """Share of held-out episodes whose every turn the model answers right, greedily, in-process."""
    import torch

    chains = [from_example(e) for e in examples]
    histories = [encode(c.prompt) for c in chains]
    operands = [(c.a, c.b) for c in chains]
    alive = [True] * len(chains)
    for turn in range(TURNS):
        rows = [i for i, ok in enumerate(alive) if ok]
        if not rows:
            break
        width = max(len(histories[i]) for i in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, width - len(histories[i]) :] = torch.tensor(histories[i])
            mask[r, width - len(histories[i]) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        for r, i in enumerate(rows):
            answer = read_answer(tokenizer.decode(out[r, width:], skip_special_tokens=True))
            left, right = operands[i]
            if answer is None or answer != left + right:
                alive[i] = False
                continue
            if turn + 1 < TURNS:
                addend = chains[i].addends[turn]
                histories[i] += [*encode(f"{answer:03d}"), tokenizer.eos_token_id, *encode(question(answer, addend))]
                operands[i] = (answer, addend)
    return sum(alive) / len(chains)
