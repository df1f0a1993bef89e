from triax.models.gpt import GPT, GPTConfig, PRESETS

__all__ = ["GPT", "GPTConfig", "PRESETS"]
