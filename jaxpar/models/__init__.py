"""Models: a Megatron-split MLP classifier and a decoder-only GPT, with logical axis names."""
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.mlp import MLP, classification_loss

__all__ = ["GPT", "GPTConfig", "MLP", "classification_loss"]
