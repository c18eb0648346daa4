"""Run as a script: the transformers engine meets real allocation failures, no injection.

`python real_oom.py MODEL HEADROOM_MIB` loads the engine, runs 6 one-row groups alone (their
reference tokens), then caps the process's address space (RLIMIT_AS) at its size plus
HEADROOM_MIB and starts a large group (32 rows, a 200-token prompt, 50 new tokens) and, once it
decodes, the 6 small groups again. Run it with MALLOC_MMAP_THRESHOLD_=65536 so large tensors are
mapped and unmapped (the address space then follows what the cache holds). Prints one JSON
line: how the large group ended and, per small group, "ok" (its reference tokens), "wrong
tokens" or its error's reason. Every wait has a deadline: a dead engine thread shows as
"timeout", never as a hang.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from pathlib import Path

from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.embedded.prefix_cache import PrefixCacheSettings
from rollwire.generator.types import GroupRequest, SamplingParams
from support.engines import collect

DEADLINE_S = 60.0


def group(rid: str, n: int, tokens: int, seed: int, prompt: list[int]) -> GroupRequest:
    return GroupRequest(rid, prompt, n, SamplingParams(max_new_tokens=tokens, seed=seed, ignore_eos=True))


def address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


async def outcome(coro, reference=None) -> str:
    try:
        result = await asyncio.wait_for(coro, DEADLINE_S)
    except TimeoutError:
        return "timeout"
    except Exception as exc:
        return str(getattr(exc, "reason", "") or type(exc).__name__)
    return "ok" if reference is None or result["tokens"] == reference else "wrong tokens"


async def main(model: Path, headroom_mib: int) -> dict:
    engine = te.TransformersEngine(
        model, max_batch_rows=64, max_batch_tokens=10**7, threads=1, prefix_cache=PrefixCacheSettings(max_tokens=0)
    )
    await engine.start()
    smalls = [group(f"small{s}", 1, 12, s, [5, 17, 33]) for s in range(10, 16)]
    alone = [(await collect(engine, g))["tokens"] for g in smalls]
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + headroom_mib * 2**20, resource.RLIM_INFINITY))
    try:
        big_stream = engine.generate(group("big", 32, 50, 1, [(i % 90) + 3 for i in range(200)]))
        first = await outcome(anext(big_stream))
        if first != "ok":
            return {"big": first, "smalls": [], "big_failed_in": "its prefill"}

        async def rest() -> dict:
            async for _ in big_stream:
                pass
            return {"tokens": None}

        big = asyncio.create_task(outcome(rest()))
        results = await asyncio.gather(
            *(outcome(collect(engine, g), ref) for g, ref in zip(smalls, alone, strict=True))
        )
        return {"big": await big, "smalls": results}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        await asyncio.wait_for(engine.close(), DEADLINE_S)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))), flush=True)
