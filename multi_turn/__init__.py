"""The built-in multi-turn tasks, lookup (a tool call, then its use) and fix (attempts with the environment's
feedback): multi_turn/tasks.py. The episodes' machinery (support/tasks.Episodes, the sampler's turns) is the
core's, which a JSONL task's --env uses too.
"""
