"""A LoRA adapter of the tiny model that really writes hermes tool calls: taught here, in seconds on
a CPU, as the demo teaches addition (no hub). Given the door fleet's chat prompt for "A+B="
(support.door_fleet.TEMPLATE: `u:A+B=\\na:`) it writes
`<tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>` and EOS, greedily, for the
pairs it was taught (PAIRS); given the tool's result back it writes A+B and EOS, for the next
turn's prompt as the chat route renders it (`u:A+B=\\na:\\nt:SUM\\na:`: the template writes no calls)
and as a harness stitches it from the sampled ids (the call's text, EOS, then `t:SUM\\na:`, as
verifiers' training client does). Teaching stops once greedy decoding writes every one of them.
`tool_caller` keeps the taught folder once per machine (support.learner.CACHE), keyed by this file
and the model's weights."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
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


def answer_prompt_text(a: int, b: int) -> str:
    """The turn after the call, as the door fleet's template renders it (a tool-call turn's null content is "")."""
    return f"u:{a}+{b}=\na:\nt:{a + b}\na:"


def tool_caller(model_dir: Path) -> Path:
    """The taught adapter's folder, taught here unless this machine's cache holds it (a lock file keeps
    two test processes from teaching it at once); copy it under an adapter root to load it."""
    from support.learner import CACHE

    digest = hashlib.sha256(Path(__file__).read_bytes() + (Path(model_dir) / "model.safetensors").read_bytes())
    folder = CACHE / f"tool-caller-{digest.hexdigest()[:16]}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "adapter_config.json").is_file():
            aside = folder.with_name(folder.name + ".partial")
            shutil.rmtree(aside, ignore_errors=True)
            teach_tool_calls(model_dir, aside)
            aside.rename(folder)
    return folder


def teach_tool_calls(model_dir: Path, dest: Path, max_steps: int = 600) -> Path:
    """A PEFT folder (save_pretrained) at `dest` whose adapter writes PAIRS' calls and answers greedily."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=16, lora_alpha=32, target_modules=targets)
    )

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    eos = tokenizer.eos_token_id
    rows = []
    for a, b in PAIRS:
        call = [*ids(call_text(a, b)), eos]
        rows.append((ids(prompt_text(a, b)), call))
        rows.append((ids(answer_prompt_text(a, b)), [*ids(str(a + b)), eos]))
        rows.append((ids(prompt_text(a, b)) + call + ids(f"t:{a + b}\na:"), [*ids(str(a + b)), eos]))
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
