from fairseq_pardec.criterions import blockwise_cross_entropy, glat_loss  # noqa: F401
