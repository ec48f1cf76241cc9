"""Models and the protocol every model provides (:mod:`jaxpar.models.protocol`): a Megatron-split MLP
classifier and a decoder-only GPT, with logical axis names, and generation for any model of the protocol."""
from jaxpar.models.generation import generate
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.mlp import MLP, MLPModel, classification_loss
from jaxpar.models.protocol import SHAPE_LEGEND, Model, as_model

__all__ = ["GPT", "GPTConfig", "MLP", "MLPModel", "Model", "SHAPE_LEGEND", "as_model", "classification_loss",
           "generate"]
