"""The built-in task on the taught model (built once and cached by its key, ~1 min on a fresh
clone): batched greedy completions equal each prompt's alone."""

from __future__ import annotations

from typing import Any

from rollwire.learner.tasks.task import (
    addition_examples,
    eval_subset,
)


def test_batched_greedy_completions_equal_each_prompt_alone(taught_model):
    """The build report's accuracy is a left-padded batch; it must score what each prompt gets alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollwire.demo.teach import greedy_accuracy, greedy_completions
    from rollwire.learner.tasks.task import is_correct

    model: Any = AutoModelForCausalLM.from_pretrained(taught_model).eval()  # transformers types generate() loosely
    tokenizer = AutoTokenizer.from_pretrained(taught_model)
    vocab = tokenizer.get_vocab()
    _, held = addition_examples(0.1)
    examples = eval_subset(held, 8, 3)
    # Cut some prompts short so the batch really pads: the helper serves any prompts, not just the task's.
    prompts = [[vocab[c] for c in e.prompt] for e in examples] + [
        [vocab[c] for c in e.prompt[k:]] for k, e in enumerate(examples[:4], 1)
    ]
    assert len(set(map(len, prompts))) == 5
    alone = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([p]), max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        alone.append(tokenizer.decode(out[0, len(p) :], skip_special_tokens=True))
    assert greedy_completions(model, tokenizer, prompts, 5) == alone
    want = sum(is_correct(t, e.answer) for t, e in zip(alone, examples, strict=False)) / len(examples)
    assert greedy_accuracy(model, lambda s: [vocab[c] for c in s], tokenizer, examples) == want
