"""How large a request's prompt and group key may be, judged before anything reads them: one
rule for every server.

Invariants:
- a prompt of token ids may hold at most `max_prompt_tokens` ids; a text prompt at most
  `max_prompt_tokens` x PROMPT_BYTES_PER_TOKEN UTF-8 bytes (a token is rarely longer), so the
  bound is known before any tokenizing;
- the check costs O(1) for almost every text (characters <= UTF-8 bytes <= 4 x characters: the
  length alone settles it) and never walks token ids;
- a group key has at most MAX_GROUP_KEY_CHARS characters (a hash of a longer key routes the same);
- a replica applies them with its own limit before it tokenizes (generator/convert.py), the proxy
  with the largest limit of its routable replicas before it keys, copies or sends a group
  (proxy/core.py): a request no replica would take for its size is refused where it arrives.
"""

from __future__ import annotations

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.serving.config import PROMPT_BYTES_PER_TOKEN
from rollwire.v1 import generator_pb2 as pb

MAX_GROUP_KEY_CHARS = 1024
"""Longest group_key: the replica ignores it, the proxy hashes it to route."""


def check_group_key(request: pb.GenerateRequest) -> None:
    """INVALID_ARGUMENT (BAD_GROUP_KEY) for a group key over MAX_GROUP_KEY_CHARS."""
    if len(request.group_key) > MAX_GROUP_KEY_CHARS:
        raise InvalidArgument(
            f"group_key has {len(request.group_key)} characters; use at most {MAX_GROUP_KEY_CHARS} "
            "(a hash of a long key routes the same)",
            reason=Reason.BAD_GROUP_KEY,
        )


def text_over(text: str, cap: int) -> bool:
    """Whether `text` has more than `cap` UTF-8 bytes, encoding it only when its length cannot tell."""
    return len(text) > cap or (4 * len(text) > cap and len(text.encode("utf-8", "surrogatepass")) > cap)


def check_prompt_size(request: pb.GenerateRequest, max_prompt_tokens: int, holder: str = "this replica") -> None:
    """INVALID_ARGUMENT (PROMPT_TOO_LONG) for a prompt larger than `max_prompt_tokens` allow,
    naming the limit as `holder`'s."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        cap = max_prompt_tokens * PROMPT_BYTES_PER_TOKEN
        if text_over(request.text, cap):
            raise InvalidArgument(
                f"the prompt text is longer than {cap} bytes ({PROMPT_BYTES_PER_TOKEN} bytes for each of the "
                f"{max_prompt_tokens} tokens a prompt may have on {holder}); shorten it, or send token_ids",
                reason=Reason.PROMPT_TOO_LONG,
            )
    elif kind == "token_ids" and len(request.token_ids.ids) > max_prompt_tokens:
        raise InvalidArgument(
            f"the prompt has {len(request.token_ids.ids)} tokens; {holder} accepts at most {max_prompt_tokens}",
            reason=Reason.PROMPT_TOO_LONG,
        )
