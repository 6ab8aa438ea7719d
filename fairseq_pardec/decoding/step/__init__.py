"""The decoder step and its cache.

``block_decoder.BlockDecoder`` is the interface (and runs fairseq's own modules); ``lean`` repeats
fairseq's operations in fairseq's order on its own cache; ``fast`` computes the same function
on the CPU with a static cache, fused products and the native kernels (``native*``,
``products``, ``layer_stack``); ``static`` computes it on CUDA with fixed shapes, recorded as
graphs by ``cuda_graphs``; ``factory`` picks one per decoder, device and dtype; ``margins`` is
what each declares of its rounding against fairseq's; ``block_layout`` packs ragged blocks; and
``output_projection`` scores the vocabulary.
"""
