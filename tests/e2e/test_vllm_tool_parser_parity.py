"""The door's hermes parse gives vLLM's own answer (issue 50, item 1): vLLM 0.32's
Hermes2ProToolParser, run in `.venv-vllm` over the same hand-written and generated texts
(tests/support/tool_texts.py), finds the same calls (names, re-serialized arguments) and the
same content as rollwire's dialect/tools.parse_hermes, with vLLM's serving rule applied to its
content (whitespace before calls is none). No vLLM server: its parser only (~10 s to import)."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
from support.tool_texts import TEXTS, generated
from support.vllm import VLLM_PYTHON, require_vllm

from rollwire.proxy.http.dialect.tools import parse_hermes

pytestmark = pytest.mark.slow

VLLM_SIDE = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(sys.argv[1]))
request = ChatCompletionRequest(
    model="m", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {"name": "f"}}]
)
out = []
for text in json.load(open(sys.argv[2])):
    info = parser.extract_tool_calls(text, request)
    content = info.content
    if info.tools_called and content is not None and not content.strip():
        content = None
    calls = [[c.function.name, c.function.arguments] for c in info.tool_calls] if info.tools_called else []
    out.append([content, calls])
json.dump(out, open(sys.argv[3], "w"))
"""


def test_parse_hermes_answers_as_vllms_parser(tiny_model, tmp_path):
    require_vllm()
    rng = random.Random(7)
    texts = [t for t in TEXTS if len(t) < 1000] + [generated(rng) for _ in range(400)]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    argv = [
        str(VLLM_PYTHON),
        "-c",
        VLLM_SIDE,
        str(tiny_model),
        str(tmp_path / "texts.json"),
        str(tmp_path / "out.json"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "out.json").read_text())
    ours = [[p.content, [[c.name, c.arguments] for c in p.calls]] for p in map(parse_hermes, texts)]
    differ = [(text, want, got) for text, want, got in zip(texts, theirs, ours, strict=True) if want != got]
    assert not differ, differ[:5]
    assert sum(1 for _, calls in theirs if calls) > 100  # the corpus holds calls, not only refusals
