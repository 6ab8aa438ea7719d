"""A decoder step's state for a new batch, sized once where the step's buffers have fixed sizes.

The static step (step/static.py) records its calls on buffers whose addresses must not move, so
a cache that outgrows its capacity mid-batch is copied into a new slot, with graphs recorded
anew. The engine knows each batch's length limit when the batch starts; passing it here sizes
the buffers once. The other steps grow their caches as they go and take no limit.
"""


def new_batch_state(step, max_len: int):
    """``step``'s state for a batch whose rows output at most ``max_len`` tokens (EOS
    included): the static step reserves BOS and ``max_len`` cache entries per row."""
    from fairseq_pardec.decoding.step.static import StaticBlockDecoder

    if isinstance(step, StaticBlockDecoder):
        return step.new_state(max_len=max_len)
    return step.new_state()
