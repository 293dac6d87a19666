"""The architectures a default test run takes: one per family of patterns (``pytest --slow``: the whole zoo)."""

FAST = ("llama", "qwen3-tied", "deepseek-v3", "gemma2", "gpt2", "falcon", "qwen3.5")
