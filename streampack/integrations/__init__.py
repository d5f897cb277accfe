"""A streampack stream handed to the trainers people use, with no glue of their own.

- ``torch``: ``StreamDataset``, a ``torch.utils.data.IterableDataset`` over one rank's
  ``BatchStream`` for plain PyTorch loops and ``torchdata``'s ``StatefulDataLoader``,
  whose ``state_dict()`` carries every rank's cursor.
- ``hf``: ``StreamTrainer`` / ``StreamSFTTrainer`` (and ``StreamTrainerMixin`` for any
  other ``transformers.Trainer``): each rank trains exactly its own batches, the step's
  count comes from ``step_targets``, and every checkpoint holds the stream's state.
- ``lightning``: ``StreamDataModule`` for PyTorch Lightning.

Each module imports its framework when it is imported (``import streampack`` never
does), with an error naming the extra to install.
"""
