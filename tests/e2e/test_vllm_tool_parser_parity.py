"""The door's tool-call parses give vLLM's own answer (issue 50, item 1): vLLM 0.32's parsers, run in
`.venv-vllm` as its server runs them (ParserManager's composed parser, `parse` with auto tools:
the content and calls a chat answer carries), over hand-written and generated texts
(tests/support/tool_texts.py), find the same calls (names, arguments as written) and the same
content as rollwire's toolcalls/ formats, for hermes, llama3_json, qwen3_xml (= qwen3_coder) and
mistral in both its forms (a tokenizer with `[ARGS]`: v11 and later; without: before v11). The
tiny model's tokenizer gets the tokens vLLM's parsers ask for as ordinary added tokens. No vLLM
server: its parsers only (~10 s to import)."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
from support import tool_texts
from support.tool_texts import TEXTS, TOOLS, generated
from support.vllm import VLLM_PYTHON, require_vllm

from rollwire.proxy.http.dialect.tokenizer import ChatTokenizer
from rollwire.proxy.http.dialect.toolcalls import format_for

pytestmark = pytest.mark.slow

VLLM_SIDE = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
cases = json.load(open(sys.argv[1]))
out = {}
for key, case in cases.items():
    tokenizer = AutoTokenizer.from_pretrained(case["tokenizer"])
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=case["tools"])
    composed = ParserManager.get_parser(tool_parser_name=case["parser"], enable_auto_tools=True, tokenizer=tokenizer)
    answers = []
    for text in case["texts"]:
        parser = composed(tokenizer, request.tools)
        _, content, calls = parser.parse(text, request, enable_auto_tools=True)
        answers.append([content, [[c.name, c.arguments] for c in calls or []]])
    out[key] = answers
json.dump(out, open(sys.argv[2], "w"))
"""

CASES = {
    # key: (parser, tokens added to the tokenizer, generator of texts)
    "hermes": ("hermes", [], generated),
    "llama3_json": ("llama3_json", ["<|python_tag|>"], tool_texts.llama3),
    "qwen3_xml": ("qwen3_xml", [], tool_texts.qwen3),
    "qwen3_coder": ("qwen3_coder", [], tool_texts.qwen3),
    "mistral": ("mistral", ["[TOOL_CALLS]", "[ARGS]"], tool_texts.mistral),
    "mistral_pre_v11": ("mistral", ["[TOOL_CALLS]"], tool_texts.mistral_pre_v11),
}
HAND_WRITTEN = [t for t in TEXTS if len(t) < 1000] + [
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>",
    "text <tool_call>garbage</tool_call> more",
    "  \n a b \n<function=f>\n</function>",
    "x <function=",
    "<tool_call>\n<function = f >\n<parameter = a >\n1\n</ parameter >\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=s\nv\n</parameter>\n</function>\n</tool_call>",
    'pre {"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": "s"} post',
    '{"name": "f", "arguments": {"a": 1}}{"name": "g", "arguments": {}}',
    '}{"name": "f", "arguments": {}}',
    'pre\n [TOOL_CALLS]f[ARGS]{"a": 1} post [TOOL_CALLS]g[ARGS]{}  tail',
    "[TOOL_CALLS] [TOOL_CALLS]f[ARGS]{}",
    "x [TOOL_CALLS]   ",
    '[TOOL_CALLS]f[ARGS]{"a": NaN}',
    '[TOOL_CALLS][TOOL_CALLS][{"name": "f", "arguments": {}}][TOOL_CALLS]more',
    '[TOOL_CALLS][1, {"name": "f", "arguments": null}]',
]


def tokenizer_with(tiny_model, folder, tokens: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_tokens(tokens)  # ordinary added tokens: the replicas' text keeps them
    tokenizer.save_pretrained(folder)
    return folder


def test_every_format_answers_as_vllms_parser(tiny_model, tmp_path):
    require_vllm()
    rng = random.Random(7)
    cases, formats = {}, {}
    for key, (parser, tokens, generate) in CASES.items():
        folder = tokenizer_with(tiny_model, tmp_path / key, tokens)
        texts = HAND_WRITTEN + [generate(rng) for _ in range(400)]
        cases[key] = {"parser": parser, "tokenizer": str(folder), "tools": TOOLS, "texts": texts}
        formats[key] = format_for(parser, *ChatTokenizer(folder).vocabulary())
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    argv = [str(VLLM_PYTHON), "-c", VLLM_SIDE, str(tmp_path / "cases.json"), str(tmp_path / "out.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "out.json").read_text())
    for key, case in cases.items():
        fmt = formats[key]
        ours = [
            [p.content, [[c.name, c.arguments] for c in p.calls]] for p in (fmt.parse(t, TOOLS) for t in case["texts"])
        ]
        differ = [(t, want, got) for t, want, got in zip(case["texts"], theirs[key], ours, strict=True) if want != got]
        assert not differ, (key, len(differ), differ[:4])
        assert sum(1 for _, calls in theirs[key] if calls) > 100, key  # the corpus holds calls, not only refusals
