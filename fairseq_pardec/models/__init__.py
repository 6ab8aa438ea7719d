from . import blockwise_transformer  # noqa: F401
