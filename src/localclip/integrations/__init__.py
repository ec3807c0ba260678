"""Glue between localclip and the training frameworks users already run.

Each module here adapts CELGC to one framework's habits and imports that framework only when
used: :mod:`localclip.integrations.accelerate` (Hugging Face Accelerate) and
:mod:`localclip.integrations.lightning` (PyTorch Lightning).
"""
