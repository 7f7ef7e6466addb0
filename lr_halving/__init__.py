"""The lr-halving plug-in: --lr_schedule=halving, lr halved every --lr_decay_period steps after the warmup or
from a response-length surge (--halving_start=surge; the surge detector, runlog.LengthSurge, is the core's).
lr_halving/lr_schedules.py holds the schedule, through the step hooks' `lr` seam (support/hooks.py).
"""
