"""The hybrids plug-in: linear-attention hybrids (Qwen3.5-MoE, Qwen3-Next). It has no options of its own: it
loads when a config names one of its MODEL_TYPES (a checkpoint's config.json, a preset), and `hybrids.family`
then registers the families (support/hf.FAMILIES) and the Gated DeltaNet layer (model.MIXERS).
Nothing of the project is imported at this module's top: deleting the folder takes its families with it."""
MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_next")
LAYER_TYPES = ("gated_attention", "linear_attention")   # its full attention is gated (model.MIXERS)
TRAIN: list = []
ROLLOUT: list = []
