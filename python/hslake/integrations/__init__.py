"""Adapters that feed hslake datasets to existing EAGLE-3 trainers, unchanged.

- ``hslake.integrations.speculators.SpeculatorsLoader``: packed batches exactly as
  speculators 0.9's ``CollateFn`` (with ``shift_batch``) builds them.
- ``hslake.integrations.specforge.SpecForgeLoader``: padded batches exactly as SpecForge
  0.2's ``DataCollatorWithPadding`` builds them from its offline files.

Both pick the trainer's layers with the loader's named presets (``hslake.preset_points``), so
a dataset that lacks a layer, or holds the target on the wrong side of the final norm, is
refused when the loader opens. Neither module imports its trainer.
"""
