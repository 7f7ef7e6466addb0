"""diagnostics.jsonl: each step's most mismatched sequences (diagnostics/rows.py: their tokens, log-probs and
routes on both sides), and with --diagnostics_holdout those sequences held out of the update, so that what
the file shows is not trained on. Two step hooks (support/hooks.py): `hold_out` (the loss mask without them,
chosen from the recomputed old policy before any update) and `rank_files` (each rank's rows, appended by
rank 0).
"""
