"""The demo: teach a tiny model a task it partly knows, then watch GRPO finish the job.

Not part of the learner's core. tiny_model.py builds a small HF-format model and tokenizer
locally (no hub), teach.py gives it a partial grasp of the built-in task, run.py starts the
local stack (replicas, proxy, learner) and plot.py draws the learning curve.
`python -m rollwire.demo` runs it; `rollwire model tiny` (cli.py) builds the models alone.
"""
