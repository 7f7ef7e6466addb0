"""The entropy-bonus plug-in: --entropy_coef=c subtracts c times each response token's entropy from the
per-token loss, through the step hooks' `token_terms` seam (entropy_bonus/bonus.py).
"""
