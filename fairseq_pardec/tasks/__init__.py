from fairseq_pardec.tasks import translation_pardec  # noqa: F401  (registers --task translation_pardec)
from fairseq_pardec.tasks import hub_overrides

# from_pretrained(..., task='translation_pardec', generator=...) on a stock task's checkpoint
hub_overrides.install()
