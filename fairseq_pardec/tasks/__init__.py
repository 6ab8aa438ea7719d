from fairseq_pardec.tasks import translation_pardec  # noqa: F401  (registers --task translation_pardec)
