"""`make demo-trl`'s pure pieces (rollwire.demo.trl): the chat template TRL renders prompts
with and the reward in TRL's shape, checked alone. Runs of the whole demo:
tests/e2e/test_demo_trl_runs.py."""

from __future__ import annotations

import pytest

from rollwire.learner.tasks.task import addition_examples


def test_the_chat_template_renders_a_user_message_as_the_raw_task_prompt():
    from rollwire.demo.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    prompt = addition_examples(0.1)[0][7].prompt
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)  # as TRL calls it
    assert tokenizer.apply_chat_template(messages, tokenize=False) == prompt
    assert list(ids) == tokenizer.encode(prompt)  # what the model was taught, token for token
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "052"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == f"{prompt}052</s>"


def test_a_completion_parses_back_to_its_text_without_eos():
    pytest.importorskip("trl")
    from trl.chat_template_utils import parse_response

    from rollwire.demo.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    prompt = tokenizer.encode("07+45=")
    eos: int = tokenizer.eos_token_id  # pyright: ignore[reportAssignmentType]  # the tiny tokenizer defines it
    reply = parse_response(tokenizer, [*tokenizer.encode("052"), eos], prefix=prompt)
    assert reply == {"role": "assistant", "content": "052"}
    assert parse_response(tokenizer, tokenizer.encode("05"), prefix=prompt)["content"] == "05"  # cut at max tokens


def test_the_reward_is_the_learners_exact_match_in_trls_shape():
    pytest.importorskip("trl")
    from rollwire.demo.trl_trainer import exact_match_reward

    completions = [[{"role": "assistant", "content": "052"}], [{"role": "assistant", "content": " 052 "}], [], "051"]
    assert exact_match_reward(completions, ["052", "052", "052", "052"], prompts=[None] * 4) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        exact_match_reward(completions, ["052"])  # lengths must agree
