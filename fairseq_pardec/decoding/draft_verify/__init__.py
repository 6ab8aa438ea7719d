"""The draft-and-verify engine: a drafter proposes tokens (``drafters``), one decoder call
verifies them all, an acceptance rule keeps a prefix (``acceptance``, or ``speculative`` for
sampling), and the loop (``engine``) commits it. fairseq's per-step rules (decoding/fairseq_rules.py)
and the margin guard (``margin_guard``) keep exact acceptance identical to fairseq's greedy search;
each batch's schedule (``drafters.schedule``) decides which rows draft, how much and when, its
``backoff`` stopping rows whose drafts keep being rejected.
"""
