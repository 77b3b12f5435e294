"""Flax NNX policies for classification as RL and their pure functional view.

See docs/method.md#classification-as-rl and docs/method.md#the-packages-layers.
"""

from sera_jax.common.models.cnn import SmallCNN
from sera_jax.common.models.functional import MODEL_BUILDERS, FunctionalModel, create_model
from sera_jax.common.models.mlp import MLP
from sera_jax.common.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50

__all__ = [
    "MLP",
    "MODEL_BUILDERS",
    "BasicBlock",
    "Bottleneck",
    "FunctionalModel",
    "ResNet",
    "SmallCNN",
    "create_model",
    "resnet18",
    "resnet50",
]
