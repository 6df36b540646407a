"""specgate: EAGLE-3 drafter training and a load gate for speculative decoding."""

__version__ = "0.1.0"
