from . import blockwise_cross_entropy  # noqa: F401
