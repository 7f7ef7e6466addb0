"""The families plug-in: every model family but Qwen3-MoE (the core's, support/hf.py) and the hybrids (hybrids/).
It has no options of its own: it loads when a config names one of its MODEL_TYPES (a checkpoint's config.json,
a preset), and `families.family` then registers their entries in support/hf.FAMILIES. Nothing of the project is
imported at this module's top: deleting the folder takes these families with it."""
MODEL_TYPES = ("qwen3", "qwen2_moe", "olmoe", "mixtral", "glm4_moe", "gpt_oss", "dots1", "minimax_m2", "deepseek_v3",
               "deepseek_v2", "glm4_moe_lite")
TRAIN: list = []
ROLLOUT: list = []
