"""A copy of each metrics row to an experiment tracker, tensorboard or wandb (--log_to). metrics.jsonl stays
the run's record; this plug-in's step hooks (support/hooks.py) open the tracker, hand it each row rank 0
writes (`log`) and end its run with the run's exit code (`finish`).
"""
