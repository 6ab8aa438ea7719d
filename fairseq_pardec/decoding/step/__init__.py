"""The decoder step and its cache.

``block_decoder.BlockDecoder`` is the interface (and runs fairseq's own modules); ``lean`` repeats
fairseq's operations in fairseq's order on its own cache; ``fast`` computes the same function
with a static cache and fused products; ``block_layout`` packs ragged blocks; and
``output_projection`` scores the vocabulary.
"""
