from . import blockwise_transformer, glat_drafter  # noqa: F401
