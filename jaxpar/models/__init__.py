"""Models and the protocol every model provides (:mod:`jaxpar.protocol`): a Megatron-split MLP
classifier and a decoder base (:mod:`jaxpar.models.decoder`) whose configurations are the decoder-only GPT, the
Llama, and the Qwen2, Qwen3, Mistral and Gemma 3 families (:mod:`jaxpar.models.families`) (Hugging Face
checkpoints in and out, one weight adapter per family: :mod:`jaxpar.models.hf`), with logical axis names, and generation for any model
of the protocol."""
from jaxpar.models import hf  # safetensors loads only when a checkpoint is read
from jaxpar.models.blocks import Architecture
from jaxpar.models.decoder import Decoder
from jaxpar.models.families import FamilyConfig, FamilyModel
from jaxpar.models.generation import generate
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.mlp import MLP, MLPModel, classification_loss
from jaxpar.protocol import SHAPE_LEGEND, Model, as_model

__all__ = ["Architecture", "Decoder", "FamilyConfig", "FamilyModel", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP",
           "MLPModel", "Model", "SHAPE_LEGEND", "as_model", "classification_loss", "generate", "hf"]
