"""Making a trained model cheaper under the strategy's layouts: pruning, distillation, quantization-aware training.

- :class:`MagnitudePruning`: a Lightning callback; one global magnitude threshold over the shards of
  all ranks, or 2:4 semi-structured masks; gradual schedules; masks re-applied after every
  optimizer step, carried by checkpoints and ``export`` as zeros. :class:`ChannelPruning`: whole
  MLP channels, the same global threshold over the channels of all ranks.
- :class:`KnowledgeDistillation`: a Lightning callback; a frozen teacher beside the user's unchanged
  ``training_step``, the KL on vocabulary-sharded logits under tensor parallelism.
- :class:`QuantizationAwareTraining`: torchao's QAT prepare step on the unchanged module before the
  strategy's setup; :func:`convert_qat` and :func:`post_training_quantize` in one process after it.
"""

from lightning_parallel.compression.channels import ChannelPruning, mlp_pairs
from lightning_parallel.compression.distillation import KnowledgeDistillation
from lightning_parallel.compression.kd_loss import distillation_kl
from lightning_parallel.compression.pruning import MagnitudePruning
from lightning_parallel.compression.qat import QuantizationAwareTraining, convert_qat, post_training_quantize
from lightning_parallel.compression.schedule import PruningSchedule
from lightning_parallel.compression.threshold import kth_smallest_magnitude

__all__ = [
    "ChannelPruning",
    "mlp_pairs",
    "QuantizationAwareTraining",
    "convert_qat",
    "post_training_quantize",
    "KnowledgeDistillation",
    "MagnitudePruning",
    "distillation_kl",
    "PruningSchedule",
    "kth_smallest_magnitude",
]
