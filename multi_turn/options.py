"""The multi-turn plug-in: the built-in multi-turn tasks. It has no options of its own: it loads when --task names
one of its TASKS, and multi_turn.tasks then adds them to support/tasks.TASKS. Nothing of the project is imported at
this module's top: deleting the folder takes these tasks with it."""
TASKS = ("lookup", "fix")
SUPERVISED_TASKS = ("fix",)           # with reference answers: --sft_steps trains on them
TRAIN: list = []
ROLLOUT: list = []
