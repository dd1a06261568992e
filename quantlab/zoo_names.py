"""Names of the reference models in :mod:`quantlab.zoo`, importable without torch.

The command line lists them while building its parser; importing the zoo itself
imports torch (seconds, hundreds of MB). ``quantlab.zoo`` checks its registry
against this tuple at import.
"""

ZOO_NAMES = ("shapes-det", "digits-cnn", "digits-vit")
