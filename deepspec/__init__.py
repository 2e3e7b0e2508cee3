"""DeepSpec: train, calibrate, evaluate and export draft models for speculative decoding."""

__version__ = "0.1.0"
