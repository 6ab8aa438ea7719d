from fairseq_pardec.models import blockwise_transformer, glat_drafter, ibdecoder  # noqa: F401
