"""A LoRA adapter of the tiny model that really writes hermes tool calls: taught here, in seconds on
a CPU, as the demo teaches addition (no hub). Given the door fleet's chat prompt for "A+B="
(support.door_fleet.TEMPLATE: `u:A+B=\\na:`) it writes
`<tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>` and EOS, greedily, for the
pairs it was taught (PAIRS); teaching stops once greedy decoding writes every one of them."""

from __future__ import annotations

from pathlib import Path

PAIRS = [(12, 34), (7, 45), (50, 21), (3, 9)]
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def prompt_text(a: int, b: int) -> str:
    return f"u:{a}+{b}=\na:"


def call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def teach_tool_calls(model_dir: Path, dest: Path, max_steps: int = 400) -> Path:
    """A PEFT folder (save_pretrained) at `dest` whose adapter writes PAIRS' calls greedily."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=16, lora_alpha=32, target_modules=targets)
    )
    rows = [
        (
            tokenizer.encode(prompt_text(a, b), add_special_tokens=False),
            [*tokenizer.encode(call_text(a, b), add_special_tokens=False), tokenizer.eos_token_id],
        )
        for a, b in PAIRS
    ]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[i, : len(p) + len(c)] = 1
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    for step in range(max_steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 24 and _writes_every_call(model, tokenizer, rows):
            break
    else:
        raise AssertionError(f"the adapter did not learn to write the calls in {max_steps} steps")
    model.save_pretrained(str(dest))
    return dest


def _writes_every_call(model, tokenizer, rows) -> bool:
    import torch

    model.eval()
    try:
        with torch.no_grad():
            for prompt, completion in rows:
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=len(completion) + 4,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                if out[0, len(prompt) :].tolist() != completion:
                    return False
        return True
    finally:
        model.train()
