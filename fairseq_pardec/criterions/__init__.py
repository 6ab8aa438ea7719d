from . import blockwise_cross_entropy, glat_loss  # noqa: F401
