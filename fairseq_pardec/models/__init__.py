from . import blockwise_transformer, glat_drafter, ibdecoder  # noqa: F401
