"""The door's dialect: OpenAI's and vLLM's request and response shapes and what they mean in
rollwire's terms, at the bottom of the door (it imports nothing else of the door's).

openai.py (request bodies, the documented no-op fields), convert.py (a body into the core's
GenerateRequest, once), prompts.py and tokenizer.py (chat templates and tokenization, bounded
before work), vocabulary.py (/tokenize and /detokenize), names.py (served model names and
versions), errors.py (OpenAI-style error bodies, the HTTP status each gRPC code maps to).
"""
