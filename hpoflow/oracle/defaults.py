"""What a time to train assumes when the user gives no data set size or epochs: per model family.

* image classifiers of the zoo (``resnet*``, ``vgg16``, ``inception-v3``): ImageNet-1k's training
  set, 1,281,167 images, for 90 epochs (the ResNet schedule Goyal et al. 2017 kept);
* ``bert-base`` (a sequence classifier of 128 tokens): fine-tuning on GLUE's SST-2, 67,349
  sentences, for 3 epochs (Devlin et al. 2019, section 4.1: "fine-tune for 3 epochs over the data
  for all GLUE tasks");
* decoder language models: 20 training tokens per parameter (Hoffmann et al. 2022's
  compute-optimal ratio), in sequences of the model's length, one epoch;
* the project's own models (``mlp``, ``cnn``, and any model registered for training): the digits
  data set's training split (1,437 images) for ``training.epochs``' default (10);
* anything else (a user's ``module:function``): ImageNet-1k for 90 epochs when its input is a
  3-channel image, else one epoch of 1,000,000 samples; the assumption is always printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpoflow.oracle._zoo import ZOO
from hpoflow.oracle._zoo_lm import LM_PRESETS
from hpoflow.oracle.facts import ModelFacts

__all__ = ["Assumed", "training_length"]

IMAGENET = 1_281_167
SST2 = 67_349
TOKENS_PER_PARAMETER = 20
DIGITS_TRAIN = 1_437  # hpoflow.train.data.dataset_info("digits")
TRAIN_CONFIG_EPOCHS = 10  # hpoflow.spec TrainConfig.epochs' default


@dataclass(frozen=True)
class Assumed:
    """A data set size and epochs, and the sentence that says where they come from."""

    dataset_size: int
    epochs: float
    why: str


def training_length(facts: ModelFacts) -> Assumed:
    """The data set size (samples per epoch) and epochs assumed for ``facts``' model family."""
    name = facts.name
    if name in LM_PRESETS or (facts.tokens_per_sample > 1 and name not in ZOO):
        seq = max(1, facts.tokens_per_sample)
        tokens = TOKENS_PER_PARAMETER * facts.params
        return Assumed(max(1, round(tokens / seq)), 1.0,
                       f"{TOKENS_PER_PARAMETER} tokens per parameter (Hoffmann et al. 2022): {tokens / 1e9:.1f} B "
                       f"tokens = {tokens / seq / 1e6:.2f} M sequences of {seq}, 1 epoch")
    if name == "bert-base":
        return Assumed(SST2, 3.0, f"GLUE SST-2 fine-tuning: {SST2:,} sentences, 3 epochs (Devlin et al. 2019)")
    if name in ZOO or (len(facts.input_shape) == 3 and facts.input_shape[0] == 3):
        return Assumed(IMAGENET, 90.0, f"ImageNet-1k: {IMAGENET:,} images, 90 epochs")
    if ":" not in name:
        return Assumed(DIGITS_TRAIN, float(TRAIN_CONFIG_EPOCHS),
                       f"the digits data set's training split: {DIGITS_TRAIN:,} images, "
                       f"{TRAIN_CONFIG_EPOCHS} epochs (training.epochs' default)")
    return Assumed(1_000_000, 1.0, "no known data set for this model: 1,000,000 samples, 1 epoch")
